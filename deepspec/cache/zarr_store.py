"""The Zarr v3 backend (docs/cache-format.md §2–§7): one group per part, one shard file per array."""
from __future__ import annotations

import asyncio
import json
import logging
import math

import numpy as np
import zarr

from deepspec.cache.backend import PART_NAME, ArrayLayout, ArraySpec, CacheStore, Manifest, PartEntry
from deepspec.cache.format import BLOSC, FORMAT, INDEX_COLUMNS, CacheFormatError, inner_codecs
from deepspec.cache.store import PartConflict, fsync_path, fsync_tree, local_path, open_root, open_store

log = logging.getLogger(__name__)

INDEX_ARRAY = "index"  # the consolidated per-sample index, uint64 [samples, 4], one chunk (§3.1)


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


class ZarrStore(CacheStore):
    kind = "zarr"
    layout_entries = frozenset({"zarr.json", "parts", INDEX_ARRAY})

    def __init__(self, url: str, storage_options: dict | None = None, writable: bool = False):
        super().__init__(url, storage_options, writable)
        self._root = None

    @property
    def root(self) -> zarr.Group:
        if self._root is None:
            if self.writable:
                store = open_store(self.url, "a", self.storage_options)
                self._root = zarr.open_group(store=store, mode="a", zarr_format=3)
            else:
                self._root = open_root(self.url, "r", self.storage_options)
        return self._root

    def __getstate__(self):
        return dict(self.__dict__, _root=None)

    # ---- manifest ----------------------------------------------------------------------------
    def root_attrs(self) -> dict:
        return dict(self.root.attrs)

    def write_manifest(self, manifest: Manifest) -> None:
        self.root.attrs.put(manifest.stored_dict())

    def read_range(self, key: str, start: int, end: int) -> bytes:
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        buf = sync(self.root.store.get(key, prototype=default_buffer_prototype(),
                                       byte_range=RangeByteRequest(start, end)))
        if buf is None:
            raise CacheFormatError(f"{self.url}: {key} is missing")
        data = buf.to_bytes()
        if len(data) != end - start:
            raise CacheFormatError(f"{self.url}: {key}: short read ({len(data)} of {end - start} bytes at {start})")
        return data

    def write_index(self, rows: np.ndarray) -> dict:
        """The index is an ordinary single-shard array `index` at the root whose only chunk is the
        whole array, so its rows are bytes [0, 32 n) of `index/c/0/0`."""
        from crc32c import crc32c

        rows = np.ascontiguousarray(rows, dtype="<u8").reshape(-1, 4)
        self._delete(INDEX_ARRAY)
        self._array(self.root, INDEX_ARRAY, rows, max(len(rows), 1))
        if not self.remote:
            path = local_path(self.url)
            fsync_tree(path / INDEX_ARRAY)
            fsync_path(path)
        return {"key": f"{INDEX_ARRAY}/c/0/0", "offset": 0, "nbytes": int(rows.nbytes),
                "crc32c": crc32c(rows.tobytes()), "samples": len(rows), "columns": list(INDEX_COLUMNS)}

    # ---- listing, debris, damage -------------------------------------------------------------
    def _list(self, prefix: str, store=None) -> list[str]:
        from zarr.core.sync import sync

        store = store or self.root.store
        if self.remote:  # s3fs caches listings per filesystem instance: another process may have written
            store.fs.invalidate_cache(f"{store.path}/{prefix}".rstrip("/"))

        async def names():
            return [n async for n in store.list_dir(prefix)]

        return sorted(n.rstrip("/") for n in sync(names()) if n.rstrip("/"))

    def refuse_foreign(self, keep: set[str]) -> None:
        """Before zarr-python creates anything: a location that holds anything but a deepspec cache
        (or what a writer of one leaves) is refused, so that pruning debris never deletes a user's files."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        store = open_store(self.url, "a", self.storage_options)
        names = self._list("", store)
        others = [n for n in names if n not in self.layout_entries and n not in keep and not n.endswith(".partial")]
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

    def prune_debris(self, keep: set[str]) -> None:
        for name in self._list(""):
            if name not in self.layout_entries and name not in keep:
                log.info("%s: deleting %s (not part of a cache; left by an interrupted writer)", self.url, name)
                self._delete(name)
        for name, mark in self._part_marks(committed_only=False).items():
            if mark is None or not mark.get("committed"):
                log.info("%s: pruning uncommitted part %s (left by an interrupted run)", self.url, name)
                self._delete(f"parts/{name}")

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

    def committed_parts(self) -> dict[str, dict]:
        return dict(sorted(self._part_marks().items()))

    def part_damage(self, name: str, arrays: list[str]) -> str | None:
        from deepspec.cache.verify import part_damage

        return part_damage(str(local_path(self.url)), name, arrays)

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

    def delete_part(self, name: str) -> None:
        self._delete(f"parts/{name}")

    def delete_all(self) -> None:
        self._delete("parts")
        self._delete(INDEX_ARRAY)
        self._delete("zarr.json")
        self._root = None

    # ---- writing -----------------------------------------------------------------------------
    def _array(self, group: zarr.Group, name: str, data: np.ndarray, chunk_rows: int, codec: str = "none") -> None:
        """zarr-python writes the array's metadata; the shard itself (the array's only file) is
        encoded here in one pass and stored with one write. zarr-python's own shard writer pays
        Python overhead per inner chunk (~6x slower than a raw write for narrow rows); the bytes
        are identical (tests/cache/test_writer.py compares them)."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        rows = data.shape[0]
        chunks = (min(chunk_rows, max(rows, 1)),) + data.shape[1:]
        shards = (math.ceil(max(rows, 1) / chunks[0]) * chunks[0],) + data.shape[1:]
        codecs = inner_codecs(codec, data.dtype.itemsize)
        # never overwrite=True: that deletes what is there, which may be another writer's committed part
        group.create_array(name, shape=data.shape, dtype=data.dtype, chunks=chunks, shards=shards,
                           serializer=codecs[0], compressors=codecs[1:], fill_value=0,
                           config={"write_empty_chunks": True})
        key = f"{group.path}/{name}/c/".lstrip("/") + "/".join("0" for _ in data.shape)
        blob = encode_shard(data, chunks[0], codec)
        sync(self.root.store.set(key, default_buffer_prototype().buffer.from_bytes(blob)))

    def write_part(self, name: str, arrays: list[ArraySpec], attrs: dict, rank: int, lease,
                   before=None) -> PartEntry:
        # a part is only ever created (on S3 by conditional PUTs, store.FencedS3Store): a name that
        # exists is an error, never an overwrite
        try:
            group = self.root.create_group(f"parts/{name}", attributes={"committed": False})
        except (zarr.errors.ContainsGroupError, zarr.errors.ContainsArrayError):
            raise PartConflict(f"{self.url}: parts/{name} already exists; a committed part is never "
                               "rewritten") from None
        if before is not None:  # a derive links the arrays it keeps from its source into the new part
            before(group)
        for spec in arrays:
            self._array(group, spec.name, spec.data, spec.chunk_rows, spec.codec)
        if not self.remote:  # an S3 PUT is durable when it returns; a local file only once fsynced
            path = local_path(self.url)
            fsync_tree(path / "parts" / name)
            for p in (path / "parts" / "zarr.json", path / "parts", path):
                fsync_path(p)
        lease.check()  # never commit over the parts of a job that took the store over
        group.attrs.put(attrs)  # the commit record: O(samples of this part) bytes, nothing at the root
        return PartEntry(name, attrs["samples"], attrs["tokens"])

    # ---- reading -----------------------------------------------------------------------------
    def layout(self, part: PartEntry, array: str) -> ArrayLayout | None:
        from deepspec.cache.reader import _parse_layout

        path = f"parts/{part.name}/{array}"
        try:
            meta = self.root[path].metadata.to_dict()
        except KeyError:
            raise CacheFormatError(f"{self.url}: array {path} is missing") from None
        return _parse_layout(path, meta)

    def read_slow(self, part: PartEntry, array: str, start: int, stop: int) -> np.ndarray:
        try:
            return np.asarray(self.root[f"parts/{part.name}/{array}"][start:stop])
        except KeyError:
            raise CacheFormatError(f"{self.url}: array parts/{part.name}/{array} is missing") from None
        except ValueError as e:  # zarr-python's crc32c codec reports a mismatch as ValueError
            raise CacheFormatError(f"{self.url}: parts/{part.name}/{array}: rows {start}..{stop}: {e}") from None

    def array_rows(self, part: PartEntry, array: str) -> int:
        return int(self.root[f"parts/{part.name}/{array}"].shape[0])
