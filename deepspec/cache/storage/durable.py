"""Durable writes on a local filesystem: a part's files fsynced together before its commit, and the
crash-atomic replacement of a key that exists (the root manifest, a part's commit mark)."""
from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path


from deepspec.cache.storage.door_store import DoorStore
from deepspec.cache.storage.pools import thread_pool
from deepspec.io import atomic_open, fsync_path


FSYNC_THREADS = 8


def fsync_pool():
    """The threads every local fsync of the writer runs on (fsync_tree, flush-ahead of shards)."""
    return thread_pool("fsync", FSYNC_THREADS)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under `path`, and `path` itself, all at once on the fsync
    pool: fsyncs in flight together share the filesystem's journal commits instead of paying one
    each, and nothing reads the part before its commit, which waits for all of them, so their
    order does not matter. One task per pool thread, each taking every FSYNC_THREADS-th path:
    as many in flight as one task a path, without a future and a thread hand-off for each of a
    part's ~50 files and directories."""
    paths = []
    for dirpath, _, names in os.walk(path, topdown=False):
        paths += [os.path.join(dirpath, n) for n in names]
        paths.append(dirpath)
    list(fsync_pool().map(_fsync_all, [paths[k::FSYNC_THREADS] for k in range(min(FSYNC_THREADS, len(paths)))]))


def _fsync_all(paths: list[str]) -> None:
    for path in paths:
        fsync_path(path)


class FlushAhead:
    """Writeback of files being written, started while they grow: once `every` more bytes of a file
    are written, an fdatasync of it runs on the fsync pool (one at a time per file), so the disk
    writes a part's shards while the writer is still encoding them and the fsync before the commit
    finds little left to do. `done(f)` waits for a file's flush before it is closed (a descriptor
    closed under a pending fdatasync could be reused by another file)."""

    # 4-16 MB measured alike; without it a wide part's fsync took as long as writing it
    # (benchmarks/cache_write.py --parts)
    EVERY = 8 << 20

    def __init__(self, every: int | None = None):
        self.every = every or self.EVERY
        self._flushed: dict[int, int] = {}   # id(file) -> bytes written when its last flush began
        self._pending: dict[int, object] = {}

    def wrote(self, f, written: int) -> None:
        key = id(f)
        if written - self._flushed.get(key, 0) < self.every:
            return
        pending = self._pending.get(key)
        if pending is not None and not pending.done():
            return  # the next flush covers these bytes too
        f.flush()  # Python's buffer, in the writing thread; the kernel's on the pool
        self._flushed[key] = written
        self._pending[key] = fsync_pool().submit(os.fdatasync, f.fileno())

    def done(self, f) -> None:
        key = id(f)
        self._flushed.pop(key, None)
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending.result()


def durable_replace(path: Path, data) -> None:
    """io.atomic_open with zarr's own temp-file naming (`<name>.<32 hex>.partial`), which a writer
    opening the store recognises as debris."""
    with atomic_open(path, "wb", temp=path.with_suffix(f".{uuid.uuid4().hex}.partial")) as f:
        f.write(data)


class DurableLocalStore(DoorStore):
    """A local store (read through the door) whose *replacements* of an existing key (the root manifest, a part's commit
    mark) are crash-atomic and durable: temp file, fsync, rename, fsync of the directory, so a power
    loss leaves the old or the new bytes, never an empty file. New files are written as zarr-python
    writes them and made durable in one batch before their part is committed (CacheWriter.write_part)."""

    async def _set(self, key: str, value, exclusive: bool = False) -> None:
        path = self.root / key
        if exclusive or not path.exists():
            return await super()._set(key, value, exclusive=exclusive)
        if not self._is_open:
            await self._open()
        self._check_writable()
        await asyncio.to_thread(durable_replace, path, value.as_buffer_like())
