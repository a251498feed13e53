"""The writer process's side of process_writer.ProcessWriter: a CacheWriter driven by its messages.

    python -m deepspec.cache.write.process_serve <commands fd> <events fd>

Messages in, in order: ("call", seq, method, args) runs "open" (CacheWriter's keyword arguments and
the levels the computing process set on its loggers) or one of the writer's methods; ("buffer", id,
size) followed by the buffer's descriptor, ("drop_buffer", id); ("part", PartData without states)
opening a streamed part, then ("batch", buffer id, keys, layout) per batch and ("end",) or
("drop",); ("whole", PartData); ("exit",). Out: ("reply", seq, value) or ("raised", seq, exception)
per call; ("free", buffer id) once a batch is copied out; ("committed", part name); ("failed",
message) the first time the writer refuses a part; ("log", a log record's attributes), which the
computing process's loggers handle as their own, so its handlers and levels apply. When the
commands end without "exit" (the computing process died) the writer stops as CacheWriter.abort
does, and the lease is released.
"""
from __future__ import annotations

import logging
import logging.handlers
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from deepspec.cache.write.shared_buffers import SharedBuffer
from deepspec.cache.write.writer import CacheWriter


def portable(e: BaseException) -> BaseException:
    """`e`, or a RuntimeError naming it when it cannot be pickled."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


class ToParent(logging.handlers.QueueHandler):
    """Sends each record, its message formatted here (its arguments need not pickle), to the computing
    process; once that process is gone, to stderr."""

    def __init__(self, served: "Served"):
        super().__init__(None)
        self.served = served

    def enqueue(self, record: logging.LogRecord) -> None:
        if not self.served.emit("log", record.__dict__):
            logging.lastResort.handle(record)


class Served:
    def __init__(self, commands: Connection, events: Connection):
        self.commands, self.events = commands, events
        self.lock = threading.Lock()  # the writer's commit thread emits too
        self.writer: CacheWriter | None = None
        self.feed = None
        self.buffers: dict[int, SharedBuffer] = {}
        self.failed = False
        self.finished = False  # closed or aborted: a CacheWriter is stopped once
        self.released = False

    def emit(self, *message) -> bool:
        with self.lock:
            try:
                self.events.send(message)
                return True
            except OSError:  # the computing process is gone: the commands end next
                return False

    def fail(self, e: BaseException) -> None:
        if not self.failed:
            self.failed = True
            self.emit("failed", str(e))
        self.on_drop()

    def run(self) -> None:
        while True:
            try:
                message = self.commands.recv()
            except (EOFError, OSError):
                return
            if message[0] == "exit":
                return
            getattr(self, "on_" + message[0])(*message[1:])

    def open(self, kwargs: dict, levels: dict[str, int]) -> dict:
        logging.getLogger().addHandler(ToParent(self))
        for name, level in levels.items():
            logging.getLogger(name or None).setLevel(level)
        self.writer = CacheWriter(**kwargs)
        self.writer.on_commit = lambda name: self.emit("committed", name)
        return self.writer.manifest.to_dict()

    def on_call(self, seq: int, method: str, args: tuple) -> None:
        try:
            if method == "open":
                value = self.open(*args)
            elif method == "abort" and self.finished:
                value = None
            else:
                value = getattr(self.writer, method)(*args)
        except BaseException as e:
            self.emit("raised", seq, portable(e))
            return
        self.finished = self.finished or method in ("abort", "close")
        self.released = self.released or method == "release"
        self.emit("reply", seq, value)

    def on_buffer(self, key: int, size: int) -> None:
        self.buffers[key] = SharedBuffer.attach(recv_handle(self.commands), size)

    def on_drop_buffer(self, key: int) -> None:
        self.buffers.pop(key).close()

    def on_part(self, part) -> None:
        if self.failed:
            return
        try:
            self.feed = self.writer.stream(part)
        except BaseException as e:
            self.fail(e)

    def on_batch(self, key: int, keys: list, layout: list) -> None:
        arrays = iter(self.buffers[key].unpack(layout))
        self.emit("free", key)
        if self.feed is None:  # the writer failed: the computing side learns it from "failed"
            return
        batch = {layer: (next(arrays), next(arrays) if scaled else None) for layer, scaled in keys}
        try:
            self.feed.put(batch)
        except BaseException as e:
            self.fail(e)

    def on_end(self) -> None:
        if self.feed is not None:
            feed, self.feed = self.feed, None
            try:
                feed.close()
            except BaseException as e:
                self.fail(e)

    def on_drop(self) -> None:
        if self.feed is not None:
            self.feed.abort()
            self.feed = None

    def on_whole(self, part) -> None:
        if not self.failed:
            try:
                self.writer.submit(part)
            except BaseException as e:
                self.fail(e)

    def stop(self) -> None:
        """The commands ended without a release: stop as CacheWriter.abort does, then release."""
        if self.writer is None or self.released:
            return
        self.on_drop()
        try:
            if not self.finished:
                self.writer.abort()
        finally:
            self.writer.release()


def main(argv: list[str]) -> int:
    # an interrupt at the terminal reaches the whole process group: the computing process decides
    # what is committed (its abort), and this process stops when it is told or its commands end
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    served = Served(Connection(int(argv[0])), Connection(int(argv[1])))
    try:
        served.run()
    finally:
        served.stop()
        for buffer in served.buffers.values():
            buffer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
