"""Right-padding collator: a list of samples -> one batch of padded tensors."""
from __future__ import annotations

import torch


def collate(samples: list[dict]) -> dict:
    """input_ids stay int32 on the host (the prefetcher widens them on the device). `tokens` (the batch's
    token count) is a host int, so that counting tokens never reads `lengths` back from the device. No
    attention mask: it is `arange(T) < lengths`, derived on the device where a model needs it."""
    sizes = [len(s["input_ids"]) for s in samples]
    B, T = len(samples), max(sizes)
    batch: dict = {
        "lengths": torch.tensor(sizes, dtype=torch.int64, device="cpu"),
        "tokens": sum(sizes),
        # uint64 ids do not fit an int64 tensor: keep them as Python ints
        "sample_id": [s["sample_id"] for s in samples] if "sample_id" in samples[0] else None,
    }
    for key, dtype in (("input_ids", torch.int32), ("loss_mask", torch.uint8)):
        if key in samples[0]:
            out = torch.zeros((B, T), dtype=dtype, device="cpu")
            for i, s in enumerate(samples):
                out[i, :len(s[key])] = s[key]
            batch[key] = out
    if "hidden" in samples[0]:  # [L, T, H] per sample -> [B, T, L*H]: the interleave rides on the pad copy
        L, _, H = samples[0]["hidden"].shape
        out = torch.zeros((B, T, L * H), dtype=samples[0]["hidden"].dtype, device="cpu")
        for i, s in enumerate(samples):
            n = s["hidden"].shape[1]
            out[i, :n].view(n, L, H).copy_(s["hidden"].transpose(0, 1))
        batch["hidden"] = out
    if "last_hidden" in samples[0]:
        out = torch.zeros((B, T, samples[0]["last_hidden"].shape[-1]), dtype=samples[0]["last_hidden"].dtype,
                          device="cpu")
        for i, s in enumerate(samples):
            out[i, :len(s["last_hidden"])] = s["last_hidden"]
        batch["last_hidden"] = out
    return {k: v for k, v in batch.items() if v is not None}
