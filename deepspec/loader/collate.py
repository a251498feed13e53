"""Right-padding collator: a list of samples -> one batch of padded tensors.

Each output is written once: samples are copied into place and only the padding after each one is
zeroed. In a DataLoader worker the outputs are allocated in shared memory, as torch's default collate
does, because a worker sends its batch through shared memory and torch would copy a batch made
anywhere else into it (`benchmarks/collate.py` measures both against the zero-then-copy collator).
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import get_worker_info


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, in shared memory inside a DataLoader worker."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype, device="cpu")
    # torch's default_collate makes its worker outputs the same way
    storage = torch.empty(0, dtype=dtype, device="cpu")._typed_storage()._new_shared(math.prod(shape), device="cpu")
    return torch.empty(0, dtype=dtype, device="cpu").new(storage).view(shape)


def _padded(rows: list[torch.Tensor], T: int, dtype: torch.dtype, width: tuple[int, ...] = ()) -> torch.Tensor:
    """[B, T, *width]: row i holds rows[i] (its first dimension, viewed as `width`) then zeros."""
    out = host_empty((len(rows), T, *width), dtype)
    for i, r in enumerate(rows):
        n = r.shape[0]
        out[i, :n].view(r.shape).copy_(r)
        out[i, n:].zero_()
    return out


def collate(samples: list[dict]) -> dict:
    """input_ids stay int32 on the host (the prefetcher widens them on the device). `tokens` (the batch's
    token count) is a host int, so that counting tokens never reads `lengths` back from the device. No
    attention mask: it is `arange(T) < lengths`, derived on the device where a model needs it."""
    sizes = [len(s["input_ids"]) for s in samples]
    T = max(sizes)
    batch: dict = {
        "lengths": torch.tensor(sizes, dtype=torch.int64, device="cpu"),
        "tokens": sum(sizes),
        # uint64 ids do not fit an int64 tensor: keep them as Python ints
        "sample_id": [s["sample_id"] for s in samples] if "sample_id" in samples[0] else None,
    }
    for key, dtype in (("input_ids", torch.int32), ("loss_mask", torch.uint8)):
        if key in samples[0]:
            batch[key] = _padded([torch.as_tensor(s[key], device="cpu") for s in samples], T, dtype)
    if "hidden" in samples[0]:  # [L, T, H] per sample -> [B, T, L*H]: the interleave rides on the copy
        L, _, H = samples[0]["hidden"].shape
        batch["hidden"] = _padded([s["hidden"].transpose(0, 1) for s in samples], T, samples[0]["hidden"].dtype,
                                  (L * H,))
    if "last_hidden" in samples[0]:
        batch["last_hidden"] = _padded([s["last_hidden"] for s in samples], T, samples[0]["last_hidden"].dtype,
                                       (samples[0]["last_hidden"].shape[-1],))
    return {k: v for k, v in batch.items() if v is not None}
