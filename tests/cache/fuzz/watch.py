"""What watches a mode while it runs: the recorder of what it opens (an audit hook on `open`,
`os.listdir` and `os.scandir`, a wrapper of h5py's file opener, a wrapper of s3fs's requests; all
inert unless `RECORDER.active`), the places a mode may open beside its store and the judges of what
lies outside them (`outside`, `s3_outside`), the timeout (`time_limit`: `CaseTimeout` in the main
thread, a faulthandler backstop) and the cancelling of I/O a mode cut short left running, and
tracemalloc for the memory peak."""
from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import sysconfig
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[3]
BACKSTOP_S = 60.0            # past a mode's timeout: the process is stuck where no handler runs


class CaseTimeout(BaseException):
    """A mode ran past its timeout (BaseException: a library's `except Exception` must not swallow it)."""


class Recorder:
    """What the running mode opened (local paths, resolved) and asked S3 for; see the package's docstring."""

    def __init__(self):
        self.active = False
        self.opened: list[tuple[str, str]] = []     # (event, resolved path)
        self.s3: list[tuple[str, str]] = []         # (method, bucket/key)
        self._busy = threading.local()

    def record_path(self, event: str, path: Any) -> None:
        if isinstance(path, int) or path is None:
            return  # a descriptor: its open was recorded
        if getattr(self._busy, "on", False):
            return
        self._busy.on = True
        try:
            text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
            self.opened.append((event, os.path.realpath(text)))
        except Exception:  # noqa: BLE001 - a hook must never raise into the library
            self.opened.append((event, repr(path)))
        finally:
            self._busy.on = False


RECORDER = Recorder()
_HOOKED = False
_PATCHED: list[tuple[Any, str, Any]] = []   # (owner, attribute, original) of what install_recorders wrapped
AUDITED = {"open", "os.listdir", "os.scandir"}


def _audit(event: str, args: tuple) -> None:
    if RECORDER.active and event in AUDITED:
        RECORDER.record_path(event, args[0] if args else None)


def install_recorders() -> None:
    """The audit hook (once per process: it cannot be removed), h5py's opener and s3fs's request
    wrapper (put back by uninstall_recorders); all inert unless RECORDER.active."""
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    if _PATCHED:
        return
    import h5py
    import h5py._hl.files as h5files

    make_fid = h5files.make_fid

    def recording_make_fid(name, mode, userblock_size, fapl, *args, **kwargs):
        # a file object handed to h5py (its name is then the object's repr) was opened by Python: recorded
        if RECORDER.active and fapl.get_driver() != h5py.h5fd.fileobj_driver:
            RECORDER.record_path("h5py.File", name)
        return make_fid(name, mode, userblock_size, fapl, *args, **kwargs)

    _PATCHED.append((h5files, "make_fid", make_fid))
    h5files.make_fid = recording_make_fid
    try:
        import s3fs
    except ImportError:  # pragma: no cover
        return
    call = s3fs.S3FileSystem._call_s3

    async def recording_call(self, method, *args, **kwargs):
        if RECORDER.active:
            bucket = kwargs.get("Bucket", "")
            named = [f for f in ("Key", "Prefix") if f in kwargs]
            RECORDER.s3.extend((f"{method} {f}", f"{bucket}/{kwargs[f]}") for f in named)
            if "CopySource" in kwargs:
                RECORDER.s3.append((f"{method} CopySource", str(kwargs["CopySource"])))
            elif not named:
                RECORDER.s3.append((method, f"{bucket}/"))
        return await call(self, method, *args, **kwargs)

    _PATCHED.append((s3fs.S3FileSystem, "_call_s3", call))
    s3fs.S3FileSystem._call_s3 = recording_call


def uninstall_recorders() -> None:
    while _PATCHED:
        owner, name, original = _PATCHED.pop()
        setattr(owner, name, original)


def library_roots() -> tuple[str, ...]:
    """Where a mode may open files outside its store: Python's and the venv's libraries and this
    checkout's package (lazy imports, botocore's data files)."""
    roots = {str(REPO / "deepspec")}
    for scheme_vars in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=scheme_vars or None)
        roots.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    return tuple(sorted({os.path.realpath(r) for r in roots}))


# files every process may read: entropy, its own /proc entries (thread and memory introspection)
ALLOWED_FILES = ("/dev/urandom", "/dev/random")
ALLOWED_PREFIXES = ("/proc/self/", f"/proc/{os.getpid()}/")


def outside(opened: list[tuple[str, str]], store: str | None, roots: tuple[str, ...]) -> list[str]:
    """The recorded paths that lie neither in `store` (None: a remote store) nor in an allowed place."""
    allowed = tuple(r.rstrip("/") + "/" for r in roots)
    store_real = os.path.realpath(store) if store else None
    bad = []
    for event, path in opened:
        if store_real and (path == store_real or path.startswith(store_real + "/")):
            continue
        if path.startswith(allowed) or path in ALLOWED_FILES or path.startswith(ALLOWED_PREFIXES):
            continue
        bad.append(f"{event} {path}")
    return sorted(set(bad))


def s3_outside(requests: list[tuple[str, str]], store: str) -> list[str]:
    """The requests for keys outside the store's prefix; a key's `..` segments count as climbing
    (S3 keeps them literally, but a proxy or another server may not)."""
    import posixpath

    prefix = store.removeprefix("s3://").rstrip("/")
    out = set()
    for method, key in requests:
        norm = posixpath.normpath(key) + ("/" if key.endswith("/") else "")
        if not (norm == prefix or norm.startswith(prefix + "/")):
            out.add(f"{method} {key}")
    return sorted(out)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """CaseTimeout in the main thread after `seconds`; an outer ITIMER_REAL (pytest-timeout's) is
    put back with what it had left; the backstop kills the process if no handler can run."""
    def expire(signum, frame):
        raise CaseTimeout(f"no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 0.001))


def cancel_background() -> None:
    """Cancel every task of the event loops the libraries run I/O on (fsspec's, s3fs instances',
    zarr-python's): the main thread left a mode cut short, but a task it waited on (a few billion
    range requests) would go on allocating and requesting in the background, for every later case."""
    import asyncio

    loops = set()
    with contextlib.suppress(Exception):
        import fsspec.asyn

        loops.add(fsspec.asyn.loop[0])
    with contextlib.suppress(Exception):
        import s3fs

        loops.update(fs.loop for fs in s3fs.S3FileSystem._cache.values())
    with contextlib.suppress(Exception):
        import zarr.core.sync

        loops.add(zarr.core.sync.loop[0])
    for loop in loops:
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(lambda loop=loop: [t.cancel() for t in asyncio.all_tasks(loop)])
    time.sleep(0.1)


def start_tracing() -> bool:
    """tracemalloc on (one frame: the cheapest); True when this call started it."""
    if tracemalloc.is_tracing():
        return False
    tracemalloc.start(1)
    return True
