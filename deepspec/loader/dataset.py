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
lazily in each DataLoader worker (fork or forkserver). A DataLoader with a batch sampler hands a
whole batch to `__getitems__`: on S3 the byte ranges of all its arrays are then in flight together
(`read_ahead` requests, `range_bytes` each at most); locally the crc32c checks run on
`check_threads` threads alongside the reads (deepspec/cache/read/shards.py), in a DataLoader worker
in the reading thread unless `check_threads` is given. A trainer reads whole batches instead, straight
into their collated layout (loader/batches.py).
"""
from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset, get_worker_info

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.read.samples import FIELDS, read_samples


class TargetCacheDataset(Dataset):
    def __init__(self, url: str, layers: list[int] | None = None, fields: tuple[str, ...] = FIELDS,
                 storage_options: dict | None = None, cache_dir: str | None = None, verify: bool = True,
                 expect: dict | None = None, fast: bool = True, check_threads: int | None = None,
                 read_ahead: int | None = None, range_bytes: int | None = None, manifest: dict | None = None,
                 planned=None):
        unknown = [f for f in fields if f not in FIELDS]
        if unknown:
            raise ValueError(f"unknown fields {unknown} (known: {list(FIELDS)})")
        self.url = url
        # `manifest`: the parts and index a recorded manifest lists (CacheReader), not the root's now
        # `planned`: (manifest, index rows) of a store being filled (cache.build.fill; CacheReader)
        self.reader = CacheReader(url, storage_options, expect=expect, verify=verify, fast=fast,
                                  cache_dir=cache_dir, manifest=manifest, planned=planned)
        self.check_threads = check_threads
        if check_threads is not None:  # threads checking crc32c of local reads (CacheReader.check_threads)
            self.reader.set_check_threads(check_threads)
        if read_ahead is not None or range_bytes is not None:  # remote stores (CacheReader.read_ahead)
            self.reader.set_read_ahead(self.reader.read_ahead if read_ahead is None else read_ahead, range_bytes)
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

    def sample_parts(self) -> np.ndarray:
        """int64 [samples]: the part each sample is stored in (a sampler's window_parts)."""
        return np.repeat(np.arange(len(self.reader.parts)), np.diff(self.reader.part_start))

    @property
    def manifest(self) -> dict:
        return self.reader.manifest

    def reader_here(self) -> CacheReader:
        """The reader, set for the process that reads: in a DataLoader worker the crc32c checks run in
        the reading thread unless `check_threads` was given, since the workers already keep the cores
        busy and a helper thread in each only competes with them (benchmarks/loader_peers.py)."""
        if self.check_threads is None and self.reader.check_threads and get_worker_info() is not None:
            self.reader.set_check_threads(0)
        return self.reader

    def __getitem__(self, index: int) -> dict:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """Samples `indices` (a DataLoader hands a batch sampler's whole batch here): cache.samples."""
        return read_samples(self.reader_here(), indices, self.layers, self.fields)
