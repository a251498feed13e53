"""The door every local read of a store goes through: the reader's fast path and zarr-python (through
`DoorStore`), the HDF5 backend (h5py reads a file object opened here), verify, gc, convert, derive
and the part mirror.

A store is input deepspec does not control (a teammate's lake, a pulled cache, an unpacked archive).
Before a byte of a store file is read, the door checks:
- the key is relative and does not climb (`..`);
- its resolved path lies inside the store's resolved root, or inside the DVC cache of the repository
  the store lies in (`dvc checkout` with `cache.type: symlink` turns every file into a link there);
  a link anywhere else is refused, however right its bytes, and so is a link to another file of the
  store (another array's shard has valid checksums too);
- the file opened is that resolved path (opened without following a link in its last component,
  so a link swapped in after the check fails to open) and is a regular file, not a FIFO, a device
  or a directory (opened non-blocking, so a FIFO cannot stall the reader);
- its size equals what the caller declares (the manifest's figure) or, for a document with no
  declared size (a manifest, a commit record, a zarr.json), is at most `DOCUMENT_BYTES`,
  before anything is allocated for it; a range read lies inside the file.
A refusal is a CacheFormatError naming the store, the key and why. A missing file is
FileNotFoundError, as from `open`: an absent key is a state callers handle (a new store, a part not
committed yet).
"""
from __future__ import annotations

import configparser
import errno
import functools
import os
import stat
from pathlib import Path

from deepspec.cache.spec.format import CacheFormatError

# The most bytes a JSON document of a store may have (a root manifest of a 1.3 M-sample lake lists
# a few thousand parts; a commit record lists its samples' lengths and ids: well under this)
DOCUMENT_BYTES = 64 << 20

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


@functools.lru_cache(maxsize=256)
def link_roots(root: str | Path) -> tuple[str, ...]:
    """Where a local store's files may resolve to: the store itself and, for a store inside a DVC
    repository, that repository's cache (`.dvc/cache`, or the `cache.dir` its config names)."""
    real = os.path.realpath(root)
    roots = [real]
    for parent in Path(real).parents:
        dvc = parent / ".dvc"
        if dvc.is_dir():
            roots.append(os.path.realpath(dvc_cache_dir(dvc)))
            break
    return tuple(roots)


def dvc_cache_dir(dvc: Path) -> Path:
    """The cache directory a repository's `.dvc/config` (and `config.local`) names, else `.dvc/cache`;
    a relative `dir` is relative to `.dvc`, as DVC reads it."""
    where = dvc / "cache"
    for name in ("config", "config.local"):
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(dvc / name)
        except configparser.Error:
            continue  # DVC itself would refuse this config; the default cache is all that is allowed then
        got = parser.get("cache", "dir", fallback=None)
        if got:
            where = dvc / got.strip().strip("'\"")
    return where


def inside(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def resolve(root: str | Path, key: str, roots: tuple[str, ...] | None = None) -> str:
    """The resolved local path of store key `key`, refused unless it lies inside the store (or the
    DVC cache of its repository; `roots` narrows that)."""
    root = os.fspath(root)
    if not key or key.startswith("/") or ".." in key.split("/") or "\x00" in key:
        raise CacheFormatError(f"{root}: key {key!r} is not a path inside the store")
    allowed = roots or link_roots(root)
    real = os.path.realpath(os.path.join(root, key))
    if not inside(real, allowed):
        raise CacheFormatError(f"{root}: {key} is a link to {real}, outside the store; a store's files must "
                               "lie inside it (or in the DVC cache of its repository)")
    here = os.path.join(allowed[0], os.path.normpath(key))
    if real != here and inside(real, allowed[:1]):  # another file of the store: its bytes, another place
        raise CacheFormatError(f"{root}: {key} is a link to {os.path.relpath(real, allowed[0])}, another file of "
                               "the store; a store's files are where their keys say (or in the DVC cache)")
    return real


def open_fd(root: str | Path, key: str, size: int | None = None, limit: int | None = None,
            roots: tuple[str, ...] | None = None, field: str = "the manifest") -> int:
    """A read-only descriptor of store file `key`, checked as the module says: `size`, the exact size
    `field` declares; `limit`, the most bytes it may have. The caller closes it."""
    real = resolve(root, key, roots)
    try:
        fd = os.open(real, _FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{root}: {key}: no such file") from None
    except OSError as e:  # ELOOP: a link put in place after resolve; EISDIR, EACCES, ...
        raise CacheFormatError(f"{root}: {key}: cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheFormatError(f"{root}: {key}: not a regular file (mode {stat.filemode(st.st_mode)})")
        if size is not None and st.st_size != size:
            raise CacheFormatError(f"{root}: {key}: {st.st_size} bytes; {field} declares {size}")
        if limit is not None and st.st_size > limit:
            raise CacheFormatError(f"{root}: {key}: {st.st_size} bytes, more than the {limit} such a file may have")
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_size(root: str | Path, key: str, roots: tuple[str, ...] | None = None) -> int:
    """The size of store file `key`, opened through the door (a regular file inside the store)."""
    fd = open_fd(root, key, roots=roots)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def past_its_end(e: OSError) -> bool:
    """Whether a remote read failed because its range lies past the object's end (S3's 416): damage
    of the store, not an I/O error to retry."""
    return e.errno == errno.EINVAL or "InvalidRange" in str(e) or "not satisfiable" in str(e)


def read_file(root: str | Path, key: str, size: int | None = None, limit: int | None = DOCUMENT_BYTES,
              roots: tuple[str, ...] | None = None, field: str = "the manifest") -> bytes:
    """The whole of store file `key` (open_fd's checks; a document is at most `limit` bytes)."""
    fd = open_fd(root, key, size, limit, roots, field)
    try:
        return read_exactly(fd, os.fstat(fd).st_size, 0, root, key)
    finally:
        os.close(fd)


def read_range(root: str | Path, key: str, start: int, end: int, roots: tuple[str, ...] | None = None) -> bytes:
    """Bytes [start, end) of store file `key`, refused unless the file holds them."""
    fd = open_fd(root, key, roots=roots)
    try:
        return pread_checked(fd, start, end, root, key)
    finally:
        os.close(fd)


def pread_checked(fd: int, start: int, end: int, root, key: str) -> bytes:
    """Bytes [start, end) of an open store file, refused (not allocated) unless it holds them."""
    have = os.fstat(fd).st_size
    if not 0 <= start <= end <= have:
        raise CacheFormatError(f"{root}: {key}: bytes {start}..{end} asked of a file of {have} bytes")
    return read_exactly(fd, end - start, start, root, key)


def read_exactly(fd: int, n: int, offset: int, root, key: str) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:  # a regular file returns short reads only at its end (or on a signal)
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise CacheFormatError(f"{root}: {key}: short read ({len(data)} of {n} bytes at {offset})")
        data += more
    return data


def open_file(root: str | Path, key: str, size: int | None = None, roots: tuple[str, ...] | None = None):
    """A binary file object of store file `key` (open_fd's checks), for a library that reads a file
    object (h5py)."""
    return os.fdopen(open_fd(root, key, size, roots=roots), "rb", buffering=0)
