"""crc32c checks handed from a reading thread to Python helper threads (ShardReader._scatter, _copy).

A task is one tuple on a C `SimpleQueue`; the helpers block in `get()` without the GIL, and the
crc32c package releases the GIL while it checksums. The thread that waits for a batch first runs
every task no helper has taken yet, so the tail of a read is checked on two cores, not one; a batch
raises the first mismatch in submission order, whichever thread ran it; a batch given up (its
reader raised) needs no cleanup.

A run of chunks is checked with one crc32c call over all its bytes against `crc32c_concat` of
their stored CRCs (the GIL is released once per run, not once per 320 KB chunk); a mismatch then
names the first bad chunk.

`copy_checked` copies a run and checksums it in the same pass, in native code (_copycrc.c, built
at install where a C compiler and x86-64 allow; `NATIVE_COPY` says whether it is here): a checked
local read then costs one pass over its bytes instead of a copy and a crc32c, each about as slow as
the other. A copy-and-check task may run on any thread; its destination is its own. (A native
thread that only checked, built before, measured no faster than these helpers and was removed:
docs/scale.md "Checksums".)
"""
from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from crc32c import crc32c as _crc32c

from deepspec.cache.spec.format import CacheFormatError

try:  # the native copy-and-checksum kernel (_copycrc.c; optional at install, x86-64 with SSE4.2)
    from deepspec.cache.read._copycrc import available as _native, copy_crc32c
except ImportError:
    _native, copy_crc32c = False, None
NATIVE_COPY = bool(_native)


@functools.lru_cache(maxsize=32)
def _shift(n: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """crc -> crc32c(B, crc) ^ crc32c(B, 0) for n-byte B: linear in crc and the same for every B of
    that length (CRC-32C is affine in its start register), so four byte tables built from the
    images of the 32 unit vectors hold it."""
    zeros = bytes(n)
    base = _crc32c(zeros, 0)
    cols = [_crc32c(zeros, 1 << i) ^ base for i in range(32)]
    tables = []
    for byte in range(4):
        t = [0] * 256
        for v in range(1, 256):
            low = v & -v
            t[v] = t[v ^ low] ^ cols[8 * byte + low.bit_length() - 1]
        tables.append(t)
    return tuple(tables)


def crc32c_concat(crcs: Sequence[int], size: int) -> int:
    """crc32c of buffers of `size` bytes each laid end to end, from their own crc32cs. A run of
    chunks matches it when each chunk matches its own crc32c; a run that matches while a chunk
    does not needs corruption in two or more chunks that cancels, as likely (2**-32) as one
    corrupt chunk passing its own check."""
    t0, t1, t2, t3 = _shift(size)
    acc = crcs[0]
    for c in crcs[1:]:
        acc = t0[acc & 255] ^ t1[(acc >> 8) & 255] ^ t2[(acc >> 16) & 255] ^ t3[acc >> 24] ^ c
    return acc


def _run(task: tuple) -> None:
    done, i, fn, args = task
    try:
        fn(*args)
    except BaseException as e:  # reported to the waiting thread, in order
        done.put((i, e))
    else:
        done.put((i, None))


class ChecksumError(CacheFormatError):
    pass


def mismatch(name: str, chunk: int) -> ChecksumError:
    return ChecksumError(f"{name}: chunk {chunk} checksum mismatch (corrupt bytes)")


def _chunks(segments: Sequence, chunk_bytes: int):
    """The buffers end to end, cut into chunks of chunk_bytes: per chunk, its pieces."""
    pieces, left = [], chunk_bytes
    for seg in segments:
        seg = memoryview(seg).cast("B")
        while len(seg):
            take = min(left, len(seg))
            pieces.append(seg[:take])
            seg, left = seg[take:], left - take
            if not left:
                yield pieces
                pieces, left = [], chunk_bytes


def first_bad(stored, chunk_bytes: int, segments: Sequence) -> int:
    """The first chunk of `segments` (end to end, chunks of chunk_bytes) whose crc32c differs from
    its entry in `stored` (little-endian uint32s), or -1. One crc32c over the whole run against
    crc32c_concat of the stored values (the GIL is released once, not once per chunk); only a
    mismatch checks chunk by chunk."""
    want = np.frombuffer(stored, "<u4").tolist()
    crc = 0
    for seg in segments:
        crc = _crc32c(seg, crc)
    if crc == crc32c_concat(want, chunk_bytes):
        return -1
    for j, pieces in enumerate(_chunks(segments, chunk_bytes)):
        crc = 0
        for piece in pieces:
            crc = _crc32c(piece, crc)
        if crc != want[j]:
            return j
    raise AssertionError("a run's crc32c differs while each chunk's matches")  # crc32c_concat is exact


def _check(stored, chunk_bytes: int, segments: Sequence, name: str, first: int) -> None:
    bad = first_bad(stored, chunk_bytes, segments)
    if bad >= 0:
        raise mismatch(name, first + bad)


def copy_checked(rows: np.ndarray, src: np.ndarray, lo: int, hi: int, stored, chunk_bytes: int, name: str,
                 first: int) -> None:
    """Bytes [lo, hi) of `src` (a run of whole chunks, chunk_bytes each, from its start to its end)
    copied into `rows` (uint8 [rows, row bytes], each row contiguous) by the native kernel
    (_copycrc.copy_crc32c), which checksums what it copies in the same pass; the chunk bytes outside
    [lo, hi) are checksummed where they lie. Raises a ChecksumError naming the first chunk that
    does not match its entry in `stored`."""
    want = np.frombuffer(stored, "<u4").tolist()
    crc = _crc32c(src[:lo])
    crc = copy_crc32c(rows, src[lo:hi], crc)
    if _crc32c(src[hi:], crc) != crc32c_concat(want, chunk_bytes):
        raise mismatch(name, first + max(0, first_bad(stored, chunk_bytes, [src])))


def _serve(tasks: queue.SimpleQueue) -> None:
    while (task := tasks.get()) is not None:
        _run(task)


def _stop(tasks: queue.SimpleQueue, threads: int) -> None:
    for _ in range(threads):
        tasks.put(None)


class Batch:
    """Tasks whose results one thread waits for together (a read, or a deferred block of reads)."""

    def __init__(self, tasks: queue.SimpleQueue):
        self._tasks = tasks
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._n = 0

    def submit(self, fn, *args) -> None:
        self._tasks.put((self._done, self._n, fn, args))
        self._n += 1

    def copy(self, *args) -> None:
        """copy_checked(*args) on whichever thread takes it first (the waiting thread included)."""
        self.submit(copy_checked, *args)

    def check(self, stored, chunk_bytes: int, segments: Sequence, name: str, first: int) -> None:
        """Chunks `first`, first + 1, ... of array `name` are `segments` end to end, chunk_bytes
        each, and must match their crc32cs in `stored` (little-endian uint32s); wait() raises a
        ChecksumError naming the first that does not."""
        self.submit(_check, stored, chunk_bytes, segments, name, first)

    def wait(self) -> None:
        """Run what no helper has started (of any batch: a task only ever reports to its own), then
        wait for the rest; raise the failure of the earliest task that failed."""
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is None:  # a stop meant for a helper
                self._tasks.put(None)
                break
            _run(task)
        failed = {}
        for _ in range(self._n):
            i, error = self._done.get()
            if error is not None:
                failed[i] = error
        self._n = 0
        if failed:
            raise failed[min(failed)]


class Checker:
    """`threads` daemon helper threads; they end when the checker is garbage-collected."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"a checker needs at least one thread (got {threads})")
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(threads):
            threading.Thread(target=_serve, args=(self._tasks,), name="crc32c", daemon=True).start()
        weakref.finalize(self, _stop, self._tasks, threads)

    def batch(self) -> Batch:
        return Batch(self._tasks)


def checker(threads: int) -> Checker:
    """Helpers for `threads` checking threads."""
    return Checker(threads)
