"""Masked attention for the drafts, with key lengths that repeat on CUDA.

A draft attends from its blocks to the context with an explicit mask and fewer key/value heads than
query heads. On CUDA the only fused SDPA kernel that takes both is cuDNN's, and PyTorch builds a cuDNN
graph for every new shape it meets (tens of milliseconds of host time, forward and backward). Every
batch the loader pads has its own length, and every decoding round its own context length, so each
call paid that build: on an H200 (`benchmarks/train_overlap.py`) the training step with the real
loader ran at a small fraction of the same batches' speed once their shapes had been seen. Padding
the keys to a multiple of `KV_MULTIPLE`, with the extra columns masked out, bounds the shapes to
max_length / KV_MULTIPLE per query length; the graphs are built once each and reused. Masked-out
keys take no weight, so the output is the same attention. The CPU kernels have no such cost and run
unpadded (their results stay exactly what they were).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

KV_MULTIPLE = 128


def kv_multiple(device: torch.device) -> int:
    """The multiple key lengths are padded to on `device` (1: no padding)."""
    return KV_MULTIPLE if device.type == "cuda" else 1


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           enable_gqa: bool, multiple: int | None = None) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask=mask, ...)`, with k, v and the mask padded
    along the key axis to a multiple of `multiple` (default: `kv_multiple(q.device)`). Only a mask
    that spells out every key column is padded (a mask that broadcasts over keys, or none, runs as is)."""
    multiple = kv_multiple(q.device) if multiple is None else multiple
    n = k.shape[-2]
    pad = -n % multiple
    if pad and mask is not None and mask.shape[-1] == n:
        k = F.pad(k, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
        mask = F.pad(mask, (0, pad), value=False if mask.dtype == torch.bool else float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
