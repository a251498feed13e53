"""The HDF5 backend (docs/cache-format.md §11): `manifest.json` + one `parts/<part>.h5` file per part.

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
import logging
import os
import tempfile
import uuid

import numpy as np
from crc32c import crc32c

from deepspec.cache.backend import PART_NAME, ArrayLayout, ArraySpec, CacheStore, fletcher32_matches
from deepspec.cache.format import FORMAT, INDEX_COLUMNS, CacheFormatError, index_name
from deepspec.cache.hdf5_part import INDEX_DATASET, no_cyclic_gc, register_plugins, write_part_file
from deepspec.cache.manifest import Manifest, PartEntry
from deepspec.cache.store import (PartConflict, durable_replace, fsync_path, local_path, refused_as_existing,
                                  storage_options_for)

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
SUFFIX = ".h5"
# the consolidated per-sample index (§3.1): v3, files `index/<name>.h5` (dataset "index", uint64
# [samples, 6], named by their content, never overwritten); v2, the one file `index.h5` ([samples, 4])
INDEX_DIR = "index"
INDEX_FILE = "index.h5"


class HDF5Store(CacheStore):
    kind = "hdf5"
    layout_entries = frozenset({MANIFEST_NAME, "parts", INDEX_DIR, INDEX_FILE})

    def __init__(self, url: str, storage_options: dict | None = None, writable: bool = False):
        super().__init__(url, storage_options, writable)
        self._fs = None
        self._tables: dict[str, dict] = {}

    def __getstate__(self):
        return dict(self.__dict__, _fs=None, _tables={}, _last_listing=None)

    # ---- bytes -------------------------------------------------------------------------------
    @property
    def fs(self):
        if self._fs is None:
            import fsspec

            self._fs, self._root = fsspec.core.url_to_fs(self.url, **storage_options_for(self.url, self.storage_options))
        return self._fs

    def _path(self, key: str) -> str:
        if self.remote:
            _ = self.fs
            return f"{self._root.rstrip('/')}/{key}"
        return str(local_path(self.url) / key)

    def _cat(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if self.remote:
            return self.fs.cat_file(self._path(key), start=start, end=end)
        with open(self._path(key), "rb") as f:
            if start is None:
                return f.read()
            f.seek(start)
            data = f.read(end - start)
        if len(data) != end - start:
            raise CacheFormatError(f"{key}: short read ({len(data)} of {end - start} bytes at {start})")
        return data

    def _list(self, prefix: str) -> list[str]:
        if self.remote:
            path = self._path(prefix).rstrip("/")
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

        if not self.remote:
            with h5py.File(self._path(f"parts/{name}{SUFFIX}"), "r") as f:
                yield f
            return
        # h5py reads the S3 object through the fsspec file while holding its global lock: no cyclic
        # collection meanwhile (hdf5_part.no_cyclic_gc); the HDF5 file is closed before the file object
        with no_cyclic_gc(), self.fs.open(self._path(f"parts/{name}{SUFFIX}"), "rb") as raw, \
                h5py.File(raw, "r") as f:
            yield f

    # ---- manifest ----------------------------------------------------------------------------
    def root_attrs(self) -> dict:
        try:
            raw = self._cat(MANIFEST_NAME)
        except FileNotFoundError:
            if not self.writable:
                raise CacheFormatError(f"{self.url}: not a cache store (no {MANIFEST_NAME})") from None
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise CacheFormatError(f"{self.url}/{MANIFEST_NAME}: not valid JSON") from None

    def read_range(self, key: str, start: int, end: int) -> bytes:
        return self._cat(key, start, end)

    def write_index(self, rows: np.ndarray) -> dict:
        """`index/<name>.h5`: one contiguous, unfiltered dataset `index`; the manifest records its byte
        range and crc32c, so a reader fetches it with one ranged read (h5py reads it too). `<name>` is
        a hash of the rows, and a file is never replaced: temp file, fsync, create-only link."""
        import h5py

        rows = np.ascontiguousarray(rows, dtype="<u8").reshape(-1, len(INDEX_COLUMNS))
        name = index_name(rows)
        key = self.index_key(name)
        if self.remote:
            fd, tmp = tempfile.mkstemp(suffix=SUFFIX, prefix="deepspec-index-")
            os.close(fd)
        else:
            folder = local_path(self.url) / INDEX_DIR
            folder.mkdir(parents=True, exist_ok=True)
            tmp = str(folder / f"{name}{SUFFIX}.{uuid.uuid4().hex}.partial")
        try:
            with h5py.File(tmp, "w", libver=("v110", "v110")) as f:
                d = f.create_dataset("index", data=rows, track_times=False)
                f.attrs["columns"] = list(INDEX_COLUMNS)
                f.flush()
                offset = int(d.id.get_offset() or 0)
            desc = {"key": key, "offset": offset, "nbytes": int(rows.nbytes), "crc32c": crc32c(rows.tobytes()),
                    "samples": len(rows), "columns": list(INDEX_COLUMNS)}
            if name in self.index_keys():
                return desc  # the same rows, written by h5py with the same settings: the same bytes
            if self.remote:
                self.fs.put_file(tmp, self._path(key))
            else:
                fsync_path(tmp)
                try:
                    os.link(tmp, self._path(key))
                except FileExistsError:
                    pass
                fsync_path(str(folder))
                fsync_path(str(folder.parent))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return desc

    def index_keys(self) -> list[str]:
        return [n[:-len(SUFFIX)] for n in self._list(INDEX_DIR) if n.endswith(SUFFIX)]

    def index_key(self, name: str) -> str:
        return f"{INDEX_DIR}/{name}{SUFFIX}"

    def delete_index(self, name: str) -> None:
        self._delete_key(f"{INDEX_DIR}/{name}{SUFFIX}")

    def write_manifest(self, manifest: Manifest) -> None:
        data = json.dumps(manifest.stored_dict(), indent=1, sort_keys=True).encode()
        if self.remote:
            self.fs.pipe_file(self._path(MANIFEST_NAME), data)
            return
        root = local_path(self.url)
        root.mkdir(parents=True, exist_ok=True)
        durable_replace(root / MANIFEST_NAME, data)

    # ---- listing, debris, damage -------------------------------------------------------------
    def refuse_foreign(self, keep: set[str]) -> None:
        names = self._list("")
        others = [n for n in names if n not in self.layout_entries and n not in keep and not n.endswith(".partial")]
        if MANIFEST_NAME in names:
            try:
                attrs = json.loads(self._cat(MANIFEST_NAME))
            except ValueError:
                attrs = {}
            if isinstance(attrs, dict) and attrs.get("format") == FORMAT:
                return
        elif not others and "parts" not in names:
            return
        elif not others and all(n.endswith(SUFFIX) or n.endswith(".partial") for n in self._list("parts")):
            return  # a store whose first manifest write was interrupted
        raise CacheFormatError(f"{self.url}: exists and is not a deepspec cache ({', '.join(names[:5])}); "
                               "refusing to write into it")

    def _delete_key(self, key: str) -> None:
        if self.remote:
            try:
                self.fs.rm(self._path(key), recursive=True)
            except FileNotFoundError:
                pass
            return
        import shutil

        p = local_path(self.url) / key
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)

    def prune_debris(self, keep: set[str]) -> None:
        for name in self._list(""):
            if name not in self.layout_entries and name not in keep:
                log.info("%s: deleting %s (not part of a cache; left by an interrupted writer)", self.url, name)
                self._delete_key(name)
        for name in self._list("parts"):
            if not (name.endswith(SUFFIX) and PART_NAME.fullmatch(name[:-len(SUFFIX)])):
                log.info("%s: deleting parts/%s (a temporary file of an interrupted writer)", self.url, name)
                self._delete_key(f"parts/{name}")
        for name in self._list(INDEX_DIR):
            if not name.endswith(SUFFIX):
                self._delete_key(f"{INDEX_DIR}/{name}")

    def committed_parts(self) -> dict[str, dict]:
        out = {}
        for entry in self._list("parts"):
            if not (entry.endswith(SUFFIX) and PART_NAME.fullmatch(entry[:-len(SUFFIX)])):
                continue
            name = entry[:-len(SUFFIX)]
            try:
                with self._h5(name) as f:
                    attrs = {k: (v.item() if hasattr(v, "item") and np.ndim(v) == 0 else v) for k, v in f.attrs.items()}
                    # what the consolidated index needs, read while the file is open anyway
                    lengths = np.diff(np.asarray(f["offsets"][:], dtype=np.int64))
                    ids = np.asarray(f["sample_id"][:], dtype=np.uint64)
                    keys = np.asarray(f["sample_key"][:], dtype=np.uint64) if "sample_key" in f else None
                attrs[INDEX_DATASET] = [int(v) for v in attrs[INDEX_DATASET]]
                attrs = {k: (int(v) if isinstance(v, (np.integer, bool, np.bool_)) else v) for k, v in attrs.items()}
                attrs["lengths"], attrs["sample_ids"] = lengths, ids
                if keys is not None:
                    attrs["keys"] = keys
            except (OSError, KeyError, ValueError) as e:
                # the name exists only after a commit: an unreadable file is a damaged committed part
                attrs = {"committed": True, "samples": 0, "tokens": 0, "damaged": f"unreadable ({e.__class__.__name__})"}
            out[name] = attrs
        self._last_listing = dict(sorted(out.items()))
        return dict(self._last_listing)

    def part_damage(self, name: str, arrays: list[str]) -> str | None:
        """Cheap: the file opens, its chunk table's crc32c holds, every array listed is in it, every
        chunk lies inside the file, and the last chunk of every array passes its Fletcher-32."""
        key = f"parts/{name}{SUFFIX}"
        # the writer checks every part in turn right after listing them: one listing, not one per part
        listed = getattr(self, "_last_listing", None)
        marks = (listed if listed is not None and name in listed else self.committed_parts()).get(name) or {}
        if "damaged" in marks:
            return f"{key}: {marks['damaged']}"
        try:
            table = self._table(PartEntry(name, 0, 0, marks.get(INDEX_DATASET)))
            size = os.path.getsize(self._path(key))
            for array in arrays:
                if array not in table:
                    return f"{key}: array {array} missing"
                chunks = np.asarray(table[array]["chunks"], dtype=np.int64).reshape(-1, 2)
                if len(chunks) == 0 or int((chunks[:, 0] + chunks[:, 1]).max()) > size:
                    return f"{key}: {array}: chunks lie outside the file ({size} bytes)"
                off, n = (int(v) for v in chunks[-1])
                raw = self._cat(key, off, off + n)
                if not fletcher32_matches(raw[:-4], raw[-4:]):
                    return f"{key}: {array}: last chunk fails its checksum"
        except (CacheFormatError, OSError, ValueError, KeyError) as e:
            return f"{key}: {e}"
        return None

    def delete_part(self, name: str) -> None:
        self._delete_key(f"parts/{name}{SUFFIX}")
        self._tables.pop(name, None)
        self._last_listing = None

    def delete_all(self) -> None:
        self._delete_key("parts")
        self._delete_key(INDEX_FILE)
        self._delete_key(INDEX_DIR)
        self._delete_key(MANIFEST_NAME)
        self._tables.clear()

    # ---- writing -----------------------------------------------------------------------------
    def write_part(self, name: str, arrays: list[ArraySpec], attrs: dict, rank: int, lease,
                   before=None, feed=None) -> PartEntry:
        if before is not None:  # one file per part: a derive re-encodes instead (derive_source.links_only)
            raise CacheFormatError(f"{self.url}: an HDF5 part cannot take arrays linked from another store")
        key = f"parts/{name}{SUFFIX}"
        if self.remote:  # h5py writes a local file; the part is uploaded whole
            fd, tmp = tempfile.mkstemp(suffix=SUFFIX, prefix=f"deepspec-{name}-")
            os.close(fd)
        else:
            parts = local_path(self.url) / "parts"
            parts.mkdir(parents=True, exist_ok=True)
            if (parts / f"{name}{SUFFIX}").exists():
                raise PartConflict(f"{self.url}: {key} already exists; a committed part is never rewritten")
            tmp = str(parts / f"{name}{SUFFIX}.{uuid.uuid4().hex}.partial")
        # the rows a Zarr commit record carries are the part file's own offsets/sample_id here
        attrs = {k: v for k, v in attrs.items() if k not in ("lengths", "sample_ids", "keys")}
        try:
            where = write_part_file(tmp, arrays, attrs, feed)
            if self.remote:
                lease.check()  # never commit over the parts of a job that took the store over
                try:  # If-None-Match: * (on CompleteMultipartUpload for a large file)
                    self.fs.put_file(tmp, self._path(key), mode="create")
                except OSError as e:
                    if refused_as_existing(e):
                        raise PartConflict(f"{self.url}: {key}: another writer created this part meanwhile; "
                                           "not overwriting it") from None
                    raise
                finally:
                    self.fs.invalidate_cache(self._path("parts"))
            else:
                fsync_path(tmp)
                lease.check()
                try:
                    os.link(tmp, self._path(key))  # create-only and atomic: the commit
                except FileExistsError:
                    raise PartConflict(f"{self.url}: {key} already exists; a committed part is never "
                                       "rewritten") from None
                for p in (str(parts), str(parts.parent)):
                    fsync_path(p)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return PartEntry(name, attrs["samples"], attrs["tokens"], where)

    # ---- reading -----------------------------------------------------------------------------
    def _table(self, part: PartEntry) -> dict:
        table = self._tables.get(part.name)
        if table is None:
            where = part.chunk_index
            if where is None:
                with self._h5(part.name) as f:
                    where = [int(v) for v in f.attrs[INDEX_DATASET]]
            off, n, crc = (int(v) for v in where)
            key = f"parts/{part.name}{SUFFIX}"
            blob = self._cat(key, off, off + n)
            if crc32c(blob) != crc:
                raise CacheFormatError(f"{self.url}: {key}: chunk table checksum mismatch (corrupt bytes)")
            table = self._tables[part.name] = json.loads(blob)
        return table

    def layout(self, part: PartEntry, array: str) -> ArrayLayout | None:
        table = self._table(part)
        if array not in table:
            raise CacheFormatError(f"{self.url}: array {array} is missing from parts/{part.name}{SUFFIX}")
        t = table[array]
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
        register_plugins()
        try:
            with self._h5(part.name) as f:
                if array not in f:
                    raise CacheFormatError(f"{self.url}: array {array} is missing from parts/{part.name}{SUFFIX}")
                return np.asarray(f[array][start:stop])
        except OSError as e:  # h5py reports a failed Fletcher-32 as a filter failure
            raise CacheFormatError(f"{self.url}: parts/{part.name}{SUFFIX}: {array}: rows {start}..{stop}: {e}") from None

    def array_rows(self, part: PartEntry, array: str) -> int:
        return int(self._table(part)[array]["shape"][0])
