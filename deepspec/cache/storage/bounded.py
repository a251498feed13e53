"""`BoundedCache`: what a reading process keeps of the parts it has touched (Zarr shard indexes, HDF5
chunk tables, array layouts), bounded in bytes with the least recently used entries evicted first.

A training run reads every part of a store each epoch, and each of its `1 + num_workers` processes
per rank used to keep every table it had read for ever (estimated ~2 GB a process for Zarr, ~20 GB
for HDF5's Python lists at the reference size). An evicted entry is read again when its part comes
back: one small read, checksummed like the first.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import fields, is_dataclass

import numpy as np

ENTRY_BYTES = 256  # what an entry costs besides its arrays (key, dict slot, small objects)


def nbytes(value) -> int:
    """The bytes `value` holds in numpy arrays (inside tuples, lists, dicts and dataclasses), plus ENTRY_BYTES."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes) + ENTRY_BYTES
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values()) + ENTRY_BYTES
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value) + ENTRY_BYTES
    if is_dataclass(value):
        return sum(nbytes(getattr(value, f.name)) for f in fields(value)) + ENTRY_BYTES
    return ENTRY_BYTES


class BoundedCache:
    """A mapping of at most `max_bytes` (by `nbytes`), least recently used first out; thread-safe.
    One entry larger than the bound is kept alone (the reader needs it for the read in hand)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def get(self, key, default=None):
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return default
            self._items.move_to_end(key)
            return item[0]

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._items

    def __setitem__(self, key, value) -> None:
        size = nbytes(value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._items[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes and len(self._items) > 1:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def __getstate__(self) -> dict:
        """A copy sent to another process (a loading process started by spawn or forkserver) starts
        empty: its entries are read again there, and a lock does not cross processes."""
        return {"max_bytes": self.max_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_bytes"])
