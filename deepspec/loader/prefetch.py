"""Move batches to the device ahead of use.

On CUDA: pinned host buffers, copies issued on a side stream with `non_blocking=True`, the next
batch in flight while the current one computes, `record_stream` so the caching allocator does not
reuse a buffer the compute stream still reads. Without CUDA: the same interface, a plain pass.
In both cases `input_ids` arrive widened to int64 (the host keeps them int32: half the bytes).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch


def _widen(batch: dict) -> dict:
    if "input_ids" in batch:
        batch["input_ids"] = batch["input_ids"].long()
    return batch


class Prefetcher:
    def __init__(self, loader: Iterable[dict], device: torch.device | str):
        self.loader = loader
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def _to_device(self, batch: dict) -> dict:
        out = {}
        with torch.cuda.stream(self.stream):
            for k, v in batch.items():
                if isinstance(v, torch.Tensor):
                    v = v if v.is_pinned() else v.pin_memory()
                    out[k] = v.to(self.device, non_blocking=True)
                else:
                    out[k] = v
        return out

    def __iter__(self) -> Iterator[dict]:
        if not self.cuda:
            for batch in self.loader:
                yield _widen(batch)
            return
        it = iter(self.loader)
        try:
            nxt = self._to_device(next(it))
        except StopIteration:
            return
        while nxt is not None:
            current = nxt
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            for v in current.values():
                if isinstance(v, torch.Tensor):
                    v.record_stream(torch.cuda.current_stream(self.device))
            try:
                nxt = self._to_device(next(it))  # in flight while the caller computes on `current`
            except StopIteration:
                nxt = None
            yield _widen(current)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]
