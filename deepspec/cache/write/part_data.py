"""What a cache writer is handed: one part's samples (`PartData`), with its hidden states either
whole or streamed batch by batch through a `PartFeed` from the thread that computes them to the
writer thread (CacheWriter.stream in writer.py). Every producer of parts (the cache stage, derive,
convert, reference import) builds these; only a writer consumes them (`PartWriter`: a CacheWriter, or
the same writer in a process of its own, process_writer.ProcessWriter).
"""
from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from deepspec.cache.spec.format import hidden_name, scale_name


@dataclass
class PartData:
    """One part's samples, in store order. `hidden` maps layer id (or "last") to either the encoded
    (bits, scale) pair (format.encode_hidden; what the cache stage hands over, so the writer thread
    does no tensor math) or a [T, H] float tensor to encode here."""
    name: str | None                  # None: the writer names it by its content (format.part_name)
    sample_ids: np.ndarray            # uint64 [n]
    lengths: np.ndarray               # int64 [n]
    input_ids: np.ndarray             # int32 [T]
    loss_mask: np.ndarray             # uint8 [T]
    hidden: dict = field(default_factory=dict)
    # arrays this part takes from another store (deepspec.cache.build.derive_source): their names, and a callback
    # that puts them into the new part group (writer, group) before the part is committed
    copied: tuple = ()
    copy: object = None
    # the samples' content keys, uint64 [n, 2] (format.sample_key); computed by the writer when None
    keys: np.ndarray | None = None
    # a streamed part: `hidden` stays empty and its rows arrive batch by batch through this feed
    feed: "PartFeed | None" = None
    # or, handed to submit(): an iterable of such batches ({layer: (bits, scale)}), which submit()
    # streams through a feed in the calling thread
    batches: object = None
    # the software and hardware its states were computed under (models.target.compute_fingerprint), for
    # its commit record; a derived part carries its source part's
    computed_by: str | None = None

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


class PartWriter(Protocol):
    """What the cache stage writes parts through (writer.CacheWriter, process_writer.ProcessWriter):
    rank 0 holds the store's lease from construction to `release`; `submit` hands a part over (with
    `batches`, streamed); `close` waits until every part handed over is committed, `abort` keeps only
    those handed over whole; `on_commit(name)` is called on a thread of the writer's once a part is
    committed; `write_manifest` switches the root to the parts `order` names."""
    url: str
    rank: int
    on_commit: Callable[[str], None] | None

    def submit(self, part: PartData) -> None: ...

    def close(self, consolidate: bool = True, order: list[str] | None = None) -> None: ...

    def abort(self) -> None: ...

    def release(self) -> None: ...

    def committed_parts(self) -> dict[str, dict]: ...

    def write_manifest(self, order: list[str] | None = None, rescan: bool = False,
                       prune_unlisted: bool | None = None) -> dict: ...

    # a writer as a context manager (both writers subclass this protocol for it): closed when the
    # block ends, aborted when it raises, released either way
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.close()
            else:
                self.abort()
        finally:
            self.release()


class FeedAborted(Exception):
    """The computing side gave up on a streamed part; the part is not committed."""


class PartFeed:
    """The hidden-state rows of one streamed part, handed from the thread that computes them to the
    writer thread a batch at a time: {layer id or "last": (bits, scale)}, rows in store order.
    At most `depth` batches wait, so a rank holds a few batches of a part, never the part."""

    _END, _ABORT = object(), object()

    def __init__(self, check_writer, layers: list, depth: int = 2):
        # check_writer(): raises the writer's error once it has failed (CacheWriter passes its own check)
        self.check_writer, self.layers = check_writer, list(layers)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self.closed = False  # every row was put

    def _put(self, item) -> None:
        while True:  # a writer that failed no longer takes batches: its error is raised here
            self.check_writer()
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def put(self, hidden) -> None:
        """`hidden`: {layer: (bits, scale)}, or a devices.HostBatch whose result() is that once its
        device-to-host copies have landed (the writer thread waits for them, not the computing one)."""
        self._put(hidden)

    def close(self) -> None:
        """Every row was put: the writer finishes the part's shards and commits it."""
        self._put(self._END)
        self.closed = True

    def abort(self) -> None:
        """The part will not be completed: the writer drops it uncommitted (never blocks)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        try:
            self._queue.put_nowait(self._ABORT)
        except queue.Full:
            pass

    def arrays(self):
        """{array name: rows} per batch, as the backends take them (writer thread)."""
        while (item := self._queue.get()) is not self._END:
            if item is self._ABORT:
                raise FeedAborted("the part's computation stopped before its last batch")
            if not isinstance(item, dict):  # a batch whose host copies may still be in flight
                item = item.result()
            out = {}
            for layer, (bits, scale) in item.items():
                out[hidden_name(layer)] = bits
                if scale is not None:
                    out[scale_name(layer)] = scale
            yield out
