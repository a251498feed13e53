"""Whole arrays of a remote Zarr store's parts, mirrored on local disk (`cache_dir`) so that a loader
reading from S3 makes a few large requests per part instead of a few small ones per sample.

A range read of one sample costs a request per array (eight at the reference layers) plus one more
per 4 MB; the libraries built for object storage (litdata, mosaicml-streaming) download whole
chunks or shards instead and read samples from local disk. The mirror does the same per array of a
part: the first read that needs `parts/<part>/<array>` downloads its `zarr.json` and its shard
object with one GET each (s3fs streams the body to the file), in `in_flight` threads; then every
sample of that array is read locally, through the local fast path (one copy out of the page cache,
every chunk checked against its crc32c as always). A part is downloaded once per mirror directory:
processes sharing one (DataLoader workers, ranks on a node) take a file lock per array, and the one
that downloads renames a finished temporary directory into place, so an array directory that has a
`zarr.json` is complete. Nothing in it is trusted more than the store: a mirrored array is parsed
and checked exactly as one read from the store would be.

A process's first read, unless its arrays are mirrored already, goes to the store directly while
they download, so the first sample comes as soon as a range read gives it; every later read waits
for its arrays' downloads. Each process
keeps the arrays it used under `max_bytes` (least recently used out); a file another process still
has open stays readable after it is deleted.
"""
from __future__ import annotations

import collections
import fcntl
import glob
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from deepspec.cache.read.ranges import ByteRanges
from deepspec.io import fsync_path


class PartMirror:
    """Arrays of `store` (a remote ByteRanges) mirrored under `root`, read through `local`."""

    def __init__(self, store: ByteRanges, root: str, max_bytes: int, in_flight: int):
        if not store.remote:
            raise ValueError("a part mirror copies a remote store; a local one is read in place")
        self.store = store
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.local = ByteRanges(str(self.root), None)
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(max(1, in_flight), thread_name_prefix="mirror")
        self._pending: dict[tuple[str, str], Future] = {}
        self._used: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self._lock = threading.Lock()
        # s3fs asks for an object's size first (a HEAD) and splits one above its block size into
        # concurrent range GETs (after opening and dropping a whole-object GET): one GET per object
        # instead, downloads of other arrays running alongside (`in_flight`)
        self._one_get = {"max_concurrency": 1} if store.url.startswith("s3://") else {}
        self.downloaded = 0  # arrays this process downloaded (the rest it found mirrored)
        self.begun = False  # whether this process has asked for any array yet (its first read goes to the store)
        self._meta: dict[tuple[str, str], bytes | threading.Lock] = {}  # zarr.json per array (small)

    def path(self, part: str, array: str) -> Path:
        return self.root / "parts" / part / array

    def ready(self, part: str, array: str) -> bool:
        return (self.path(part, array) / "zarr.json").is_file()

    def meta(self, part: str, array: str) -> bytes:
        """The array's zarr.json: mirrored, or fetched once (one GET) and kept until its download."""
        key = (part, array)
        try:
            return (self.path(part, array) / "zarr.json").read_bytes()
        except FileNotFoundError:
            pass
        with self._lock:
            got = self._meta.get(key)
            if got is None:
                got = self._meta[key] = threading.Lock()
        if isinstance(got, bytes):
            return got
        with got:  # one fetch per array, whichever thread asks first
            with self._lock:
                if isinstance(self._meta[key], bytes):
                    return self._meta[key]
            meta = self.store.fs.cat_file(f"{self.store.root}/parts/{part}/{array}/zarr.json", **self._one_get)
            with self._lock:
                self._meta[key] = meta
            return meta

    def start(self, arrays: list[tuple[str, str]]) -> list[Future]:
        """Download the arrays not mirrored yet, in the background; one future per array."""
        with self._lock:
            self.begun = True
            futures = []
            for key in arrays:
                f = self._pending.get(key)
                if f is None:
                    f = self._pending[key] = self._pool.submit(self._fetch, *key)
                futures.append(f)
            return futures

    def ensure(self, arrays: list[tuple[str, str]]) -> None:
        """Every array of `arrays` mirrored (downloaded now where it is not), and marked as used;
        raises the first download's error."""
        for f in self.start([a for a in arrays if not self.ready(*a)]):
            f.result()
        for key in arrays:
            self._use(key, keep=set(arrays))

    def _fetch(self, part: str, array: str) -> None:
        try:
            final = self.path(part, array)
            final.parent.mkdir(parents=True, exist_ok=True)
            with open(final.parent / f".{final.name}.lock", "a+") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another process downloading it: wait for it
                if not self.ready(part, array):
                    self._download(part, array, final)
                    with self._lock:
                        self.downloaded += 1
        finally:
            with self._lock:
                self._pending.pop((part, array), None)
                self._meta.pop((part, array), None)  # on disk now (or fetched again by a retry)

    def _download(self, part: str, array: str, final: Path) -> None:
        import json

        from deepspec.cache.backends.zarr.layout import parse_layout

        # under the array's lock: a temporary copy of it is a killed downloader's, an array
        # directory without its zarr.json a torn one
        for stale in final.parent.glob(f".{glob.escape(final.name)}.*.*"):
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        tmp = final.parent / f".{final.name}.{os.getpid()}.{threading.get_ident()}"
        tmp.mkdir(parents=True)
        try:
            where = f"parts/{part}/{array}"
            meta = self.meta(part, array)
            (tmp / "zarr.json").write_bytes(meta)
            layout = parse_layout(where, json.loads(meta))
            if layout is not None:  # else the reader refuses or reads it from the store, as it would unmirrored
                shard = tmp / layout.key[len(where) + 1:]
                shard.parent.mkdir(parents=True)
                self.store.fs.get_file(f"{self.store.root}/{layout.key}", str(shard), **self._one_get)
                fsync_path(shard)
            os.rename(tmp, final)
            fsync_path(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _use(self, key: tuple[str, str], keep: set) -> None:
        """`key` used now; past max_bytes the least recently used arrays not in `keep` (the ones
        the current read needs) are deleted."""
        with self._lock:
            if key in self._used:
                self._used.move_to_end(key)
                return
            self._used[key] = sum(p.stat().st_size for p in self.path(*key).rglob("*") if p.is_file())
            total = sum(self._used.values())
            for old in [k for k in self._used if k not in keep]:
                if total <= self.max_bytes:
                    break
                total -= self._used.pop(old)
                shutil.rmtree(self.path(*old), ignore_errors=True)
