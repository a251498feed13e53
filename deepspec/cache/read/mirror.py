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
that downloads renames a finished temporary directory into place, beside a record of its files'
sizes (`mirrored.json`). An array is mirrored when every file that record lists is there at its
size and its `zarr.json` names that shard (`ready`); anything else (a killed process's leftovers, a
file cut short on disk) is downloaded again. Nothing in it is trusted more than the store: a
mirrored array is parsed and checked exactly as one read from the store would be.

A download is bounded by what the array's `zarr.json` declares (`shard_bound`: its rows at full
size, per chunk a Blosc header and a checksum, and the index); an object declared larger is refused
before a byte of it is written, and the byte counter stops a body that runs past the size its
response declared. A `zarr.json` is fetched with a range of at most `META_BYTES`.

A process's first read, unless its arrays are mirrored already, goes to the store directly while
they download, so the first sample comes as soon as a range read gives it; every later read waits
for its arrays' downloads. Each process keeps the bytes it holds under `max_bytes` (least recently
used arrays out; `PartMirror.held` says what counts). Evicting an array drops this process's
descriptors and maps of its files first (else the deleted files' blocks stay allocated for as long
as the process lives), then, under the array's file lock, renames its directory aside
(`.<array>.evicted.<pid>.<thread>`) and deletes that: a process killed mid-way leaves debris that
the array's next download removes, never an array directory missing files. A file another process
still has open stays readable after it is deleted (that process counts it under its own bound).
"""
from __future__ import annotations

import collections
import fcntl
import glob
import json
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from fsspec.callbacks import Callback

from deepspec.cache.backends.base import ArrayLayout
from deepspec.cache.read.ranges import ByteRanges
from deepspec.cache.storage import door
from deepspec.cache.spec.format import CacheFormatError
from deepspec.io import fsync_path

# The most bytes an array's zarr.json may have (the writer's are one or two KB)
META_BYTES = 1 << 20
# Per chunk beyond its rows: a Blosc frame's header (16 bytes; Blosc stores a block it cannot shrink
# as is, behind the header) and the crc32c trailer (4), rounded up
CHUNK_SLACK = 64
# In an array's mirrored directory: {"files": {name: bytes}} of every file downloaded, written
# before the directory is renamed into place
RECORD = "mirrored.json"
# What parsing a hostile or torn JSON document can raise
_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError)


def shard_bound(layout: ArrayLayout, where: str = "") -> tuple[int, str]:
    """The most bytes the shard of `layout` may have, and why: every chunk that holds rows at full
    size (Zarr pads an edge chunk to full size and writes none past the array's rows) plus
    CHUNK_SLACK, then the index (and v4's crc32c table). A chunking that does not cover the rows as
    the reader requires is refused: its index would size the bound."""
    c, rows = layout.chunk_rows, layout.shape[0] if layout.shape else 0
    if not (isinstance(c, int) and c >= 1 and (layout.n_chunks - 1) * c < max(rows, 1) <= layout.n_chunks * c):
        raise CacheFormatError(f"{where}{layout.key}: chunking ({layout.n_chunks} chunks of {c} rows) does not cover "
                               f"its {rows} rows")
    chunks = -(-rows // c)
    bound = chunks * (c * layout.row_bytes + CHUNK_SLACK) + layout.suffix_bytes
    return bound, (f"{chunks} chunks of {c} rows of {layout.row_bytes} bytes, {CHUNK_SLACK} bytes of header and "
                   f"checksum each, and a {layout.suffix_bytes}-byte index")


class _Counted(Callback):
    """fsspec's progress callback of one download, used as its byte counter: a body whose response
    declares more than `bound` bytes is refused before a byte of it is written (s3fs reports the
    GET's Content-Length first), and one that runs past the size declared (past `bound` where none
    is) fails at the first read that crosses it: at most one read (s3fs: 64 KiB) is written beyond,
    into a temporary directory that is then removed. The size comes from the GET itself, not an
    earlier HEAD: one request fewer per array, and the size of the very body being read."""

    def __init__(self, what: str, bound: int, why: str):
        super().__init__()
        self.what, self.bound, self.why = what, bound, why
        self.limit, self.got = bound, 0
        self.declared: int | None = None

    def set_size(self, size) -> None:
        if size is None:
            return
        if int(size) > self.bound:
            raise CacheFormatError(f"{self.what}: the object is {int(size)} bytes, more than the {self.bound} its "
                                   f"zarr.json allows ({self.why})")
        self.declared = self.limit = int(size)

    def relative_update(self, inc=1) -> None:
        self.got += inc
        if self.got > self.limit:
            raise CacheFormatError(f"{self.what}: the body runs past {self.limit} bytes (the "
                                   f"{'size its response declared' if self.declared is not None else 'bound'})")

    def absolute_update(self, value) -> None:
        self.relative_update(value - self.got)


class PartMirror:
    """Arrays of `store` (a remote ByteRanges) mirrored under `root`, read through `local`."""

    def __init__(self, store: ByteRanges, root: str, max_bytes: int, in_flight: int):
        if not store.remote:
            raise ValueError("a part mirror copies a remote store; a local one is read in place")
        self.store = store
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.local = ByteRanges(str(self.root), None, missing_is_damage=False)  # evicted arrays come back
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(max(1, in_flight), thread_name_prefix="mirror")
        self._pending: dict[tuple[str, str], Future] = {}
        # the arrays this process holds, least recently used first, and their files' bytes
        self._used: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self._held = 0  # bytes of _used, and of arrays being evicted until their directory is deleted
        self._lingering: list = []  # (weak reference, bytes) of evicted arrays' maps still in use
        # per array found whole: (a file whose size tells a later check it is still there, that size,
        # bytes of all its files); a later ready() is one stat
        self._checked: dict[tuple[str, str], tuple[Path, int, int]] = {}
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

    def held(self) -> int:
        """Bytes this process holds on local disk, the quantity kept under max_bytes: every file of
        each array it has used or downloaded and not evicted (zarr.json, shard, mirrored.json, sizes
        as found whole), arrays being evicted until their directory is deleted, and the maps of
        evicted arrays still in use somewhere in the process, until released. Not counted: the arrays
        a read is downloading until they are done, debris of a killed process until the array's next
        download removes it, lock files (empty), and arrays another process holds (counted under its
        own bound)."""
        with self._lock:
            self._lingering = [(ref, n) for ref, n in self._lingering if ref() is not None]
            return self._held + sum(n for _, n in self._lingering)

    def ready(self, part: str, array: str) -> bool:
        """Whether the array is mirrored whole: its record's files all there at their sizes, its
        zarr.json parsing into the layout whose shard the record lists, the shard holding at least
        its index. After the first check in a process, one stat of the shard."""
        key = (part, array)
        seen = self._checked.get(key)
        if seen is not None:
            try:
                if os.stat(seen[0]).st_size == seen[1]:
                    return True
            except OSError:
                pass
            self._checked.pop(key, None)
        return self._check(part, array) is not None

    def _read(self, path: Path, limit: int) -> bytes:
        """A mirrored file through the door (storage/door.py: inside the mirror, a regular file, at
        most `limit` bytes); a refusal is a CacheFormatError, a ValueError, as for a torn array."""
        return door.read_file(str(self.root), path.relative_to(self.root).as_posix(), limit=limit)

    def _check(self, part: str, array: str) -> int | None:
        """ready()'s full check: the bytes of the array's files, or None where one is missing or torn."""
        from deepspec.cache.backends.zarr.layout import parse_layout

        final, where = self.path(part, array), f"parts/{part}/{array}"
        try:
            record = self._read(final / RECORD, META_BYTES)
            files = json.loads(record)["files"]
            meta = self._read(final / "zarr.json", META_BYTES)
            layout = parse_layout(where, json.loads(meta))
            shard = layout and layout.key[len(where) + 1:]
            if set(files) != {"zarr.json", *([shard] if shard else [])} or files["zarr.json"] != len(meta):
                return None
            probe, size = final / "zarr.json", len(meta)
            if shard:
                probe, size = final / shard, os.stat(final / shard).st_size
                if size != files[shard] or size < layout.suffix_bytes:
                    return None
            total = sum(int(n) for n in files.values()) + len(record)
        except (OSError, *_PARSE_ERRORS):
            return None
        self._checked[(part, array)] = (probe, size, total)
        return total

    def meta(self, part: str, array: str) -> bytes:
        """The array's zarr.json: mirrored, or fetched once (one GET of at most META_BYTES) and kept
        until its download."""
        key = (part, array)
        if self.ready(part, array):
            try:
                return self._read(self.path(part, array) / "zarr.json", META_BYTES)
            except (OSError, ValueError):
                pass  # evicted since: fetched below
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
            where = f"parts/{part}/{array}/zarr.json"
            meta = self.store.fs.cat_file(f"{self.store.root}/{where}", start=0, end=META_BYTES + 1, **self._one_get)
            if len(meta) > META_BYTES:
                raise CacheFormatError(f"{self.store.url}: {where}: more than {META_BYTES} bytes")
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
        raises the first download's error. Past max_bytes, arrays are evicted (`_use`)."""
        for f in self.start([a for a in arrays if not self.ready(*a)]):
            f.result()
        self._use(arrays)

    def _fetch(self, part: str, array: str) -> None:
        key = (part, array)
        try:
            final = self.path(part, array)
            final.parent.mkdir(parents=True, exist_ok=True)
            with open(final.parent / f".{final.name}.lock", "a+") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another process downloading it: wait for it
                size = self._check(part, array)
                if size is None:
                    self._download(part, array, final)
                    # descriptors or maps of a copy deleted since (by another process) would hold it
                    self.local.forget(f"parts/{part}/{array}/")
                    size = self._check(part, array) or 0
                    with self._lock:
                        self.downloaded += 1
            self._keep(key, size)  # counted now: a first read's downloads are used by no ensure yet
        finally:
            with self._lock:
                self._pending.pop(key, None)
                self._meta.pop(key, None)  # on disk now (or fetched again by a retry)

    def _download(self, part: str, array: str, final: Path) -> None:
        from deepspec.cache.backends.zarr.layout import parse_layout

        # under the array's lock: a temporary copy of it is a killed downloader's, a directory set
        # aside a killed evicter's, an array directory that is not ready() a torn one
        for stale in final.parent.glob(f".{glob.escape(final.name)}.*.*"):
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        tmp = final.parent / f".{final.name}.{os.getpid()}.{threading.get_ident()}"
        tmp.mkdir(parents=True)
        try:
            where = f"parts/{part}/{array}"
            meta = self.meta(part, array)
            (tmp / "zarr.json").write_bytes(meta)
            files = {"zarr.json": len(meta)}
            layout = parse_layout(where, json.loads(meta))
            if layout is not None:  # else the reader refuses or reads it from the store, as it would unmirrored
                name = layout.key[len(where) + 1:]
                shard = tmp / name
                shard.parent.mkdir(parents=True)
                files[name] = self._get(layout, shard)
                fsync_path(shard)
            (tmp / RECORD).write_bytes(json.dumps({"files": files}).encode())
            os.rename(tmp, final)
            fsync_path(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _get(self, layout: ArrayLayout, dest: Path) -> int:
        """The shard of `layout` downloaded to `dest` (one GET, streamed, counted), its bytes."""
        bound, why = shard_bound(layout, f"{self.store.url}: ")
        what = f"{self.store.url}: {layout.key}"
        counted = _Counted(what, bound, why)
        self.store.fs.get_file(f"{self.store.root}/{layout.key}", str(dest), callback=counted, **self._one_get)
        size = os.stat(dest).st_size
        if size > bound or (counted.declared is not None and size != counted.declared):
            raise CacheFormatError(f"{what}: downloaded {size} bytes of the {counted.declared or bound} declared")
        if size < layout.suffix_bytes:
            raise CacheFormatError(f"{what}: {size} bytes cannot hold the index of its {layout.n_chunks} chunks")
        return size

    def _keep(self, key: tuple[str, str], size: int) -> None:
        """`key` held, `size` bytes, as the most recently used."""
        with self._lock:
            self._held += size - self._used.pop(key, 0)
            self._used[key] = size

    def _use(self, arrays: list[tuple[str, str]]) -> None:
        """`arrays` used now; past max_bytes the least recently used arrays not among them (the ones
        the current read needs) are evicted. After it, held() <= max(max_bytes, the bytes of
        `arrays`) unless a map of an evicted array is still in use."""
        with self._lock:
            for key in arrays:
                if key in self._used:
                    self._used.move_to_end(key)
                    continue
                seen = self._checked.get(key)  # ready() just checked it, or _fetch kept it
                size = seen[2] if seen is not None else self._check(*key) or 0
                self._held += size
                self._used[key] = size
            self._lingering = [(ref, n) for ref, n in self._lingering if ref() is not None]
            over = self._held + sum(n for _, n in self._lingering) - self.max_bytes
            keep, victims = set(arrays), []
            for key in list(self._used) if over > 0 else []:
                if over <= 0:
                    break
                if key not in keep:
                    size = self._used.pop(key)
                    self._checked.pop(key, None)
                    victims.append((key, size))
                    over -= size
        for key, size in victims:
            self._evict(key, size)

    def _evict(self, key: tuple[str, str], size: int) -> None:
        """The array's files off local disk, its bytes off held() (save maps of it still in use)."""
        part, array = key
        final = self.path(part, array)
        lingering = []
        try:
            lingering = self.local.forget(f"parts/{part}/{array}/")
            aside = final.parent / f".{final.name}.evicted.{os.getpid()}.{threading.get_ident()}"
            with open(final.parent / f".{final.name}.lock", "a+") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # another process is fetching it: the copy there is its own, under its bound
                shutil.rmtree(aside, ignore_errors=True)  # a killed thread's of the same name
                try:
                    os.rename(final, aside)  # atomic: the array is whole or gone, never torn
                except FileNotFoundError:
                    return  # evicted already, by another process
            shutil.rmtree(aside, ignore_errors=True)
        except FileNotFoundError:
            pass  # its part's directory is gone
        finally:
            with self._lock:
                self._held -= size
                self._lingering += lingering
