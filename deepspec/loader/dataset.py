"""`TargetCacheDataset`: one cache sample as tensors, read through the fast shard path.

A sample is a dict of
    input_ids    int32    [T]
    loss_mask    uint8    [T]
    hidden       bfloat16 [L, T, H]  the requested layers, in the order asked for; each layer is one
                                     contiguous slab, so it is read straight into place (the
                                     collator interleaves them into [B, T, L*H] while padding)
    last_hidden  bfloat16 [T, H]     post-norm final state
    sample_id    int                 the row id as an integer (format.sample_id_to_str)
Only the requested layers and fields are read. The dataset is picklable and opens the store
lazily in each DataLoader worker (fork or forkserver).
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from deepspec.cache.format import CacheFormatError, decode_hidden, hidden_name, scale_name
from deepspec.cache.reader import CacheReader

FIELDS = ("input_ids", "loss_mask", "hidden", "last_hidden")


class TargetCacheDataset(Dataset):
    def __init__(self, url: str, layers: list[int] | None = None, fields: tuple[str, ...] = FIELDS,
                 storage_options: dict | None = None, cache_dir: str | None = None, verify: bool = True,
                 expect: dict | None = None, fast: bool = True, check_threads: int | None = None):
        unknown = [f for f in fields if f not in FIELDS]
        if unknown:
            raise ValueError(f"unknown fields {unknown} (known: {list(FIELDS)})")
        self.url = url
        self.reader = CacheReader(url, storage_options, expect=expect, verify=verify, fast=fast,
                                  cache_dir=cache_dir)
        if check_threads is not None:  # threads checking crc32c of local reads (CacheReader.check_threads)
            self.reader.set_check_threads(check_threads)
        cached = self.reader.layers
        self.layers = list(cached if layers is None else layers)
        missing = [i for i in self.layers if i not in cached]
        if missing:
            raise CacheFormatError(f"{url}: layers {missing} are not cached (cached layers: {cached})")
        self.fields = tuple(fields)
        self.hidden_size = int(self.reader.manifest["hidden_size"])
        self.dtype = self.reader.dtype

    def __len__(self) -> int:
        return len(self.reader)

    def lengths(self) -> np.ndarray:
        return self.reader.lengths()

    @property
    def manifest(self) -> dict:
        return self.reader.manifest

    def _hidden(self, part: int, start: int, stop: int, layers: list) -> torch.Tensor:
        """[len(layers), T, H] bfloat16."""
        r, H = self.reader, self.hidden_size
        if self.dtype == "bfloat16":
            buf = np.empty((len(layers), stop - start, H), dtype=np.uint16)
            for k, layer in enumerate(layers):
                r.read_array(part, hidden_name(layer), start, stop, out=buf[k])
            return torch.from_numpy(buf).view(torch.bfloat16)
        out = torch.empty((len(layers), stop - start, H), dtype=torch.bfloat16)
        for k, layer in enumerate(layers):
            bits = r.read_array(part, hidden_name(layer), start, stop)
            scale = r.read_array(part, scale_name(layer), start, stop)
            decode_hidden(bits, scale, self.dtype, out=out[k])
        return out

    def __getitem__(self, index: int) -> dict:
        part, start, stop = self.reader.locate(index)
        item: dict = {"sample_id": int(self.reader.sample_id(index))}
        with self.reader.checked():  # every array's checks settled before the item is handed out
            if "input_ids" in self.fields:
                item["input_ids"] = torch.from_numpy(self.reader.read_array(part, "input_ids", start, stop))
            if "loss_mask" in self.fields:
                item["loss_mask"] = torch.from_numpy(self.reader.read_array(part, "loss_mask", start, stop))
            if "hidden" in self.fields:
                item["hidden"] = self._hidden(part, start, stop, self.layers)
            if "last_hidden" in self.fields:
                item["last_hidden"] = self._hidden(part, start, stop, ["last"])[0]
        return item
