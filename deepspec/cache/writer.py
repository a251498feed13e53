"""Writing cache parts: whole shards per call, committed atomically, on a background thread.

A part is written array by array into `parts/<name>/`; on a local filesystem every file and
directory of it is then fsynced, and only then is the part group's `committed` attribute set (a
durable replace). On opening, rank 0 deletes everything a killed writer leaves (uncommitted parts,
zarr's `*.partial` temp files, anything else that is not part of the layout) and checks every
committed part of a local store cheaply (verify.part_damage): a damaged one is deleted with every
part after it, so the rerun repeats the same packing.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from deepspec.cache.backend import (PART_NAME, ArraySpec, CacheStore, Manifest, PartEntry, backend_class, detect,
                                    open_for_write)
from deepspec.cache.format import CONTENT_KEYS, CacheFormatError, encode_hidden, hidden_name, part_arrays, scale_name
from deepspec.cache.lease import DEFAULT_TTL_S, LEASE_NAME, acquire, join
from deepspec.cache.store import is_remote

log = logging.getLogger(__name__)

TOKEN_CHUNK_1D = 1024  # input_ids / loss_mask / scales: a sample reads one or two chunks


@dataclass
class PartData:
    """One part's samples, in store order. `hidden` maps layer id (or "last") to either the encoded
    (bits, scale) pair (format.encode_hidden; what the cache stage hands over, so the writer thread
    does no tensor math) or a [T, H] float tensor to encode here."""
    name: str
    sample_ids: np.ndarray            # uint64 [n]
    lengths: np.ndarray               # int64 [n]
    input_ids: np.ndarray             # int32 [T]
    loss_mask: np.ndarray             # uint8 [T]
    hidden: dict = field(default_factory=dict)
    # arrays this part takes from another store (deepspec.cache.derive): their names, and a callback
    # that puts them into the new part group (writer, group) before the part is committed
    copied: tuple = ()
    copy: object = None

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def manifest_mismatch(old: dict, new: dict) -> str | None:
    """First differing content field, spelled as a key path, or None when the store is compatible."""
    for key in CONTENT_KEYS:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(set(a) | set(b)):
                if sub != "id" and a.get(sub) != b.get(sub):
                    return f"{key}.{sub}: store has {a.get(sub)!r}, expected {b.get(sub)!r}"
        elif a != b:
            return f"{key}: store has {a!r}, expected {b!r}"
    return None


class CacheWriter:
    """Writes parts into one store, of the backend the manifest's `storage` names ("zarr", the
    default, or "hdf5"; backend.CacheStore). Rank 0 (the default) takes the store's lease
    (deepspec.cache.lease) before touching anything; the other ranks of the same job pass its
    `run_id` and join that lease. Call `release()` (or use the writer as a context manager) when
    done. A store whose content fields (or backend) differ is pruned when `prune_stale` (default:
    local stores only), else refused."""

    def __init__(self, url: str, manifest: dict, storage_options: dict | None = None,
                 queue_size: int = 2, rank: int = 0, prune_stale: bool | None = None, run_id: str | None = None,
                 lease_ttl: float = DEFAULT_TTL_S):
        self.url = url
        self.manifest = Manifest.from_dict({k: v for k, v in dict(manifest).items()
                                            if k not in ("format", "format_version", "parts")}, url)
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
        try:
            if rank == 0:
                self._switch_backend(not self.remote if prune_stale is None else prune_stale)
            self.store: CacheStore = open_for_write(url, self.manifest.storage, storage_options)
            if rank == 0:
                self.store.refuse_foreign(self.keep_at_root)
                # a remote store is named by its content (store.store_url): one that differs is someone
                # else's, never pruned; a local store's old version stays restorable from DVC's cache
                self._reconcile(not self.remote if prune_stale is None else prune_stale)
        except BaseException:
            self.release()
            raise
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
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
        old = backend_class(kind)(self.url, self.storage_options, writable=True)
        old.refuse_foreign(self.keep_at_root)
        log.warning("%s: existing cache is stale (%s): deleting it", self.url, why)
        old.delete_all()

    def _reconcile(self, prune_stale: bool) -> None:
        old = self.store.root_attrs()
        if old.get("format") == self.manifest.format:
            why = manifest_mismatch(old, self.manifest)
            if why is None and "derived_from" in old and "derived_from" not in self.manifest:
                self.manifest.extra["derived_from"] = old["derived_from"]  # provenance outlives a later growth run
            if why is not None:
                if not prune_stale:
                    raise CacheFormatError(f"{self.url}: existing cache does not match ({why}); refusing to "
                                           "overwrite it — delete it or choose another cache.url")
                log.warning("%s: existing cache is stale (%s): pruning all parts", self.url, why)
                for name in self.store.committed_parts():
                    self.store.delete_part(name)
        self.store.prune_debris(self.keep_at_root)
        if not self.remote:
            self._drop_damaged()
        self.write_manifest()

    def _drop_damaged(self) -> None:
        """A committed part whose files did not survive (a power loss before the writer fsynced
        them, or a truncated copy) is deleted together with every part after it: the rerun then
        packs the same samples into the same parts as an uninterrupted build."""
        names = list(self.store.committed_parts())
        arrays = part_arrays(self.manifest.layers, self.manifest.dtype)
        for k, name in enumerate(names):
            why = self.store.part_damage(name, arrays)
            if why is None:
                continue
            later = names[k + 1:]
            log.warning("%s: committed part %s is damaged (%s): deleting it and the %d parts after it, "
                        "which this run writes again", self.url, f"parts/{name}", why, len(later))
            for n in names[k:]:
                self.store.delete_part(n)
            break

    def committed_parts(self) -> dict[str, dict]:
        return self.store.committed_parts()

    def committed_sample_ids(self) -> set[int]:
        return {int(v) for ids in self.committed_part_sample_ids().values() for v in ids}

    def committed_part_sample_ids(self) -> dict[str, np.ndarray]:
        """Each committed part's sample ids (uint64, in the part's order): what the cache stage's
        part plan needs to know of a store."""
        return {name: np.asarray(self.store.read_slow(a, "sample_id", 0, a.samples), dtype=np.uint64)
                for name, a in self._entries().items()}

    def _entries(self) -> dict[str, PartEntry]:
        return {n: PartEntry(n, int(a["samples"]), int(a["tokens"]),
                             [int(v) for v in a["chunk_index"]] if "chunk_index" in a else None)
                for n, a in self.store.committed_parts().items()}

    # ---- writing ------------------------------------------------------------------------------
    def submit(self, part: PartData) -> None:
        """Hand a part to the background thread (blocks while `queue_size` parts are pending)."""
        self._raise_if_failed()
        self._queue.put(part)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()

    def abort(self) -> None:
        """Stop after the part being written; pending parts are dropped (they are not committed)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join()

    def release(self) -> None:
        """Give up the store's lease (rank 0; a no-op for joined ranks). Call after close()."""
        self.lease.release()

    def __enter__(self) -> "CacheWriter":
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.close()
            else:
                self.abort()
        finally:
            self.release()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise CacheFormatError(f"{self.url}: writing a part failed: {self._error}") from self._error

    def _run(self) -> None:
        while (part := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                self.write_part(part)
            except BaseException as e:  # surfaced to the producer on its next submit/close
                self._error = e

    def part_specs(self, part: PartData) -> list[ArraySpec]:
        """Every array of a part, in format.part_arrays order, with its chunking and codec."""
        dtype, chunk, codec = self.manifest.dtype, self.manifest.chunk_tokens, self.manifest.codec
        offsets = np.zeros(len(part.lengths) + 1, dtype=np.int64)
        np.cumsum(part.lengths, out=offsets[1:])
        specs = [ArraySpec("offsets", offsets, max(len(offsets), 1)),
                 ArraySpec("sample_id", part.sample_ids.astype(np.uint64), max(len(part.sample_ids), 1)),
                 ArraySpec("input_ids", part.input_ids.astype(np.int32), TOKEN_CHUNK_1D),
                 ArraySpec("loss_mask", part.loss_mask.astype(np.uint8), TOKEN_CHUNK_1D)]
        for layer, values in part.hidden.items():
            bits, scale = values if isinstance(values, tuple) else encode_hidden(torch.as_tensor(values), dtype)
            specs.append(ArraySpec(hidden_name(layer), bits, chunk, codec))
            if scale is not None:
                specs.append(ArraySpec(scale_name(layer), scale, TOKEN_CHUNK_1D))
        return specs

    def write_part(self, part: PartData) -> None:
        self.lease.check()
        if not PART_NAME.fullmatch(part.name):
            raise CacheFormatError(f"part name {part.name!r} is not p + 6 digits")
        attrs = {"committed": True, "samples": int(len(part.lengths)), "tokens": part.tokens, "rank": self.rank}
        # arrays a derive links from its source (part.copy) are not written again
        specs = [spec for spec in self.part_specs(part) if spec.name not in part.copied]
        before = None if part.copy is None else (lambda group: part.copy(self, group))
        entry = self.store.write_part(part.name, specs, attrs, self.rank, self.lease, before=before)
        log.debug("committed part %s: %d samples, %d tokens", part.name, len(part.lengths), part.tokens)
        if self._committed is not None:
            self._committed[part.name] = entry
        if self.rank == 0 and self._thread is threading.current_thread():
            self.write_manifest()

    def _manifest(self) -> Manifest:
        # listing every part costs one metadata read per part: do it once, then keep the list up to
        # date as parts commit (other ranks' parts are picked up by rescan=True)
        if self._committed is None:
            self._committed = self._entries()
        m = Manifest.from_dict(self.manifest.to_dict())
        m.parts = [self._committed[n] for n in sorted(self._committed)]
        return m

    def write_manifest(self, rescan: bool = False) -> dict:
        """Consolidate the committed parts into the root manifest (one atomic object write)."""
        if rescan:
            self._committed = None
        m = self._manifest()
        attrs = m.to_dict()
        if json.loads(json.dumps(attrs)) != self.store.root_attrs():  # a no-op rerun writes nothing
            self.lease.check()
            self.store.write_manifest(m)
        return attrs
