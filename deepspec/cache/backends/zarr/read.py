"""The Zarr v3 backend (docs/cache-format.md §2–§7): one group per part, one shard file per array.
`ZarrStore` reads a store; zarr_write.ZarrStoreWriter adds the write side."""
from __future__ import annotations

import asyncio
import json
import os
from functools import cached_property

import numpy as np
import zarr

from deepspec.cache.backends.base import ArrayLayout, CacheStore
from deepspec.cache.spec.format import PART_NAME, CacheFormatError, parsing
from deepspec.cache.spec.manifest import PartEntry
from deepspec.cache.storage.urls import local_path
from deepspec.cache.storage.fenced import open_root
from deepspec.cache.backends.zarr.layout import EMPTY, parse_layout, split_suffix

# zarr-python decodes a whole chunk to read a row of it: a chunk may be larger than its array's rows
# (a small part's 1-D arrays are chunked by 1,024 tokens) only up to this; and what a stored chunk
# may add to its rows' bytes (a Blosc header and its crc32c)
SMALL_CHUNK_BYTES = 16 << 20
CHUNK_OVERHEAD = 64

# the consolidated per-sample index (§3.1): v3, arrays `index/<name>` (uint64 [samples, 6], one chunk,
# named by their content, never overwritten); v2, the one array `index` (uint64 [samples, 4])
INDEX_ARRAY = "index"


def group_attrs(buf) -> dict | None:
    """The attributes of a part group's zarr.json (a zarr Buffer), read directly, not through
    zarr-python, which raises on an empty or torn one; None when it is absent, unreadable or not a group."""
    try:
        meta = json.loads(buf.to_bytes()) if buf is not None else None
    except ValueError:
        return None
    if not isinstance(meta, dict) or meta.get("node_type") != "group":
        return None
    attrs = meta.get("attributes") or {}
    return dict(attrs) if isinstance(attrs, dict) else None


class ZarrStore(CacheStore):
    kind = "zarr"
    layout_entries = frozenset({"zarr.json", "parts", INDEX_ARRAY})

    @cached_property
    def root(self) -> zarr.Group:
        return self.open_group()

    def open_group(self) -> zarr.Group:
        """The root group, opened read-only (ZarrStoreWriter opens it to write)."""
        return open_root(self.url, "r", self.storage_options)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "root"}

    # ---- manifest ----------------------------------------------------------------------------
    def root_attrs(self) -> dict:
        return dict(self.root.attrs)

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

    def index_keys(self) -> list[str]:
        if self.remote:
            return [n for n in self.list_dir(INDEX_ARRAY) if n not in ("zarr.json", "c")]
        path = local_path(self.url) / INDEX_ARRAY
        if not path.is_dir() or (path / "c").exists():  # absent, or v2's single array
            return []
        return sorted(n for n in os.listdir(path) if n != "zarr.json")

    def index_key(self, name: str) -> str:
        return f"{INDEX_ARRAY}/{name}/c/0/0"

    # ---- listing -----------------------------------------------------------------------------
    def list_dir(self, prefix: str, store=None) -> list[str]:
        from zarr.core.sync import sync

        store = store or self.root.store
        if self.remote:  # s3fs caches listings per filesystem instance: another process may have written
            store.fs.invalidate_cache(f"{store.path}/{prefix}".rstrip("/"))

        async def names():
            return [n async for n in store.list_dir(prefix)]

        return sorted(n.rstrip("/") for n in sync(names()) if n.rstrip("/"))

    def part_marks(self, committed_only: bool = True) -> dict[str, dict | None]:
        """Every entry under parts/ -> its group attributes (None when it is not a readable part
        group). Read directly, not through zarr-python, which raises on an empty or torn zarr.json."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        store = self.root.store
        names = [n for n in self.list_dir("parts") if n != "zarr.json"]

        async def read(name):
            if not PART_NAME.fullmatch(name):
                return None
            try:
                buf = await store.get(f"parts/{name}/zarr.json", prototype=default_buffer_prototype())
            except OSError:
                return None
            except CacheFormatError as e:  # the door refused it: a committed part that cannot be read
                return {"committed": True, "samples": 0, "tokens": 0, "damaged": str(e)}
            return group_attrs(buf)

        async def read_all():
            return await asyncio.gather(*(read(n) for n in names))

        marks = dict(zip(names, sync(read_all())))
        if committed_only:
            return {n: a for n, a in marks.items() if a and a.get("committed")}
        return marks

    def committed_parts(self) -> dict[str, dict]:
        return dict(sorted(self.part_marks().items()))

    def computed_by(self, name: str) -> str | None:
        got = self._part_attrs(name).get("computed_by")
        return None if got is None else str(got)

    def part_committed(self, name: str) -> bool:
        return bool(self._part_attrs(name).get("committed"))

    def _part_attrs(self, name: str) -> dict:
        """Part `name`'s group attributes (its commit record), {} when it has none yet: one small read."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        try:
            buf = sync(self.root.store.get(f"parts/{name}/zarr.json", prototype=default_buffer_prototype()))
        except OSError:
            return {}
        return group_attrs(buf) or {}

    # ---- reading -----------------------------------------------------------------------------
    # zarr-python reads a local store through the door (storage.door_store.DoorStore) and parses
    # metadata itself: whatever it raises on a hostile zarr.json is a refusal naming the array
    def _array(self, path: str) -> zarr.Array:
        with parsing(f"{self.url}: {path}/zarr.json"):
            try:
                got = self.root[path]
            except KeyError:
                raise CacheFormatError(f"{self.url}: array {path} is missing") from None
            if not isinstance(got, zarr.Array):
                raise CacheFormatError(f"{self.url}: {path} is not an array")
            return got

    def layout(self, part: PartEntry, array: str) -> ArrayLayout | None:
        path = f"parts/{part.name}/{array}"
        meta = self._array(path).metadata.to_dict()
        with parsing(f"{self.url}: {path}/zarr.json"):
            return parse_layout(path, meta)

    def read_slow(self, part: PartEntry, array: str, start: int, stop: int) -> np.ndarray:
        """Rows through zarr-python, once the array's chunks are known to be no larger than its
        rows or small (zarr-python allocates a whole chunk to decode one) and its shard no larger than they
        can be stored in: what it declares is checked before the library sizes anything by it."""
        path = f"parts/{part.name}/{array}"
        a = self._array(path)
        with parsing(f"{self.url}: {path}/zarr.json"):
            layout = parse_layout(path, a.metadata.to_dict())
            chunk_rows = int(a.chunks[0]) if a.ndim else 1
            row_bytes = a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
        if chunk_rows * row_bytes > max(int(a.shape[0]) * row_bytes, SMALL_CHUNK_BYTES):
            raise CacheFormatError(f"{self.url}: {path}: chunks of {chunk_rows} rows for its {a.shape[0]} rows")
        if layout is not None:
            most = layout.n_chunks * (chunk_rows * row_bytes + CHUNK_OVERHEAD) + layout.suffix_bytes
            size = self.key_size(layout.key)
            if not layout.suffix_bytes <= size <= most:  # zarr-python reads a missing shard as fill values
                raise CacheFormatError(f"{self.url}: {layout.key}: {size} bytes (missing or cut short), or more than "
                                       f"its {layout.n_chunks} chunks can be stored in ({most})")
            if layout.crc_table and stop > start:
                self._check_chunks(layout, start, stop)
        try:  # zarr-python's crc32c codec reports a mismatch as ValueError, a bad codec chain as TypeError
            with parsing(f"{self.url}: {path}: rows {start}..{stop}"):
                return np.asarray(a[start:stop])
        except FileNotFoundError:
            raise CacheFormatError(f"{self.url}: {path}: its shard is missing") from None

    def key_size(self, key: str) -> int:
        """The size of one store file (a HEAD on S3; through the door locally); 0 when absent."""
        from zarr.core.sync import sync

        try:
            return int(sync(self.root.store.getsize(key)))
        except FileNotFoundError:
            return 0

    def _check_chunks(self, layout: ArrayLayout, start: int, stop: int) -> None:
        """The crc32cs of the chunks holding rows [start, stop), which zarr-python cannot check when
        they are in the shard's table (v4): what reading through the library checks, as the fast path does."""
        from crc32c import crc32c
        from zarr.abc.store import RangeByteRequest, SuffixByteRequest
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        store, proto, name = self.root.store, default_buffer_prototype(), f"{self.url}: {layout.key}"
        suffix = sync(store.get(layout.key, proto, byte_range=SuffixByteRequest(layout.suffix_bytes)))
        try:
            index, crcs = split_suffix(layout, b"" if suffix is None else suffix.to_bytes())
        except ValueError as e:
            raise CacheFormatError(f"{name}: {e}") from None
        c0, c1 = start // layout.chunk_rows, (stop - 1) // layout.chunk_rows
        if c1 >= layout.n_chunks or (index[c0:c1 + 1, 0] == EMPTY).any():
            raise CacheFormatError(f"{name}: rows {start}..{stop} are not all in written chunks")
        for c in range(c0, c1 + 1):
            off, n = int(index[c, 0]), int(index[c, 1])
            raw = sync(store.get(layout.key, proto, byte_range=RangeByteRequest(off, off + n)))
            if raw is None or crc32c(raw.to_bytes()) != int(crcs[c]):
                raise CacheFormatError(f"{name}: chunk {c} checksum mismatch (corrupt bytes)")

    def array_rows(self, part: PartEntry, array: str) -> int:
        return int(self._array(f"parts/{part.name}/{array}").shape[0])

    def declared(self, part: PartEntry, array: str) -> tuple[np.dtype, tuple]:
        a = self._array(f"parts/{part.name}/{array}")
        with parsing(f"{self.url}: parts/{part.name}/{array}/zarr.json"):
            return np.dtype(a.dtype), tuple(a.shape)
