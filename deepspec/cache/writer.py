"""Writing cache parts: whole shards per call, committed atomically, on a background thread.

A part is written array by array into `parts/<name>/`; on a local filesystem every file and
directory of it is then fsynced, and only then is the part group's `committed` attribute set (a
durable replace). On opening, rank 0 deletes everything a killed writer leaves (uncommitted parts,
zarr's `*.partial` temp files, anything else that is not part of the layout) and checks every
committed part of a local store cheaply (verify.part_damage): a damaged one is deleted with every
part after it, so the rerun repeats the same packing.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import re
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
import zarr

from deepspec.cache.format import (BLOSC, CONTENT_KEYS, FORMAT, FORMAT_VERSION, CacheFormatError, encode_hidden,
                                   hidden_name, inner_codecs, part_arrays, scale_name)
from deepspec.cache.lease import DEFAULT_TTL_S, LEASE_NAME, acquire, join
from deepspec.cache.store import fsync_path, fsync_tree, is_remote, local_path, open_store

log = logging.getLogger(__name__)

TOKEN_CHUNK_1D = 1024  # input_ids / loss_mask / scales: a sample reads one or two chunks
PART_NAME = re.compile(r"p\d{6}")
ROOT_ENTRIES = {"zarr.json", "parts"}


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


def encode_shard(data: np.ndarray, chunk_rows: int, codec: str) -> bytes:
    """One Zarr v3 shard holding all of `data`: every inner chunk (full size, the last padded with
    zeros) little-endian, optionally Blosc-compressed, followed by its crc32c; then the index of
    (offset, nbytes) pairs and the index's crc32c (docs/cache-format.md §6)."""
    from crc32c import crc32c

    n = max(1, math.ceil(data.shape[0] / chunk_rows))
    le = data.astype(data.dtype.newbyteorder("<"), copy=False)
    if n * chunk_rows != data.shape[0]:
        padded = np.zeros((n * chunk_rows, *data.shape[1:]), dtype=le.dtype)
        padded[:data.shape[0]] = le
        le = padded
    flat = np.ascontiguousarray(le).reshape(n, -1)
    blosc = None
    if codec in BLOSC:
        import numcodecs

        cfg = BLOSC[codec]
        blosc = numcodecs.Blosc(cname=cfg["cname"], clevel=cfg["clevel"], blocksize=cfg["blocksize"],
                                shuffle={"shuffle": 1, "bitshuffle": 2}[cfg["shuffle"]], typesize=data.dtype.itemsize)
    pieces, index, offset = [], np.empty((n, 2), dtype="<u8"), 0
    for c in range(n):
        body = blosc.encode(flat[c].view(np.uint8)) if blosc is not None else memoryview(flat[c]).cast("B")
        pieces += [body, crc32c(body).to_bytes(4, "little")]
        size = len(body) + 4
        index[c] = (offset, size)
        offset += size
    idx = index.tobytes()
    pieces += [idx, crc32c(idx).to_bytes(4, "little")]
    return b"".join(pieces)


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
    """Writes parts into one store. Rank 0 (the default) takes the store's lease (deepspec.cache.lease)
    before touching anything; the other ranks of the same job pass its `run_id` and join that lease.
    Call `release()` (or use the writer as a context manager) when done. A store whose content
    fields differ is pruned when `prune_stale` (default: local stores only), else refused."""

    def __init__(self, url: str, manifest: dict, storage_options: dict | None = None,
                 queue_size: int = 2, rank: int = 0, prune_stale: bool | None = None, run_id: str | None = None,
                 lease_ttl: float = DEFAULT_TTL_S):
        self.url = url
        self.manifest = dict(manifest, format=FORMAT, format_version=FORMAT_VERSION)
        self.storage_options = storage_options
        self.remote = is_remote(url)
        self.keep_at_root = {LEASE_NAME}
        if rank == 0:
            self.lease = acquire(url, storage_options, run_id, ttl=lease_ttl)
        elif run_id is None:
            raise ValueError("a writer of rank > 0 joins rank 0's lease: pass rank 0's run_id")
        else:
            self.lease = join(url, storage_options, run_id)
        try:
            store = open_store(url, "a", storage_options)
            if rank == 0:
                self._refuse_foreign(store)
            self.root = zarr.open_group(store=store, mode="a", zarr_format=3)
        except BaseException:
            self.release()
            raise
        self.rank = rank
        self._committed: dict[str, dict] | None = None
        if rank == 0:
            try:
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

    # ---- opening ------------------------------------------------------------------------------
    def _reconcile(self, prune_stale: bool) -> None:
        old = dict(self.root.attrs)
        if old.get("format") == FORMAT:
            why = manifest_mismatch(old, self.manifest)
            if why is None and "derived_from" in old and "derived_from" not in self.manifest:
                self.manifest["derived_from"] = old["derived_from"]  # provenance outlives a later growth run
            if why is not None:
                if not prune_stale:
                    raise CacheFormatError(f"{self.url}: existing cache does not match ({why}); refusing to "
                                           "overwrite it — delete it or choose another cache.url")
                log.warning("%s: existing cache is stale (%s): pruning all parts", self.url, why)
                self._delete("parts")
        self._prune_debris()
        if not self.remote:
            self._drop_damaged()
        self.write_manifest()

    def _refuse_foreign(self, store) -> None:
        """Before zarr-python creates anything: a location that holds anything but a deepspec cache
        (or what a writer of one leaves) is refused, so that pruning debris never deletes a user's files."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        names = self._list("", store)
        others = [n for n in names if n not in ROOT_ENTRIES and n not in self.keep_at_root
                  and not n.endswith(".partial")]
        if "zarr.json" in names:
            buf = sync(store.get("zarr.json", prototype=default_buffer_prototype()))
            try:
                attrs = (json.loads(buf.to_bytes()) if buf is not None else {}).get("attributes") or {}
            except (ValueError, AttributeError):
                attrs = {}
            if attrs.get("format") == FORMAT or not (others or "parts" in names):
                return
        elif not others and "parts" not in names:
            return
        raise CacheFormatError(f"{self.url}: exists and is not a deepspec cache ({', '.join(names[:5])}); "
                               "refusing to write into it")

    def _prune_debris(self) -> None:
        """Delete what an interrupted writer leaves: zarr's `*.partial` temp files, part groups that
        were never marked committed (or whose mark is unreadable), and anything else that is not
        part of the layout, so that DVC never hashes or pushes it."""
        for name in self._list(""):
            if name not in ROOT_ENTRIES and name not in self.keep_at_root:
                log.info("%s: deleting %s (not part of a cache; left by an interrupted writer)", self.url, name)
                self._delete(name)
        for name, mark in self._part_marks(committed_only=False).items():
            if mark is None or not mark.get("committed"):
                log.info("%s: pruning uncommitted part %s (left by an interrupted run)", self.url, name)
                self._delete(f"parts/{name}")

    def _drop_damaged(self) -> None:
        """A committed part whose files did not survive (a power loss before the writer fsynced
        them, or a truncated copy) is deleted together with every part after it: the rerun then
        packs the same samples into the same parts as an uninterrupted build."""
        from deepspec.cache.verify import part_damage

        names = list(self.committed_parts())
        arrays = part_arrays(self.manifest["layers"], self.manifest["dtype"])
        root = str(local_path(self.url))
        for k, name in enumerate(names):
            why = part_damage(root, name, arrays)
            if why is None:
                continue
            later = names[k + 1:]
            log.warning("%s: committed part %s is damaged (%s): deleting it and the %d parts after it, "
                        "which this run writes again", self.url, f"parts/{name}", why, len(later))
            for n in names[k:]:
                self._delete(f"parts/{n}")
            break

    def _list(self, prefix: str, store=None) -> list[str]:
        from zarr.core.sync import sync

        store = store or self.root.store
        if self.remote:  # s3fs caches listings per filesystem instance: another process may have written
            store.fs.invalidate_cache(f"{store.path}/{prefix}".rstrip("/"))

        async def names():
            return [n async for n in store.list_dir(prefix)]

        return sorted(n.rstrip("/") for n in sync(names()) if n.rstrip("/"))

    def _part_marks(self, committed_only: bool = True) -> dict[str, dict | None]:
        """Every entry under parts/ -> its group attributes (None when it is not a readable part
        group). Read directly, not through zarr-python, which raises on an empty or torn zarr.json."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        store = self.root.store
        names = [n for n in self._list("parts") if n != "zarr.json"]

        async def read(name):
            if not PART_NAME.fullmatch(name):
                return None
            try:
                buf = await store.get(f"parts/{name}/zarr.json", prototype=default_buffer_prototype())
                meta = json.loads(buf.to_bytes()) if buf is not None else None
            except (OSError, ValueError):
                return None
            if not isinstance(meta, dict) or meta.get("node_type") != "group":
                return None
            return dict(meta.get("attributes") or {})

        async def read_all():
            return await asyncio.gather(*(read(n) for n in names))

        marks = dict(zip(names, sync(read_all())))
        if committed_only:
            return {n: a for n, a in marks.items() if a and a.get("committed")}
        return marks

    def _delete(self, path: str) -> None:
        from zarr.core.sync import sync

        if self.remote:
            sync(self.root.store.delete_dir(path))
            sync(self.root.store.delete(path))  # a plain object of that name
            return
        p = local_path(self.url) / path
        if p.is_dir():
            sync(self.root.store.delete_dir(path))
        else:
            p.unlink(missing_ok=True)

    def committed_parts(self) -> dict[str, dict]:
        return dict(sorted(self._part_marks().items()))

    def committed_sample_ids(self) -> set[int]:
        ids: set[int] = set()
        for name in self.committed_parts():
            ids.update(int(v) for v in self.root[f"parts/{name}/sample_id"][...])
        return ids

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

    def _array(self, group: zarr.Group, name: str, data: np.ndarray, chunk_rows: int) -> None:
        """zarr-python writes the array's metadata; the shard itself (the array's only file) is
        encoded here in one pass and stored with one write. zarr-python's own shard writer pays
        Python overhead per inner chunk (~6x slower than a raw write for narrow rows); the bytes
        are identical (tests/cache/test_writer.py compares them)."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        rows = data.shape[0]
        chunks = (min(chunk_rows, max(rows, 1)),) + data.shape[1:]
        shards = (math.ceil(max(rows, 1) / chunks[0]) * chunks[0],) + data.shape[1:]
        codec = self.manifest["codec"] if data.ndim == 2 else "none"
        codecs = inner_codecs(codec, data.dtype.itemsize)
        # never overwrite=True: that deletes what is there, which may be another writer's committed part
        group.create_array(name, shape=data.shape, dtype=data.dtype, chunks=chunks, shards=shards,
                           serializer=codecs[0], compressors=codecs[1:], fill_value=0,
                           config={"write_empty_chunks": True})
        key = f"{group.path}/{name}/c/" + "/".join("0" for _ in data.shape)
        blob = encode_shard(data, chunks[0], codec)
        sync(self.root.store.set(key, default_buffer_prototype().buffer.from_bytes(blob)))

    def write_part(self, part: PartData) -> None:
        dtype, chunk = self.manifest["dtype"], self.manifest["chunk_tokens"]
        self.lease.check()
        # a part is only ever created (on S3 by conditional PUTs, store.FencedS3Store): a name that
        # exists is an error, never an overwrite
        group = self.root.create_group(f"parts/{part.name}", attributes={"committed": False})
        if part.copy is not None:
            part.copy(self, group)
        offsets = np.zeros(len(part.lengths) + 1, dtype=np.int64)
        np.cumsum(part.lengths, out=offsets[1:])
        for name, data, rows in (("offsets", offsets, max(len(offsets), 1)),
                                 ("sample_id", part.sample_ids.astype(np.uint64), max(len(part.sample_ids), 1)),
                                 ("input_ids", part.input_ids.astype(np.int32), TOKEN_CHUNK_1D),
                                 ("loss_mask", part.loss_mask.astype(np.uint8), TOKEN_CHUNK_1D)):
            if name not in part.copied:
                self._array(group, name, data, rows)
        for layer, values in part.hidden.items():
            bits, scale = values if isinstance(values, tuple) else encode_hidden(torch.as_tensor(values), dtype)
            self._array(group, hidden_name(layer), bits, chunk)
            if scale is not None:
                self._array(group, scale_name(layer), scale, TOKEN_CHUNK_1D)
        attrs = {"committed": True, "samples": int(len(part.lengths)), "tokens": part.tokens, "rank": self.rank}
        if not self.remote:  # an S3 PUT is durable when it returns; a local file only once fsynced
            path = local_path(self.url)
            fsync_tree(path / "parts" / part.name)
            for p in (path / "parts" / "zarr.json", path / "parts", path):
                fsync_path(p)
        self.lease.check()  # never commit over the parts of a job that took the store over
        group.attrs.put(attrs)
        log.debug("committed part %s: %d samples, %d tokens", part.name, len(part.lengths), part.tokens)
        if self._committed is not None:
            self._committed[part.name] = attrs
        if self.rank == 0 and self._thread is threading.current_thread():
            self.write_manifest()

    def _manifest_attrs(self) -> dict:
        # listing every part group costs one metadata read per part: do it once, then keep the
        # list up to date as parts commit (other ranks' parts are picked up by rescan=True)
        if self._committed is None:
            self._committed = self.committed_parts()
        parts = dict(sorted(self._committed.items()))
        return dict(
            self.manifest,
            parts=[{"name": n, "samples": a["samples"], "tokens": a["tokens"]} for n, a in parts.items()],
            num_samples=sum(a["samples"] for a in parts.values()),
            num_tokens=sum(a["tokens"] for a in parts.values()),
        )

    def write_manifest(self, rescan: bool = False) -> dict:
        """Consolidate the committed parts into the root attributes (one atomic object write)."""
        if rescan:
            self._committed = None
        attrs = self._manifest_attrs()
        if json.loads(json.dumps(attrs)) != dict(self.root.attrs):  # a no-op rerun writes nothing
            self.lease.check()
            self.root.attrs.put(attrs)
        return attrs
