"""A cache writer in a process of its own: CacheWriter's interface, its work in a child process.

Beside a GPU the forward passes of a narrow target are bound by the Python that launches their
kernels, and every op they launch gives up the GIL for a moment. A writer's threads in the same
process take it then, many times a part, and the capture loop waits for it back each time: the cost
is the hand-overs, not the writer's own GIL time, so making the writer leaner does not remove it
(benchmarks/writeback_gil.py measures the loop with the writer in-process, in a process of its own,
and with this class). Here the computing process keeps threads that take the GIL a few times per
batch: one copies each batch's states into a shared buffer (shared_buffers.py) once its
device-to-host copy has landed and sends the buffer's place; one takes the child's answers; one
calls `on_commit`. The child (process_serve.py) runs an ordinary CacheWriter, so the store, its
lease, its commits and its failures are those of CacheWriter; the lease is the child's (a killed
child leaves it to be taken over as a killed writer's is), and a child whose computing process dies
stops as CacheWriter.abort does. A failure on this side (a batch whose copies fail, an `on_commit`
that raises) fails the writer as it fails a CacheWriter: the part open in the child is dropped, no
later part is written, and `close` raises it without consolidating. The child's log records are
handled by this process's loggers (its handlers; the levels it had set when the writer opened).

A part copied from another store (PartData.copy, a derive) is refused: it needs the source store's
objects in this process; the cache stage writes a derive with a CacheWriter.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import subprocess
import threading
import weakref
from multiprocessing.reduction import ForkingPickler, send_handle

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.spec.manifest import Manifest
from deepspec.cache.write.lease import DEFAULT_TTL_S
from deepspec.cache.write.part_data import PartData, PartWriter
from deepspec.cache.write.process_child import how_it_ended, start_child
from deepspec.cache.write.shared_buffers import SharedBuffer, packed_size, round_size

log = logging.getLogger(__name__)

_DONE = object()
_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's open writers, forgotten by a forked child


class _Lost(Exception):
    """The channel to the writer process broke."""


def _failed(url: str, e: BaseException) -> CacheFormatError:
    error = CacheFormatError(f"{url}: writing a part failed: {e}")
    error.__cause__ = e
    return error


class ProcessWriter(PartWriter):
    """CacheWriter's arguments and methods (part_data.PartWriter, plus committed_sample_ids). `depth`:
    batches handed over and not yet copied out by the child (each holds a shared buffer of its size)."""

    def __init__(self, url: str, manifest: dict, storage_options: dict | None = None,
                 queue_size: int = 2, rank: int = 0, prune_stale: bool | None = None, run_id: str | None = None,
                 lease_ttl: float = DEFAULT_TTL_S, threads: int = 1, depth: int = 2):
        self.url, self.rank = url, rank
        self.on_commit = None
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._buffers: dict[int, SharedBuffer] = {}
        self._free: set[int] = set()
        self._depth = max(1, depth)
        self._calls = threading.Lock()
        self._waiting: dict[int, queue.Queue] = {}  # a call's number -> where its answer goes
        self._outbox: queue.Queue = queue.Queue(maxsize=self._depth)
        self._commits: queue.Queue = queue.Queue()
        self._seq = 0
        self._ended = False
        self._proc, self._commands, self._events = start_child()
        _LIVE.add(self)
        self._threads = [threading.Thread(target=target, name=name, daemon=True) for target, name in (
            (self._listen, "cache-writer-events"), (self._send_loop, "cache-writer-send"),
            (self._commit_loop, "cache-writer-commits"))]
        for t in self._threads:
            t.start()
        kwargs = dict(url=url, manifest=dict(manifest), storage_options=storage_options, queue_size=queue_size,
                      rank=rank, prune_stale=prune_stale, run_id=run_id, lease_ttl=lease_ttl, threads=threads)
        try:
            opened = self._call("open", kwargs, _levels())
        except BaseException:
            self._shut()
            raise
        self.manifest = Manifest.from_dict(opened, url)
        self.manifest.parts = []

    @property
    def pid(self) -> int:
        """The writer process's."""
        return self._proc.pid

    # ---- CacheWriter's interface -------------------------------------------------------------------
    def submit(self, part: PartData) -> None:
        """As CacheWriter.submit: a part with `batches` is streamed, its batches drawn here."""
        self._raise_if_failed()
        if part.copy is not None:
            raise ValueError(f"part {part.name}: a part copied from another store is written by a CacheWriter "
                             "in the process that opened the source")
        if part.batches is None:
            self._put(("whole", part))
            return
        if part.hidden:
            raise ValueError("a streamed part takes its hidden states from its batches, not from `hidden`")
        batches, part.batches = part.batches, None
        self._put(("part", dataclasses.replace(part, batches=None)))
        try:
            for batch in batches:
                self._put(("batch", batch))
            self._put(("end",))
        except BaseException:
            self._enqueue(("drop",))  # the child drops the part (sent whatever has failed)
            raise

    def close(self, consolidate: bool = True, order: list[str] | None = None) -> None:
        """As CacheWriter.close: every part handed over is committed and its on_commit has run; raises
        the writer's first failure, else rank 0 consolidates."""
        try:
            self._call("close", False, None)
        except CacheFormatError:
            self._raise_if_failed()  # the first failure, not the child's echo of it (a part dropped)
            raise
        self._commits.join()
        self._raise_if_failed()
        if consolidate and self.rank == 0:
            self.write_manifest(order)

    def abort(self) -> None:
        """As CacheWriter.abort; returns at once when the child is gone."""
        try:
            self._call("abort")
        except CacheFormatError:
            pass

    def release(self) -> None:
        """Give up the lease and end the child (idempotent)."""
        if self._ended:
            return
        try:
            self._call("release")
        except CacheFormatError:
            if self._proc.poll() is None:  # the child's own release failed (the lease was lost)
                raise
        finally:
            self._shut()

    def committed_parts(self) -> dict[str, dict]:
        return self._call("committed_parts")

    def committed_sample_ids(self) -> set[int]:
        return self._call("committed_sample_ids")

    def write_manifest(self, order: list[str] | None = None, rescan: bool = False,
                       prune_unlisted: bool | None = None) -> dict:
        return self._call("write_manifest", None if order is None else list(order), rescan, prune_unlisted)

    # ---- the computing side: the caller's thread ---------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _put(self, item) -> None:
        """Queue a part's message for the child; a failed writer takes no more: its error is raised."""
        while True:
            if self._ended:
                raise CacheFormatError(f"{self.url}: this writer was released")
            self._raise_if_failed()
            try:
                self._outbox.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _enqueue(self, item) -> None:
        """Queue `item` whatever has failed, while the sending thread runs."""
        while not self._ended and self._threads[1].is_alive():
            try:
                self._outbox.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _call(self, method: str, *args):
        """Run `method` on the child's writer, in order after everything queued from this thread; its
        reply or its error. Any thread may call (an on_commit hook does)."""
        if self._ended:
            raise CacheFormatError(f"{self.url}: this writer was released")
        slot: queue.Queue = queue.Queue(maxsize=1)
        with self._calls:
            self._seq += 1
            seq = self._seq
            self._waiting[seq] = slot
        try:
            self._enqueue(("call", seq, method, args))
            while True:
                try:
                    kind, value = slot.get(timeout=0.2)
                except queue.Empty:
                    if self._proc.poll() is None or not slot.empty():
                        continue
                    raise self._error or self._death(EOFError("the writer process exited"))
                if kind == "raised":
                    raise value
                return value
        finally:
            with self._calls:
                self._waiting.pop(seq, None)  # an interrupted call's answer is dropped when it comes

    def _answer(self, seq: int, kind: str, value) -> None:
        with self._calls:
            slot = self._waiting.get(seq)
        if slot is not None and slot.empty():  # the first answer counts (a reply before a death)
            slot.put_nowait((kind, value))

    # ---- the computing side: its three threads -----------------------------------------------------
    def _send(self, message) -> None:
        payload = ForkingPickler.dumps(message)  # a value that cannot be pickled fails here, not the channel
        try:
            self._commands.send_bytes(payload)
        except (OSError, ValueError) as e:
            raise _Lost(e) from e

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not _DONE:
            try:
                self._forward(item)
            except _Lost as e:
                self._fail(self._death(e.__cause__))
                if item[0] == "call":
                    self._answer(item[1], "raised", self._error)
            except BaseException as e:  # on this side: a batch's copies, a value that cannot be pickled
                if item[0] == "call":
                    self._answer(item[1], "raised", e)  # that call fails, the writer goes on
                elif e is not self._error:
                    self._fail(_failed(self.url, e))
                    if item[0] == "batch":
                        self._enqueue_now(("drop",))
            item = None  # a batch's pinned buffers are not kept while idle

    def _enqueue_now(self, item) -> None:
        """From the sending thread: send `item` at once (it cannot wait for its own queue)."""
        try:
            self._send(item)
        except _Lost as e:
            self._fail(self._death(e.__cause__))

    def _forward(self, item) -> None:
        kind = item[0]
        if self._error is not None:  # a failed writer writes nothing more: an open part is dropped
            if kind in ("part", "batch", "whole"):
                return
            if kind == "end":
                item = ("drop",)
        if kind == "batch":
            self._send_batch(item[1])
        else:
            self._send(item)

    def _send_batch(self, batch) -> None:
        if not isinstance(batch, dict):  # a devices.HostBatch: wait here for its device-to-host copies
            batch = batch.result()
        keys, arrays = [], []
        for layer, (bits, scale) in batch.items():
            keys.append((layer, scale is not None))
            arrays += [bits] if scale is None else [bits, scale]
        key = self._buffer(packed_size(arrays))
        try:
            layout = self._buffers[key].pack(arrays)
        except BaseException:
            with self._cond:
                self._free.add(key)
            raise
        self._send(("batch", key, keys, layout))

    def _buffer(self, nbytes: int) -> int:
        """A free shared buffer of at least `nbytes`: one the child handed back, or a new one while
        fewer than depth + 1 exist (a smaller free one is dropped to make room)."""
        small = None
        with self._cond:  # nothing is sent while it is held: the events thread needs it to go on reading
            while True:
                if self._error is not None:
                    raise self._error
                fits = sorted((self._buffers[k].size, k) for k in self._free if self._buffers[k].size >= nbytes)
                if fits:
                    self._free.discard(fits[0][1])
                    return fits[0][1]
                if len(self._buffers) > self._depth and self._free:
                    small = self._free.pop()
                    break
                if len(self._buffers) <= self._depth:
                    break
                self._cond.wait(0.2)
        if small is not None:
            self._send(("drop_buffer", small))
            self._buffers.pop(small).close()
        buffer = SharedBuffer.create(round_size(nbytes))
        key = max(self._buffers, default=-1) + 1
        self._buffers[key] = buffer
        self._send(("buffer", key, buffer.size))
        try:
            send_handle(self._commands, buffer.fd, self._proc.pid)
        except OSError as e:
            raise _Lost(e) from e
        return key

    def _listen(self) -> None:
        try:
            while True:
                kind, *rest = self._events.recv()
                if kind == "free":
                    with self._cond:
                        self._free.add(rest[0])
                        self._cond.notify_all()
                elif kind == "committed":
                    self._commits.put(rest[0])
                elif kind == "failed":
                    self._fail(CacheFormatError(rest[0]))
                elif kind == "log":
                    record = logging.makeLogRecord(rest[0])
                    logger = logging.getLogger(record.name)
                    if logger.isEnabledFor(record.levelno):
                        logger.handle(record)
                else:
                    self._answer(rest[0], kind, rest[1])
        except (EOFError, OSError) as e:
            if not self._ended:
                self._fail(self._death(e))
                with self._calls:
                    waiting = list(self._waiting.items())
                for seq, _ in waiting:
                    self._answer(seq, "raised", self._error)

    def _commit_loop(self) -> None:
        """on_commit on a thread of its own, as a CacheWriter calls it on its commit thread: the
        hook may call the writer (its reply comes through the events thread)."""
        while (name := self._commits.get()) is not None:
            try:
                if self.on_commit is not None:
                    self.on_commit(name)
            except BaseException as e:  # as on a CacheWriter's commit thread: the writer has failed
                self._fail(_failed(self.url, e))
            finally:
                self._commits.task_done()

    def _death(self, seen: BaseException | None) -> CacheFormatError:
        """The error of a child that stopped answering (`seen`: what its channel raised)."""
        return how_it_ended(self._proc, self.url, seen)

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            self._error = self._error or e
            self._cond.notify_all()

    def _shut(self) -> None:
        """Tell the child to exit, wait for it (kill it after a while), close both channels."""
        self._enqueue(("exit",))
        self._ended = True
        self._outbox.put(_DONE)
        self._commits.put(None)
        for t in self._threads[1:]:
            t.join(timeout=30)
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log.warning("cache writer process %d did not exit: killed", self._proc.pid)
            self._proc.kill()
            self._proc.wait()
        self._commands.close()
        self._threads[0].join(timeout=5)
        self._events.close()
        with self._cond:
            for buffer in self._buffers.values():
                buffer.close()
            self._buffers.clear()
        _LIVE.discard(self)

    def _forget(self) -> None:
        """In a process forked from this one: let go of the child's channels and buffers, so that the
        child still sees its computing process end; this copy writes nothing."""
        self._ended = True
        self._error = CacheFormatError(f"{self.url}: a ProcessWriter belongs to the process that opened it")
        for channel in (self._commands, self._events):
            channel.close()
        for buffer in self._buffers.values():
            buffer.close()
        self._buffers.clear()


def _levels() -> dict[str, int]:
    """The levels set on this process's loggers ("" the root's), for the same loggers in the child."""
    loggers = logging.Logger.manager.loggerDict.items()
    return {"": logging.getLogger().level,
            **{name: lg.level for name, lg in loggers if isinstance(lg, logging.Logger) and lg.level}}


def _forget_all() -> None:
    for writer in list(_LIVE):
        writer._forget()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all)
