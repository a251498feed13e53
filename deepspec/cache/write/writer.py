"""Writing cache parts: whole shards per call, committed atomically, on background threads.

A part is written array by array into `parts/<name>/`; then (on a second thread, while the next
part is written) every file and directory of it is fsynced on a local filesystem, and only then is
the part group's `committed` attribute set (a durable replace). On opening, rank 0 deletes what a
killed writer leaves (uncommitted parts, zarr's `*.partial` temp files, anything not of the
layout) and checks every committed part of a local store cheaply (part_damage): a damaged one is
deleted, and the run computes it again (a part's name is its content, so it is the same part).

Committing a part writes only that part's own objects (its commit record carries the part's sample
lengths, ids and content keys), whatever the number of parts; readers keep reading the parts the
root lists. Rank 0 consolidates once when done (`write_manifest`): the per-sample index of the
parts the run's input needs, then the root listing them (a reader then opens the store with O(1)
requests). A run that commits nothing and lists the same parts rewrites nothing.
"""
from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading

import numpy as np

from deepspec.cache.backends.base import (ArraySpec, PartRows, WritableStore, detect, entry_of, index_rows,
                                    split_index)
from deepspec.cache.spec.format import (INDEX_COLUMNS, PART_NAME, CacheFormatError, encode_hidden, hidden_name,
                                   key_to_str, part_arrays, part_name, sample_keys, scale_name)
from deepspec.cache.write.lease import DEFAULT_TTL_S, LEASE_NAME, acquire, join
from deepspec.cache.spec.manifest import Manifest, PartEntry, manifest_mismatch
from deepspec.cache.write.part_data import PartData, PartFeed, PartWriter
from deepspec.cache.storage.urls import is_remote
from deepspec.cache.backends.writers import open_for_write

log = logging.getLogger(__name__)

TOKEN_CHUNK_1D = 1024  # input_ids / loss_mask / scales: a sample reads one or two chunks


class CacheWriter(PartWriter):
    """Writes parts into one store, of the backend the manifest's `storage` names ("zarr", the
    default, or "hdf5"; backend.WritableStore). Rank 0 (the default) takes the store's lease
    (deepspec.cache.write.lease) before touching anything; the other ranks of the same job pass its
    `run_id` and join that lease. Call `release()` (or use the writer as a context manager) when
    done. `threads`: how many threads write a streamed part's arrays at once (the part's shards,
    where the backend writes them as files of their own). A store whose content fields (or
    backend) differ is pruned when `prune_stale` (default: local stores only), else refused.

    Parts are named by their content (format.part_name) and added beside the parts the root lists;
    readers see the root's parts until `write_manifest` switches the root to a new list in one
    write, which on a local store also deletes the committed parts and index objects the new root
    does not list; a store on S3 keeps them (other experiments' manifests may point into them)."""

    def __init__(self, url: str, manifest: dict, storage_options: dict | None = None,
                 queue_size: int = 2, rank: int = 0, prune_stale: bool | None = None, run_id: str | None = None,
                 lease_ttl: float = DEFAULT_TTL_S, threads: int = 1):
        self.url = url
        self.manifest = Manifest.from_dict({k: v for k, v in dict(manifest).items()
                                            if k not in ("format", "format_version", "parts", "consolidated",
                                                         "index")}, url)
        self.manifest.parts = []
        self.storage_options = storage_options
        self.remote = is_remote(url)
        self.keep_at_root = {LEASE_NAME}
        if rank == 0:
            self.lease = acquire(url, storage_options, run_id, ttl=lease_ttl)
        elif run_id is None:
            raise ValueError("a writer of rank > 0 joins rank 0's lease: pass rank 0's run_id")
        else:
            self.lease = join(url, storage_options, run_id)
        self.rank = rank
        self._committed: dict[str, PartEntry] | None = None
        # (lengths, sample ids, keys) of every committed part this writer knows: its own, the root's
        # index's, and those read from other parts' commit records
        self._rows: dict[str, PartRows] = {}
        self._listed: list[str] = []    # the parts the root listed when this writer opened it
        try:
            if rank == 0:
                self._switch_backend(not self.remote if prune_stale is None else prune_stale)
            self.store: WritableStore = open_for_write(url, self.manifest.storage, storage_options)
            self.store.write_threads = max(1, int(threads))
            self.store.refuse_links_out()
            if rank == 0:
                self.store.refuse_foreign(self.keep_at_root)
                # a remote store is named by its content (store.store_url): one that differs is someone
                # else's, never pruned; a local store's old version stays restorable from DVC's cache
                self._reconcile(not self.remote if prune_stale is None else prune_stale)
        except BaseException:
            self.release()
            raise
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._feeds: list[PartFeed] = []  # streamed parts not yet written
        self._error: BaseException | None = None
        self._closed = False
        # called with a part's name (commit thread) once it is committed: a read-through run reads it
        self.on_commit = None
        self._thread = threading.Thread(target=self._run, name="cache-writer", daemon=True)
        self._thread.start()

    @property
    def root(self):
        """The Zarr root group (Zarr stores only; kept for callers that read it directly)."""
        return self.store.root

    # ---- opening ------------------------------------------------------------------------------
    def _switch_backend(self, prune_stale: bool) -> None:
        """A store of the other backend at this location is stale content like any other."""
        kind = detect(self.url, self.storage_options)
        if kind is None or kind == self.manifest.storage:
            return
        why = f"storage: store has {kind!r}, expected {self.manifest.storage!r}"
        if not prune_stale:
            raise CacheFormatError(f"{self.url}: existing cache does not match ({why}); refusing to "
                                   "overwrite it — delete it or choose another cache.url")
        old = open_for_write(self.url, kind, self.storage_options)
        old.refuse_foreign(self.keep_at_root)
        log.warning("%s: existing cache is stale (%s): deleting it", self.url, why)
        old.delete_all()

    def _reconcile(self, prune_stale: bool) -> None:
        old = self.store.root_attrs()
        fresh = old.get("format") != self.manifest.format
        if not fresh:
            why = manifest_mismatch(old, self.manifest)
            if why is None and "derived_from" in old and "derived_from" not in self.manifest:
                self.manifest.extra["derived_from"] = old["derived_from"]  # provenance outlives a later growth run
            if why is not None:
                if not prune_stale:
                    raise CacheFormatError(f"{self.url}: existing cache does not match ({why}); refusing to "
                                           "overwrite it — delete it or choose another cache.url")
                log.warning("%s: existing cache is stale (%s): pruning all parts", self.url, why)
                self.store.delete_all()
                fresh = True
            else:
                self._load_index(old)
        self.store.prune_debris(self.keep_at_root)
        if not self.remote:
            self._drop_damaged()
        if fresh:
            # the root names the store before any part exists: an empty, consolidated manifest (a
            # store killed before its first consolidation then reads as empty, never as foreign)
            m = Manifest.from_dict(self.manifest.to_dict())
            m.parts, m.index = [], None
            self.lease.check()
            self.store.write_manifest(m)

    def _load_index(self, old: dict) -> None:
        """The parts the root lists, and their rows from its index, so that neither the plan nor the
        next consolidation reads them again. A store of an older version lists parts without keys."""
        try:
            m = Manifest.from_dict(old, self.url)
            index = self.store.open_index(m)
        except (CacheFormatError, OSError, ValueError) as e:
            log.warning("%s: consolidated index unreadable (%s): parts are listed instead", self.url, e)
            return
        self._listed = [p.name for p in m.parts]
        if index is None:
            return
        offsets, ids, keys = split_index(index, m.parts, self.url)
        for k, (p, o, i) in enumerate(zip(m.parts, offsets, ids)):
            self._rows[p.name] = PartRows(np.diff(o), i, None if keys is None else keys[k])

    def _drop_damaged(self) -> None:
        """A committed part whose files did not survive (a power loss before the writer fsynced
        them, or a truncated copy) is deleted: the plan then computes it again, under the same name."""
        names = list(self.store.committed_parts())
        arrays = part_arrays(self.manifest.layers, self.manifest.dtype)
        for name in names:
            why = self.store.part_damage(name, arrays)
            if why is None:
                continue
            log.warning("%s: committed part %s is damaged (%s): deleting it; this run writes it again",
                        self.url, f"parts/{name}", why)
            self.store.delete_part(name)
            self._rows.pop(name, None)

    def committed_parts(self) -> dict[str, dict]:
        return self.store.committed_parts()

    def committed_sample_ids(self) -> set[int]:
        return {int(v) for name in self._entries() for v in self._rows[name].sample_ids}

    def _entries(self) -> dict[str, PartEntry]:
        """Every committed part, listed; the rows of parts not yet known are taken from their commit
        records (one small read per part, which the listing already does for Zarr)."""
        out = {}
        for n, a in self.store.committed_parts().items():
            out[n] = entry_of(n, a)
            if n not in self._rows or len(self._rows[n].lengths) != out[n].samples:
                self._rows[n] = self.store.part_rows(n, a)
        return out

    # ---- writing ------------------------------------------------------------------------------
    def submit(self, part: PartData) -> None:
        """Hand a part to the background thread (blocks while `queue_size` parts are pending). A part
        with `batches` is streamed: they are drawn here and fed to the writer one by one."""
        self._raise_if_failed()
        if part.batches is None:
            self._queue.put(part)
            return
        batches, part.batches = part.batches, None
        feed = self.stream(part)
        try:
            for batch in batches:
                feed.put(batch)
        except BaseException:
            feed.abort()
            raise
        feed.close()

    def stream(self, part: PartData, depth: int = 2) -> PartFeed:
        """Start a streamed part (no `hidden` arrays: ids, lengths, input_ids and loss_mask only) and
        return its feed: put() each batch's encoded hidden states in store order, then close() (or
        abort()). The writer thread writes each batch to the part's shards as it arrives and commits
        the part after close(). Call from the thread that submits parts."""
        if part.hidden:
            raise ValueError("a streamed part takes its hidden states from its feed, not from `hidden`")
        part.feed = PartFeed(self._raise_if_failed, [*self.manifest.layers, "last"], depth)
        self._feeds.append(part.feed)
        self.submit(part)
        return part.feed

    def close(self, consolidate: bool = True, order: list[str] | None = None) -> None:
        """Wait for the pending parts; rank 0 then consolidates, listing `order` (write_manifest's
        default without it). Pass consolidate=False while other ranks are still writing."""
        if self._closed:  # a second close (a context manager's exit after an explicit one) changes nothing
            return
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        self._closed = True
        if consolidate and self.rank == 0:
            self.write_manifest(order)

    def abort(self) -> None:
        """Stop once every part handed over whole is written and committed (a streamed part whose
        feed was closed included: its states are never computed again); a streamed part not yet
        closed is dropped uncommitted."""
        pending = []
        with contextlib.suppress(queue.Empty):  # the writer thread may take the last one meanwhile
            while True:
                pending.append(self._queue.get_nowait())
        for feed in [f for f in self._feeds if not f.closed]:
            feed.abort()
        for part in [p for p in pending if p is not None and (p.feed is None or p.feed.closed)] + [None]:
            self._queue.put(part)
        self._thread.join()

    def release(self) -> None:
        """Give up the store's lease (rank 0; a no-op for joined ranks). Call after close()."""
        self.lease.release()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise CacheFormatError(f"{self.url}: writing a part failed: {self._error}") from self._error

    def _run(self) -> None:
        """Writes parts in order; each is made durable and committed on a second thread while the
        next is written (fsyncs cost as much as writing a narrow part: benchmarks/cache_write.py
        --parts); in order, none after a failed commit, a fully written one despite a later failure."""
        commits: queue.Queue = queue.Queue(maxsize=1)
        committer = threading.Thread(target=self._commit_loop, args=(commits,), name="cache-commit", daemon=True)
        committer.start()
        try:
            while (part := self._queue.get()) is not None:
                if self._error is not None:
                    continue
                try:
                    commits.put(self._write(part))
                except BaseException as e:  # surfaced to the producer on its next submit/close/put
                    self._error = e
                finally:
                    if part.feed is not None:
                        self._feeds.remove(part.feed)
        finally:
            commits.put(None)
            committer.join()

    def _commit_loop(self, commits: queue.Queue) -> None:
        failed = False
        while (item := commits.get()) is not None:
            try:
                if failed:
                    getattr(item[2], "discard", lambda: None)()
                    continue
                self._commit(*item)
                if self.on_commit is not None:
                    self.on_commit(item[0].name)
            except BaseException as e:
                failed, self._error = True, self._error or e

    def part_specs(self, part: PartData) -> list[ArraySpec]:
        """Every array of a part, in format.part_arrays order, with its chunking and codec."""
        dtype, chunk, codec = self.manifest.dtype, self.manifest.chunk_tokens, self.manifest.codec
        offsets = np.zeros(len(part.lengths) + 1, dtype=np.int64)
        np.cumsum(part.lengths, out=offsets[1:])
        keys = np.asarray(part.keys, dtype=np.uint64).reshape(-1, 2)
        specs = [ArraySpec("offsets", offsets, max(len(offsets), 1)),
                 ArraySpec("sample_id", part.sample_ids.astype(np.uint64), max(len(part.sample_ids), 1)),
                 ArraySpec("sample_key", keys, max(len(keys), 1)),
                 ArraySpec("input_ids", part.input_ids.astype(np.int32), TOKEN_CHUNK_1D),
                 ArraySpec("loss_mask", part.loss_mask.astype(np.uint8), TOKEN_CHUNK_1D)]
        for layer, values in part.hidden.items():
            bits, scale = values if isinstance(values, tuple) else encode_hidden(values, dtype)
            specs.append(ArraySpec(hidden_name(layer), bits, chunk, codec))
            if scale is not None:
                specs.append(ArraySpec(scale_name(layer), scale, TOKEN_CHUNK_1D))
        if part.feed is not None:  # streamed: shapes known now, rows later
            rows, width = part.tokens, int(self.manifest.hidden_size)
            bits_dtype = np.dtype(np.uint16 if dtype == "bfloat16" else np.uint8)
            for layer in part.feed.layers:
                specs.append(ArraySpec(hidden_name(layer), None, chunk, codec, (rows, width), bits_dtype))
                if dtype != "bfloat16":
                    specs.append(ArraySpec(scale_name(layer), None, TOKEN_CHUNK_1D, "none", (rows,),
                                           np.dtype(np.float32)))
        return specs

    def write_part(self, part: PartData) -> None:
        """Write and commit one part, in this thread."""
        self._commit(*self._write(part))

    def _write(self, part: PartData) -> tuple:
        self.lease.check()
        lengths = np.asarray(part.lengths, dtype=np.int64)
        ids = np.asarray(part.sample_ids, dtype=np.uint64)
        if part.keys is None:  # the content key of each sample: a hash of its tokens and loss mask
            part.keys = sample_keys(part.input_ids, part.loss_mask, lengths)
        keys = np.asarray(part.keys, dtype=np.uint64).reshape(-1, 2)
        if part.name is None:  # named by what it holds (the planners name parts so themselves)
            part.name = part_name(keys, ids)
        if not PART_NAME.fullmatch(part.name):
            raise CacheFormatError(f"part name {part.name!r} is neither p + 24 hex digits nor p + 6 digits")
        # the commit record carries what the consolidated index needs: O(samples of this part) bytes
        attrs = {"committed": True, "samples": int(len(lengths)), "tokens": part.tokens, "rank": self.rank,
                 "lengths": [int(v) for v in lengths], "sample_ids": [f"{int(v):016x}" for v in ids],
                 "keys": [key_to_str(k) for k in keys]}
        if part.computed_by:
            attrs["computed_by"] = part.computed_by
        # arrays a derive links from its source (part.copy) are not written again
        specs = [spec for spec in self.part_specs(part) if spec.name not in part.copied]
        before = None if part.copy is None else (lambda group: part.copy(self, group))
        feed = None if part.feed is None else part.feed.arrays()
        commit = self.store.write_part_deferred(part.name, specs, attrs, self.rank, self.lease, before=before, feed=feed)
        return part, PartRows(lengths, ids, keys), commit

    def _commit(self, part: PartData, rows: PartRows, commit) -> None:
        entry, self._rows[part.name] = commit(), rows
        if self._committed is not None:
            self._committed[part.name] = entry

    def write_manifest(self, order: list[str] | None = None, rescan: bool = False,
                       prune_unlisted: bool | None = None) -> dict:
        """Consolidate: switch the root to the parts `order` names, in that order (default: the parts
        the root listed, then every other committed part in name order; the cache stage passes its
        plan, so that parts of an earlier input are left out), writing the per-sample index of exactly
        those parts first (a new object, named by its content). `rescan` lists the committed parts
        again (other ranks' parts too). `prune_unlisted` (default: local stores) then deletes every
        committed part and index object the new root does not list. A rerun that changes nothing
        writes nothing."""
        if rescan or self._committed is None:
            self._committed = self._entries()
        if order is None:
            order = [n for n in self._listed if n in self._committed]
            order += sorted(set(self._committed) - set(order))
        missing = [n for n in order if n not in self._committed]
        if missing:
            raise CacheFormatError(f"{self.url}: parts/{missing[0]} (and {len(missing) - 1} more) should be listed "
                                   "but are not committed")
        if len(set(order)) != len(order):
            raise CacheFormatError(f"{self.url}: a part is listed twice in the new manifest")
        m = Manifest.from_dict(self.manifest.to_dict())
        m.parts, m.consolidated = [self._committed[n] for n in order], True
        rows = index_rows(m.parts, self._rows)
        stored = self.store.root_attrs()
        have = stored.get("index") if stored.get("format_version") == m.format_version else None
        from crc32c import crc32c

        crc = crc32c(np.ascontiguousarray(rows, dtype="<u8").tobytes())
        if have and (int(have.get("samples", -1)), int(have.get("crc32c", -1)), list(have.get("columns", []))) == \
                (len(rows), crc, list(INDEX_COLUMNS)):
            m.index = dict(have)
        else:
            self.lease.check()
            m.index = self.store.write_index(rows)
        attrs = m.to_dict()
        if json.loads(json.dumps(m.stored_dict())) != stored:
            self.lease.check()
            self.store.write_manifest(m)
        self._listed = list(order)
        if not self.remote if prune_unlisted is None else prune_unlisted:
            self._prune_unlisted(set(order), m.index)
        return attrs

    def _prune_unlisted(self, listed: set[str], index: dict | None) -> None:
        """What the new root no longer lists: committed parts of an earlier input, earlier indexes."""
        dropped = [n for n in self.store.committed_parts() if n not in listed]
        for n in dropped:
            self.store.delete_part(n)
            self._rows.pop(n, None)
            if self._committed is not None:
                self._committed.pop(n, None)
        if dropped:
            log.info("%s: deleted %d parts of samples no longer in the input", self.url, len(dropped))
        for name in self.store.index_keys():
            if index is None or self.store.index_key(name) != index["key"]:
                self.store.delete_index(name)
