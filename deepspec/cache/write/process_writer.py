"""A cache writer in a process of its own: CacheWriter's interface, its work in a child process.

Beside a GPU the forward passes of a narrow target are bound by the Python that launches their
kernels, and every op they launch gives up the GIL for a moment. A writer's threads in the same
process take it then, many times a part, and the capture loop waits for it back each time: the cost
is the hand-overs, not the writer's own GIL time, so making the writer leaner does not remove it
(benchmarks/writeback_gil.py measures the loop with the writer in-process, in a process of its own,
and with this class). Here the computing process keeps two threads that take the GIL a few times
per batch: one copies each batch's states into a shared buffer (shared_buffers.py) once its
device-to-host copy has landed and sends the buffer's place; one takes the child's answers. The
child (process_serve.py) runs an ordinary CacheWriter, so the store, its lease, its commits and
its failures are those of CacheWriter; the lease is the child's (a killed child leaves it to be
taken over as a killed writer's is), and a child whose computing process dies stops as
CacheWriter.abort does.

A part copied from another store (PartData.copy, a derive) is refused: it needs the source store's
objects in this process; the cache stage writes a derive with a CacheWriter.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from pathlib import Path

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.spec.manifest import Manifest
from deepspec.cache.write.lease import DEFAULT_TTL_S
from deepspec.cache.write.part_data import PartData
from deepspec.cache.write.shared_buffers import SharedBuffer, packed_size, round_size

log = logging.getLogger(__name__)

_DONE = object()


def child_env() -> dict:
    """This environment, with the directory this package was imported from first on PYTHONPATH when
    it is a checkout (not an installation's site-packages, which must stay after the standard library)."""
    import site

    env = dict(os.environ)
    root = Path(__file__).resolve().parents[3]
    installed = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root not in installed:
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


class ProcessWriter:
    """CacheWriter's arguments and methods (submit, close, abort, release, committed_parts,
    committed_sample_ids, write_manifest, on_commit, url, manifest, rank). `depth`: batches handed
    over and not yet copied out by the child (each holds a shared buffer of its size)."""

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
        self._replies: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue(maxsize=self._depth)
        self._ended = False
        ours, theirs = socket.socketpair(), socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "deepspec.cache.write.process_serve", str(ours[1].fileno()),
                 str(theirs[1].fileno())], pass_fds=(ours[1].fileno(), theirs[1].fileno()), env=child_env())
        finally:
            ours[1].close()
            theirs[1].close()
        self._commands, self._events = Connection(ours[0].detach()), Connection(theirs[0].detach())
        self._listener = threading.Thread(target=self._listen, name="cache-writer-events", daemon=True)
        self._listener.start()
        self._sender = threading.Thread(target=self._send_loop, name="cache-writer-send", daemon=True)
        self._sender.start()
        kwargs = dict(url=url, manifest=dict(manifest), storage_options=storage_options, queue_size=queue_size,
                      rank=rank, prune_stale=prune_stale, run_id=run_id, lease_ttl=lease_ttl, threads=threads)
        try:
            opened = self._call_message(("open", kwargs, logging.getLogger().getEffectiveLevel()))
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
        batches, part.batches = part.batches, None
        self._put(("part", dataclasses.replace(part, batches=None)))
        try:
            for batch in batches:
                self._put(("batch", batch))
        except BaseException:
            self._put(("drop",), give_up=True)
            raise
        self._put(("end",))

    def close(self, consolidate: bool = True, order: list[str] | None = None) -> None:
        self._call("close", consolidate, order)

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
            pass
        finally:
            self._shut()

    def committed_parts(self) -> dict[str, dict]:
        return self._call("committed_parts")

    def committed_sample_ids(self) -> set[int]:
        return self._call("committed_sample_ids")

    def write_manifest(self, order: list[str] | None = None, rescan: bool = False,
                       prune_unlisted: bool | None = None) -> dict:
        return self._call("write_manifest", order, rescan, prune_unlisted)

    def __enter__(self) -> "ProcessWriter":
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.close()
            else:
                self.abort()
        finally:
            self.release()

    # ---- the computing process's two threads --------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _put(self, item, give_up: bool = False) -> None:
        """Queue `item` for the child. A failed writer takes no more parts: its error is raised here
        (or, with `give_up`, the item dropped); calls still go to a live child (close raises the
        failure there, abort and release do their work), and to a dead one raise its death."""
        while True:
            if self._error is not None and (item[0] not in ("call", "exit") or self._proc.poll() is not None):
                if give_up:
                    return
                raise self._error
            try:
                self._outbox.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _call_message(self, message):
        if self._ended:
            raise CacheFormatError(f"{self.url}: this writer was released")
        self._put(message)
        while True:
            try:
                kind, value = self._replies.get(timeout=0.2)
            except queue.Empty:
                if self._proc.poll() is not None and self._error is not None:
                    raise self._error
                continue
            if kind == "raised":
                raise value
            return value

    def _call(self, method: str, *args):
        return self._call_message(("call", method, args))

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not _DONE:
            if self._error is not None and item[0] not in ("call", "exit"):
                continue  # a failed writer takes no more parts
            try:
                if item[0] == "batch":
                    self._send_batch(item[1])
                else:
                    self._commands.send(item)
            except BaseException as e:  # the child is gone (a broken pipe): say how, keep draining
                self._fail(self._death(e))

    def _send_batch(self, batch) -> None:
        if not isinstance(batch, dict):  # a devices.HostBatch: wait here for its device-to-host copies
            batch = batch.result()
        keys, arrays = [], []
        for layer, (bits, scale) in batch.items():
            keys.append((layer, scale is not None))
            arrays += [bits] if scale is None else [bits, scale]
        key = self._buffer(packed_size(arrays))
        layout = self._buffers[key].pack(arrays)
        self._commands.send(("batch", key, keys, layout))

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
            self._commands.send(("drop_buffer", small))
            self._buffers.pop(small).close()
        buffer = SharedBuffer.create(round_size(nbytes))
        key = max(self._buffers, default=-1) + 1
        self._buffers[key] = buffer
        self._commands.send(("buffer", key, buffer.size))
        send_handle(self._commands, buffer.fd, self._proc.pid)
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
                    try:
                        if self.on_commit is not None:
                            self.on_commit(rest[0])
                    except BaseException as e:  # as on a CacheWriter's commit thread: the writer has failed
                        failed = CacheFormatError(f"{self.url}: writing a part failed: {e}")
                        failed.__cause__ = e
                        self._fail(failed)
                elif kind == "failed":
                    self._fail(CacheFormatError(rest[0]))
                else:
                    self._replies.put((kind, rest[0]))
        except (EOFError, OSError) as e:
            if not self._ended:
                self._fail(self._death(e))
                self._replies.put(("raised", self._error))

    def _death(self, seen: BaseException) -> CacheFormatError:
        """The error of a child that stopped answering (`seen`: what its channel raised)."""
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return CacheFormatError(f"{self.url}: the cache writer process (pid {self._proc.pid}) stopped taking "
                                    f"parts ({type(seen).__name__}: {seen})")
        how = f"signal {-code}" if code < 0 else f"code {code}"
        return CacheFormatError(f"{self.url}: the cache writer process (pid {self._proc.pid}) exited with {how}")

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            self._error = self._error or e
            self._cond.notify_all()

    def _shut(self) -> None:
        """Tell the child to exit, wait for it (kill it after a while), close both channels."""
        self._ended = True
        self._put(("exit",), give_up=True)
        self._outbox.put(_DONE)
        self._sender.join(timeout=30)
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log.warning("cache writer process %d did not exit: killed", self._proc.pid)
            self._proc.kill()
            self._proc.wait()
        self._commands.close()
        self._listener.join(timeout=5)
        self._events.close()
        with self._cond:
            for buffer in self._buffers.values():
                buffer.close()
            self._buffers.clear()
