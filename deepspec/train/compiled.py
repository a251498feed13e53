"""`train.compile`: the draft's training forward and loss through torch.compile (TorchInductor).

At small widths a draft step is bound by the host launching kernels, not by the device running them:
every norm, rotary, softmax and mask op is a launch of its own, forward and backward. Compiling fuses
them into a few kernels per region. What is compiled, in place (the model's state-dict names stay its
own, so checkpoints and saved drafts do not change):
  - DSpark and DFlash: the whole training forward, the loss included. The supervised slots are picked
    by a `nonzero` whose size depends on the data; it is captured as an op of data-dependent size
    instead of splitting the graph there.
  - EAGLE-3: its decoder layer around the attention (norms, projections, rotary; then the output
    projection, the residuals and the MLP). Its loss loops on the host over chain steps and target
    chunks whose number depends on the data, so the loop itself stays eager.
Shapes are dynamic: one graph serves every batch length (the loader pads each batch to its own
longest row), so a run compiles a bounded number of graphs, not one per length: a general one, and
one more where a size is 1 (a last batch of one row), which torch specialises.

A compiled step reorders and fuses floating-point work, so its bits differ from the eager step's
(tests/train/test_compile.py states the tolerance); a resume compares the setting for that reason.
"""
from __future__ import annotations

import functools

import torch
from torch import nn


def compiles(setting: bool | str, device: torch.device) -> bool:
    """`train.compile` resolved for a device: auto = on CUDA only."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def _dynamic_sizes(fn):
    """`fn` compiled with dynamic shapes; its trace may capture ops whose output size depends on data."""
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            return compiled(*args, **kwargs)
    return call


def compile_draft(model: nn.Module) -> nn.Module:
    """Compile `model`'s training regions in place (see the module doc); returns it."""
    if model.config.algorithm == "eagle3":
        for layer in model.layers:
            layer.attention_inputs = _dynamic_sizes(layer.attention_inputs)
            layer.attention_output = _dynamic_sizes(layer.attention_output)
    else:
        model.forward = _dynamic_sizes(model.forward)
    return model
