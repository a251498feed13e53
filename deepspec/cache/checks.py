"""Checksum tasks handed from a reading thread to helper threads for the price of a queue put.

A ThreadPoolExecutor task costs ~80 us of the submitting and the waiting thread here (a Future and
its condition, the idle-thread semaphore, two GIL hand-overs); at ~20 tasks per 30 MB sample that
ate half of what checking on the second core saved (benchmarks/loader.py --checks: 0.72-0.80x of
checks off, vs 0.90x for this on the same machine). A task here is one tuple on a C `SimpleQueue`.
The helpers block in `get()` without the GIL; the thread that waits for a batch first runs every
task no helper has taken yet, so the tail of a read is checked on two cores, not one.

A batch raises the first failure in submission order, whichever thread ran it. A batch given up
(its reader raised) needs no cleanup: its remaining tasks still run, and their results are dropped.

`crc32c_concat` lets a run of chunks be checked with one crc32c call over all their bytes: the
GIL is released once per run, not once per 320 KB chunk, and each release is a chance for the
reading thread to wait for it.
"""
from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections.abc import Sequence

from crc32c import crc32c as _crc32c


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
