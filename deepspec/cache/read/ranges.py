"""Byte ranges of a store's keys: `os.pread`/`preadv` on local files (an LRU of open descriptors),
fsspec range requests otherwise and, on an async filesystem such as s3fs, many requests in flight
on its own event loop (docs/scale.md, "S3 read-ahead").

Retries on S3 are one layer, botocore's own ("standard" mode: throttling, 5xx, dropped connections,
exponential backoff with jitter), configured here to `retries` retries; s3fs's retry loop around it
is set to one attempt. (Before, a loop here around s3fs's five attempts around botocore's five made
up to 100 requests of one range before a read failed.)"""
from __future__ import annotations

import collections
import contextlib
import mmap
import os
import threading

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.storage import door
from deepspec.cache.storage.urls import is_remote, storage_options_for

MAX_OPEN_FILES = 256

# A single preadv takes at most IOV_MAX buffers (1,024 on Linux); a read of more chunks is split.
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


def preadv_all(fd: int, iov: list, offset: int) -> int:
    """preadv over any number of buffers, IOV_MAX at a time; returns the bytes read (short on EOF)."""
    got = 0
    for i in range(0, len(iov), IOV_MAX):
        batch = iov[i:i + IOV_MAX]
        n = os.preadv(fd, batch, offset + got)
        got += n
        if n != sum(b.nbytes for b in batch):
            break
    return got


class ByteRanges:
    """Byte-range access to store keys: pread on local files (an LRU of open fds), fsspec otherwise."""

    def __init__(self, url: str, storage_options: dict | None, cache_dir: str | None = None,
                 retries: int = 3, connections: int = 0, missing_is_damage: bool = True):
        """`missing_is_damage`: a file of the store that is not there is a CacheFormatError naming it (a
        committed store lacks nothing); False for the part mirror, whose arrays come and go."""
        self.url = url.rstrip("/")
        self.missing_is_damage = missing_is_damage
        self.remote = is_remote(url)
        self.retries = retries
        self._fds: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._maps: collections.OrderedDict[str, memoryview] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.cached = self.async_reads = False
        if self.remote:
            import fsspec

            options = storage_options_for(url, storage_options)
            s3 = url.startswith("s3://")
            if s3:
                config = dict(options.get("config_kwargs") or {})
                config.setdefault("retries", {"mode": "standard", "total_max_attempts": retries + 1})
                if connections > 10:  # botocore's connection pool (10 by default) would cap the requests in flight
                    config.setdefault("max_pool_connections", connections)
                options["config_kwargs"] = config
            fs, self.root = fsspec.core.url_to_fs(url, **options)
            if s3:
                fs.retries = 1  # s3fs's own loop: one attempt (botocore retries); an instance of these options only
            if cache_dir:  # fsspec's own block cache: byte ranges are kept on local disk
                fs = fsspec.filesystem("blockcache", fs=fs, cache_storage=cache_dir)
            self.fs = fs
            # the block cache forwards attributes it lacks to the wrapped filesystem, so it looks
            # async (async_impl, _cat_file) and a coroutine read would go around the cache; and its
            # metadata is not thread-safe (concurrent reads raise KeyError in fsspec): one at a time
            self.cached = bool(cache_dir)
            self.async_reads = bool(getattr(fs, "async_impl", False)) and not cache_dir
        else:
            self.root = url.removeprefix("file://")
            self._roots = door.link_roots(self.root)

    def fd(self, key: str) -> int:
        """An open read-only descriptor of local file `key`, kept for the next read (the least
        recently used one is closed past MAX_OPEN_FILES); the caller must not close it."""
        with self._lock:
            fd = self._fds.pop(key, None)
            if fd is None:
                try:
                    fd = door.open_fd(self.root, key, roots=self._roots)
                except FileNotFoundError:
                    if not self.missing_is_damage:
                        raise
                    raise CacheFormatError(f"{self.url}: {key} is missing") from None
                if len(self._fds) >= MAX_OPEN_FILES:
                    os.close(self._fds.popitem(last=False)[1])
            self._fds[key] = fd
            return fd

    def view(self, key: str) -> memoryview:
        """Local file `key` mapped read-only, kept beside its descriptor (a map outlives an evicted
        entry only as long as a view of it is in use). Its length is the file's size when mapped:
        a reader checks a range against it before touching it, so a file shorter than its index
        says raises instead of faulting."""
        with self._lock:
            got = self._maps.get(key)
            if got is not None:
                self._maps.move_to_end(key)
                return got
        fd = self.fd(key)
        size = os.fstat(fd).st_size
        got = memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ)) if size else memoryview(b"")
        with self._lock:
            self._maps[key] = got
            if len(self._maps) > MAX_OPEN_FILES:
                self._maps.popitem(last=False)
        return got

    def size(self, key: str) -> int:
        if self.remote:
            with self._named(key):
                return int(self.fs.size(f"{self.root}/{key}"))
        return os.fstat(self.fd(key)).st_size

    def read(self, key: str, start: int, end: int) -> bytes:
        if self.remote:
            with self._named(key):
                data = self.fs.cat_file(f"{self.root}/{key}", start=start, end=end)
        else:
            # no size check per read (a syscall on the loader's path): every range asked for comes from a
            # checked shard index (shards.check_index), and a short read is refused below
            data = os.pread(self.fd(key), end - start, start)
        if end is not None and start >= 0 and len(data) != end - start:
            raise CacheFormatError(f"{self.url}: {key}: short read ({len(data)} of {end - start} bytes at {start})")
        return data

    @contextlib.contextmanager
    def _named(self, key: str | None):
        """A remote object that is not there, or a range past its end, is damage of the store (a
        CacheFormatError naming it), not an I/O error to retry."""
        try:
            yield
        except FileNotFoundError:
            if not self.missing_is_damage:
                raise
            raise CacheFormatError(f"{self.url}: {key or 'an object'} is missing") from None
        except OSError as e:
            if not door.past_its_end(e):
                raise
            raise CacheFormatError(f"{self.url}: {key or 'an object'}: {e}") from None

    def read_ranges(self, ranges: list[tuple[str, int, int | None]], in_flight: int) -> list[bytes]:
        """Many (key, start, end) ranges, up to `in_flight` requests at a time (each retried by botocore).
        An async filesystem (s3fs, ...) runs them through fsspec's `cat_ranges`, coroutines on its
        own event loop; another remote one on threads (its `cat_ranges` reads one range after
        another); local files and fsspec's block cache one after another."""
        if not self.remote or self.cached or in_flight <= 1 or len(ranges) <= 1:
            return [self.read(*r) for r in ranges]
        with self._named(None if len({k for k, _, _ in ranges}) > 1 else ranges[0][0]):
            return self._read_many(ranges, in_flight)

    def _read_many(self, ranges: list[tuple[str, int, int | None]], in_flight: int) -> list[bytes]:
        if not self.async_reads:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(in_flight, len(ranges))) as pool:
                return list(pool.map(lambda r: self.read(*r), ranges))
        # fsspec's own cat_ranges runs the requests as coroutines, `in_flight` at a time, on the
        # filesystem's loop (measured as fast as a semaphore-gated gather written here:
        # benchmarks/scale_s3.py --cat-ranges)
        return self.fs.cat_ranges([f"{self.root}/{key}" for key, _, _ in ranges], [start for _, start, _ in ranges],
                                  [end for _, _, end in ranges], batch_size=in_flight, on_error="raise")

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._maps.clear()

    def forget(self, prefix: str) -> list:
        """Close the descriptors and drop the maps of the local files whose keys start with `prefix`
        (a directory's files: end it with "/"), before those files are deleted: one kept here would
        hold a deleted file's blocks on disk for as long as this process lives. Returns (weak
        reference, bytes) of each dropped map still alive afterwards: a view of it in use elsewhere
        (a read on another thread, an array over its bytes) keeps it mapped, and its file's blocks
        held, until released. A descriptor is closed as fd()'s own LRU closes one."""
        import weakref

        with self._lock:
            fds = [self._fds.pop(k) for k in [k for k in self._fds if k.startswith(prefix)]]
            views = [self._maps.pop(k) for k in [k for k in self._maps if k.startswith(prefix)]]
        for fd in fds:
            os.close(fd)
        # A map with views exported cannot be closed (mmap.close raises BufferError), and releasing
        # the memoryview kept here would break a read still using it: the references are dropped
        # instead, and CPython unmaps the map when its last one goes (here, where no view is in use)
        maps = [(weakref.ref(v.obj), len(v)) for v in views if isinstance(v.obj, mmap.mmap)]
        del views
        return [(ref, n) for ref, n in maps if ref() is not None]
