"""The HDF5 backend (docs/cache-format.md §11): `manifest.json` + one `parts/<part>.h5` file per part.
`HDF5Store` reads a store; hdf5_write.HDF5StoreWriter adds the write side.

A part file holds the same arrays, dtypes and CSR layout as a Zarr part, each a chunked dataset
with HDF5's Fletcher-32 checksum per chunk (after the Blosc filter when a codec is set). The file is
written complete to a temporary file, fsynced, and committed by creating its final name (a hard
link on a filesystem, a conditional `If-None-Match: *` upload on S3), so a part file that exists is
committed and is never rewritten. When the part is written its chunk table (every dataset's chunk
(offset, nbytes)) is stored inside the file as a plain contiguous dataset `chunk_index`, whose byte
range and crc32c the manifest records: a reader then fetches a sample with byte ranges, without
h5py, exactly as it reads a Zarr shard.
"""
from __future__ import annotations

import contextlib
import json
import os

import numpy as np
from crc32c import crc32c

from deepspec.cache.backends.base import ArrayLayout, CacheStore
from deepspec.cache.storage.bounded import BoundedCache
from deepspec.cache.spec.format import PARSE_ERRORS, PART_NAME, CacheFormatError, parsing
from deepspec.cache.backends.hdf5.h5 import INDEX_DATASET, no_cyclic_gc, register_plugins
from deepspec.cache.spec.manifest import PartEntry
from deepspec.cache.storage import door
from deepspec.cache.storage.urls import local_path, storage_options_for

MANIFEST_NAME = "manifest.json"
SUFFIX = ".h5"
# the consolidated per-sample index (§3.1): v3, files `index/<name>.h5` (dataset "index", uint64
# [samples, 6], named by their content, never overwritten); v2, the one file `index.h5` ([samples, 4])
INDEX_DIR = "index"
INDEX_FILE = "index.h5"
# h5py decodes a whole chunk to read a row of it: a chunk larger than its dataset only up to this
SMALL_CHUNK_BYTES = 16 << 20


class HDF5Store(CacheStore):
    kind = "hdf5"
    layout_entries = frozenset({MANIFEST_NAME, "parts", INDEX_DIR, INDEX_FILE})

    def __init__(self, url: str, storage_options: dict | None = None):
        super().__init__(url, storage_options)
        self._fs = None
        # parsed chunk tables, per part (numpy arrays, not the JSON's lists), bounded: least recently used out
        self.tables = BoundedCache(self.TABLE_BYTES)

    TABLE_BYTES = 16 << 20

    def __getstate__(self):
        return dict(self.__dict__, _fs=None, tables=BoundedCache(self.TABLE_BYTES), last_listing=None)

    # ---- bytes -------------------------------------------------------------------------------
    @property
    def fs(self):
        if self._fs is None:
            import fsspec

            self._fs, self._root = fsspec.core.url_to_fs(self.url, **storage_options_for(self.url, self.storage_options))
        return self._fs

    def key_path(self, key: str) -> str:
        if self.remote:
            _ = self.fs
            return f"{self._root.rstrip('/')}/{key}"
        return door.resolve(str(local_path(self.url)), key)

    def cat(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of one key; the whole of a document (`start` None), refused when it is
        larger than a document may be (its size asked first on a remote store)."""
        try:
            if not self.remote:
                root = str(local_path(self.url))
                return door.read_file(root, key) if start is None else door.read_range(root, key, start, end)
            path = self.key_path(key)
            if start is None:
                size = int(self.fs.size(path))
                if size > door.DOCUMENT_BYTES:
                    raise CacheFormatError(f"{self.url}: {key}: {size} bytes, more than a document may have")
            data = self.fs.cat_file(path, start=start, end=end)
        except FileNotFoundError:
            if key == MANIFEST_NAME:  # a store not created yet (root_attrs)
                raise
            raise CacheFormatError(f"{self.url}: {key} is missing") from None
        except OSError as e:  # a range past the object's end: S3's 416
            if not door.past_its_end(e):
                raise
            raise CacheFormatError(f"{self.url}: {key}: bytes {start}..{end}: {e}") from None
        if start is not None and len(data) != end - start:
            raise CacheFormatError(f"{self.url}: {key}: short read ({len(data)} of {end - start} bytes at {start})")
        return data

    def list_dir(self, prefix: str) -> list[str]:
        if self.remote:
            path = self.key_path(prefix).rstrip("/")
            self.fs.invalidate_cache(path)
            try:
                return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False))
            except FileNotFoundError:
                return []
        path = local_path(self.url) / prefix
        return sorted(os.listdir(path)) if path.is_dir() else []

    @contextlib.contextmanager
    def _h5(self, name: str):
        import h5py

        if not self.remote:  # h5py reads the file object the door opened, never a path of its own
            try:
                raw = door.open_file(str(local_path(self.url)), f"parts/{name}{SUFFIX}")
            except FileNotFoundError:  # a listed part's file: damage of the store
                raise CacheFormatError(f"{self.url}: parts/{name}{SUFFIX} is missing") from None
            with raw, h5py.File(raw, "r") as f:
                yield f
            return
        # h5py reads the S3 object through the fsspec file while holding its global lock: no cyclic
        # collection meanwhile (hdf5_h5py.no_cyclic_gc); the HDF5 file is closed before the file object
        # s3fs's default read-ahead block (50 MB) would hold a whole hostile object in memory: 1 MiB
        with no_cyclic_gc(), self.fs.open(self.key_path(f"parts/{name}{SUFFIX}"), "rb", block_size=1 << 20) as raw, \
                h5py.File(raw, "r") as f:
            yield f

    # ---- manifest ----------------------------------------------------------------------------
    def root_attrs(self) -> dict:
        try:
            raw = self.cat(MANIFEST_NAME)
        except FileNotFoundError:
            if not self.writable:
                raise CacheFormatError(f"{self.url}: not a cache store (no {MANIFEST_NAME})") from None
            return {}
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise CacheFormatError(f"{self.url}/{MANIFEST_NAME}: not valid JSON") from None

    def read_range(self, key: str, start: int, end: int) -> bytes:
        return self.cat(key, start, end)

    def index_keys(self) -> list[str]:
        return [n[:-len(SUFFIX)] for n in self.list_dir(INDEX_DIR) if n.endswith(SUFFIX)]

    def index_key(self, name: str) -> str:
        return f"{INDEX_DIR}/{name}{SUFFIX}"

    # ---- listing -----------------------------------------------------------------------------
    def part_committed(self, name: str) -> bool:
        path = self.key_path(f"parts/{name}{SUFFIX}")  # the name exists only after a commit
        if not self.remote:
            return os.path.exists(path)
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def committed_parts(self) -> dict[str, dict]:
        out = {}
        for entry in self.list_dir("parts"):
            if not (entry.endswith(SUFFIX) and PART_NAME.fullmatch(entry[:-len(SUFFIX)])):
                continue
            name = entry[:-len(SUFFIX)]
            try:
                with self._h5(name) as f:
                    attrs = {k: (v.item() if hasattr(v, "item") and np.ndim(v) == 0 else v) for k, v in f.attrs.items()}
                    # what the consolidated index needs, read while the file is open anyway; each no
                    # larger than a document (h5py allocates what a dataset declares before reading)
                    for dataset in ("offsets", "sample_id", "sample_key"):
                        if dataset in f and f[dataset].nbytes > door.DOCUMENT_BYTES:
                            raise ValueError(f"{dataset} declares {f[dataset].nbytes} bytes")
                    lengths = np.diff(np.asarray(f["offsets"][:], dtype=np.int64))
                    ids = np.asarray(f["sample_id"][:], dtype=np.uint64)
                    keys = np.asarray(f["sample_key"][:], dtype=np.uint64) if "sample_key" in f else None
                attrs[INDEX_DATASET] = [int(v) for v in attrs[INDEX_DATASET]]
                attrs = {k: (int(v) if isinstance(v, (np.integer, bool, np.bool_)) else v) for k, v in attrs.items()}
                attrs["lengths"], attrs["sample_ids"] = lengths, ids
                if keys is not None:
                    attrs["keys"] = keys
            except (OSError, KeyError, ValueError, TypeError, AttributeError, IndexError, OverflowError) as e:
                # the name exists only after a commit: an unreadable file is a damaged committed part
                attrs = {"committed": True, "samples": 0, "tokens": 0, "damaged": f"unreadable ({e.__class__.__name__})"}
            out[name] = attrs
        self.last_listing = dict(sorted(out.items()))
        return dict(self.last_listing)

    def computed_by(self, name: str) -> str | None:
        with self._h5(name) as f:
            got = f.attrs.get("computed_by")
        return None if got is None else str(got.decode() if isinstance(got, bytes) else got)

    # ---- reading -----------------------------------------------------------------------------
    def chunk_table(self, part: PartEntry) -> dict:
        table = self.tables.get(part.name)
        if table is None:
            where = part.chunk_index
            key = f"parts/{part.name}{SUFFIX}"
            if where is None:
                with self._h5(part.name) as f, parsing(f"{self.url}: {key}: {INDEX_DATASET}"):
                    where = [int(v) for v in f.attrs[INDEX_DATASET]]
            with parsing(f"{self.url}: {key}: {INDEX_DATASET}"):
                off, n, crc = (int(v) for v in where)
            if not (0 <= off and 0 <= n <= door.DOCUMENT_BYTES):
                raise CacheFormatError(f"{self.url}: {key}: {INDEX_DATASET} declares {n} bytes at {off}")
            blob = self.cat(key, off, off + n)
            if crc32c(blob) != crc:
                raise CacheFormatError(f"{self.url}: {key}: chunk table checksum mismatch (corrupt bytes)")
            try:
                table = {name: dict(t, chunks=np.asarray(t["chunks"], dtype=np.uint64).reshape(-1, 2),
                                    **({"crc32c": np.asarray(t["crc32c"], dtype=np.uint32)} if "crc32c" in t else {}))
                         for name, t in json.loads(blob).items()}
            except PARSE_ERRORS as e:
                raise CacheFormatError(f"{self.url}: {key}: chunk table unreadable ({e.__class__.__name__})") from None
            self.tables[part.name] = table
        return table

    def layout(self, part: PartEntry, array: str) -> ArrayLayout | None:
        table = self.chunk_table(part)
        if array not in table:
            raise CacheFormatError(f"{self.url}: array {array} is missing from parts/{part.name}{SUFFIX}")
        with parsing(f"{self.url}: parts/{part.name}{SUFFIX}: chunk table: {array}"):
            return self._layout(part, array, table[array])

    def _layout(self, part: PartEntry, array: str, t: dict) -> ArrayLayout | None:
        if not t["filtered"]:
            return None  # a chunk skipped a filter: read through h5py
        dtype, shape = np.dtype(t["dtype"]), tuple(t["shape"])
        chunks = np.asarray(t["chunks"], dtype=np.uint64).reshape(-1, 2)
        return ArrayLayout(key=f"parts/{part.name}{SUFFIX}", dtype=dtype, shape=shape, chunk_rows=t["chunk_rows"],
                           n_chunks=len(chunks), blosc=t["blosc"],
                           row_bytes=dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64)),
                           checksum="fletcher32", table=chunks, crcs=np.asarray(t["crc32c"], dtype=np.uint32) if "crc32c" in t else None,
                           name=f"parts/{part.name}{SUFFIX}: {array}")

    def read_slow(self, part: PartEntry, array: str, start: int, stop: int) -> np.ndarray:
        """Rows through h5py, once the dataset declares the dtype and shape its chunk table does (which
        the reader checked against the manifest) and chunks no larger than its rows or small: h5py
        and HDF5 size what they allocate by the dataset's own header."""
        register_plugins()
        where = f"{self.url}: parts/{part.name}{SUFFIX}: {array}"
        want_dtype, want_shape = self.declared(part, array)
        try:
            with self._h5(part.name) as f, parsing(where):
                if array not in f:
                    raise CacheFormatError(f"{self.url}: array {array} is missing from parts/{part.name}{SUFFIX}")
                d = f[array]
                row_bytes = want_dtype.itemsize * int(np.prod(want_shape[1:], dtype=np.int64))
                chunk_bytes = int(np.prod(d.chunks or d.shape, dtype=np.int64)) * want_dtype.itemsize
                if d.dtype != want_dtype or tuple(d.shape) != want_shape or \
                        chunk_bytes > max(want_shape[0] * row_bytes, SMALL_CHUNK_BYTES):
                    raise CacheFormatError(f"{where}: the dataset declares {d.dtype} {list(d.shape)} in chunks of "
                                           f"{list(d.chunks or [])}; its chunk table {want_dtype} {list(want_shape)}")
                return np.asarray(d[start:stop])
        except (OSError, RuntimeError) as e:  # h5py reports a failed Fletcher-32 as a filter failure
            raise CacheFormatError(f"{where}: rows {start}..{stop}: {e}") from None

    def array_rows(self, part: PartEntry, array: str) -> int:
        return int(self.declared(part, array)[1][0])

    def declared(self, part: PartEntry, array: str) -> tuple[np.dtype, tuple]:
        table = self.chunk_table(part)
        if array not in table:
            raise CacheFormatError(f"{self.url}: array {array} is missing from parts/{part.name}{SUFFIX}")
        with parsing(f"{self.url}: parts/{part.name}{SUFFIX}: chunk table: {array}"):
            shape = tuple(int(v) for v in table[array]["shape"])
            if not shape:
                raise ValueError("shape: empty")
            return np.dtype(table[array]["dtype"]), shape
