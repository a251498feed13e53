"""Capture a target's residual stream with forward hooks.

Layer id `i` is the output of decoder layer `i` (what `output_hidden_states[i + 1]` holds for every
layer but the last), `-1` is the embedding output; `last` is the final hidden state *after* the
final norm (what the reference trains against). Hooks only record: they return nothing, so the
model's own outputs are untouched.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def decoder_layers(model) -> torch.nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find its decoder layers")
    return layers


@contextlib.contextmanager
def capture_layers(model, layer_ids: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Yields a dict that each forward fills with {layer id: [B, T, H] tensor}."""
    store: dict[int, torch.Tensor] = {}
    handles = []
    layers = decoder_layers(model)

    def hook_for(i: int):
        def hook(_module, _inputs, output):
            store[i] = output[0] if isinstance(output, tuple) else output
        return hook

    for i in layer_ids:
        module = model.get_input_embeddings() if i == -1 else layers[i]
        handles.append(module.register_forward_hook(hook_for(i)))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def forward_capture(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    layer_ids: list[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """One forward pass: ({layer id: hidden}, last hidden after the final norm). A tensor-parallel
    group's lead (tensor_parallel.Lockstep) runs it with its followers."""
    if hasattr(model, "capture"):
        return model.capture(input_ids, attention_mask, layer_ids)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    with capture_layers(model, layer_ids) as store:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return dict(store), out.last_hidden_state
