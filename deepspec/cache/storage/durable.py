"""Durable writes on a local filesystem: a part's files fsynced together before its commit, and the
crash-atomic replacement of a key that exists (the root manifest, a part's commit mark)."""
from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

from zarr.storage import LocalStore

from deepspec.io import atomic_open, fsync_path


_FSYNC_POOL = None


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then every directory, deepest first, then `path` itself.
    Done once per part after all its files are written, and concurrently: fsyncs in flight together
    share the filesystem's journal commits instead of paying one each."""
    global _FSYNC_POOL
    from concurrent.futures import ThreadPoolExecutor

    if _FSYNC_POOL is None:
        _FSYNC_POOL = ThreadPoolExecutor(8, thread_name_prefix="fsync")
    files, dirs = [], []
    for dirpath, _, names in os.walk(path, topdown=False):
        files += [os.path.join(dirpath, n) for n in names]
        dirs.append(dirpath)
    list(_FSYNC_POOL.map(fsync_path, files))
    for d in dirs:
        fsync_path(d)


def durable_replace(path: Path, data) -> None:
    """io.atomic_open with zarr's own temp-file naming (`<name>.<32 hex>.partial`), which a writer
    opening the store recognises as debris."""
    with atomic_open(path, "wb", temp=path.with_suffix(f".{uuid.uuid4().hex}.partial")) as f:
        f.write(data)


class DurableLocalStore(LocalStore):
    """A LocalStore whose *replacements* of an existing key (the root manifest, a part's commit
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
