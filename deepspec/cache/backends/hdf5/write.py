"""The write side of the HDF5 backend (docs/cache-format.md §11): `HDF5StoreWriter` commits part
files (written by part.py), index files and the manifest of a store `HDF5Store` (read.py)
reads, checks committed parts for damage and prunes what an interrupted writer leaves."""
from __future__ import annotations

import json
import logging
import os
import tempfile
import uuid

import numpy as np
from crc32c import crc32c

from deepspec.cache.backends.base import ArraySpec, WritableStore, fletcher32_matches
from deepspec.cache.spec.format import FORMAT, INDEX_COLUMNS, PART_NAME, CacheFormatError, index_name
from deepspec.cache.backends.hdf5.h5 import INDEX_DATASET
from deepspec.cache.backends.hdf5.part import write_part_file
from deepspec.cache.backends.hdf5.read import INDEX_DIR, INDEX_FILE, MANIFEST_NAME, SUFFIX, HDF5Store
from deepspec.cache.spec.manifest import Manifest, PartEntry
from deepspec.cache.storage.urls import local_path
from deepspec.cache.storage.durable import durable_replace
from deepspec.cache.storage.fenced import PartConflict, fenced_read, fenced_replace, refused_as_existing
from deepspec.io import fsync_path, remove_path

log = logging.getLogger(__name__)


class HDF5StoreWriter(HDF5Store, WritableStore):
    # ---- index, manifest ---------------------------------------------------------------------
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
                self.fs.put_file(tmp, self.key_path(key))
            else:
                fsync_path(tmp)
                try:
                    os.link(tmp, self.key_path(key))
                except FileExistsError:
                    pass
                fsync_path(str(folder))
                fsync_path(str(folder.parent))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return desc

    def delete_index(self, name: str) -> None:
        self._delete_key(f"{INDEX_DIR}/{name}{SUFFIX}")

    def root_attrs(self) -> dict:
        if not self.url.startswith("s3://"):
            return super().root_attrs()
        from fsspec.asyn import sync

        data, etag = sync(self.fs.loop, fenced_read, self.fs, self.key_path(MANIFEST_NAME))
        if getattr(self, "_root_etag", None) is None:
            self._root_etag = etag  # fenced from here (store.fenced_replace)
        if data is None:
            return {}
        try:
            return json.loads(data)
        except ValueError:
            raise CacheFormatError(f"{self.url}/{MANIFEST_NAME}: not valid JSON") from None

    def write_manifest(self, manifest: Manifest) -> None:
        data = json.dumps(manifest.stored_dict(), indent=1, sort_keys=True).encode()
        if self.url.startswith("s3://"):
            from fsspec.asyn import sync

            if getattr(self, "_root_etag", None) is None:
                self.root_attrs()
            self._root_etag = sync(self.fs.loop, fenced_replace, self.fs, self.key_path(MANIFEST_NAME), data, self._root_etag)
            return
        if self.remote:
            self.fs.pipe_file(self.key_path(MANIFEST_NAME), data)
            return
        root = local_path(self.url)
        root.mkdir(parents=True, exist_ok=True)
        durable_replace(root / MANIFEST_NAME, data)

    # ---- debris, damage ----------------------------------------------------------------------
    def refuse_foreign(self, keep: set[str]) -> None:
        names = self.list_dir("")
        others = [n for n in names if n not in self.layout_entries and n not in keep and not n.endswith(".partial")]
        if MANIFEST_NAME in names:
            try:
                attrs = json.loads(self.cat(MANIFEST_NAME))
            except ValueError:
                attrs = {}
            if isinstance(attrs, dict) and attrs.get("format") == FORMAT:
                return
        elif not others and "parts" not in names:
            return
        elif not others and all(n.endswith(SUFFIX) or n.endswith(".partial") for n in self.list_dir("parts")):
            return  # a store whose first manifest write was interrupted
        raise CacheFormatError(f"{self.url}: exists and is not a deepspec cache ({', '.join(names[:5])}); "
                               "refusing to write into it")

    def _delete_key(self, key: str) -> None:
        if self.remote:
            try:
                self.fs.rm(self.key_path(key), recursive=True)
            except FileNotFoundError:
                pass
            return
        remove_path(local_path(self.url) / key)

    def prune_debris(self, keep: set[str]) -> None:
        for name in self.list_dir(""):
            if name not in self.layout_entries and name not in keep:
                log.info("%s: deleting %s (not part of a cache; left by an interrupted writer)", self.url, name)
                self._delete_key(name)
        for name in self.list_dir("parts"):
            if not (name.endswith(SUFFIX) and PART_NAME.fullmatch(name[:-len(SUFFIX)])):
                log.info("%s: deleting parts/%s (a temporary file of an interrupted writer)", self.url, name)
                self._delete_key(f"parts/{name}")
        for name in self.list_dir(INDEX_DIR):
            if not name.endswith(SUFFIX):
                self._delete_key(f"{INDEX_DIR}/{name}")

    def part_damage(self, name: str, arrays: list[str]) -> str | None:
        """Cheap: the file opens, its chunk table's crc32c holds, every array listed is in it, every
        chunk lies inside the file, and the last chunk of every array passes its Fletcher-32."""
        key = f"parts/{name}{SUFFIX}"
        # the writer checks every part in turn right after listing them: one listing, not one per part
        listed = getattr(self, "last_listing", None)
        marks = (listed if listed is not None and name in listed else self.committed_parts()).get(name) or {}
        if "damaged" in marks:
            return f"{key}: {marks['damaged']}"
        try:
            table = self.chunk_table(PartEntry.of(name, 0, 0, marks.get(INDEX_DATASET)))
            size = os.path.getsize(self.key_path(key))
            for array in arrays:
                if array not in table:
                    return f"{key}: array {array} missing"
                chunks = np.asarray(table[array]["chunks"], dtype=np.int64).reshape(-1, 2)
                if len(chunks) == 0 or int((chunks[:, 0] + chunks[:, 1]).max()) > size:
                    return f"{key}: {array}: chunks lie outside the file ({size} bytes)"
                off, n = (int(v) for v in chunks[-1])
                raw = self.cat(key, off, off + n)
                if not fletcher32_matches(raw[:-4], raw[-4:]):
                    return f"{key}: {array}: last chunk fails its checksum"
        except (CacheFormatError, OSError, ValueError, KeyError) as e:
            return f"{key}: {e}"
        return None

    def delete_part(self, name: str) -> None:
        self._delete_key(f"parts/{name}{SUFFIX}")
        self.tables.clear()  # (the bounded cache has no pop: a deleted part is rare)
        self.last_listing = None

    def delete_all(self) -> None:
        self._delete_key("parts")
        self._delete_key(INDEX_FILE)
        self._delete_key(INDEX_DIR)
        self._delete_key(MANIFEST_NAME)
        self.tables.clear()

    # ---- writing -----------------------------------------------------------------------------
    def write_part(self, name: str, arrays: list[ArraySpec], attrs: dict, rank: int, lease,
                   before=None, feed=None) -> PartEntry:
        return self.write_part_deferred(name, arrays, attrs, rank, lease, before=before, feed=feed)()

    def write_part_deferred(self, name: str, arrays: list[ArraySpec], attrs: dict, rank: int, lease,
                            before=None, feed=None):
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

        def discard() -> None:
            if os.path.exists(tmp):
                os.unlink(tmp)

        # the rows a Zarr commit record carries are the part file's own offsets/sample_id here
        attrs = {k: v for k, v in attrs.items() if k not in ("lengths", "sample_ids", "keys")}
        try:
            where = write_part_file(tmp, arrays, attrs, feed)
        except BaseException:
            discard()
            raise

        def commit() -> PartEntry:
            try:
                if self.remote:
                    lease.check()  # never commit over the parts of a job that took the store over
                    try:  # If-None-Match: * (on CompleteMultipartUpload for a large file)
                        self.fs.put_file(tmp, self.key_path(key), mode="create")
                    except OSError as e:
                        if refused_as_existing(e):
                            raise PartConflict(f"{self.url}: {key}: another writer created this part meanwhile; "
                                               "not overwriting it") from None
                        raise
                    finally:
                        self.fs.invalidate_cache(self.key_path("parts"))
                else:
                    fsync_path(tmp)
                    lease.check()
                    try:
                        os.link(tmp, self.key_path(key))  # create-only and atomic: the commit
                    except FileExistsError:
                        raise PartConflict(f"{self.url}: {key} already exists; a committed part is never "
                                           "rewritten") from None
                    for p in (str(parts), str(parts.parent)):
                        fsync_path(p)
            finally:
                discard()
            return PartEntry.of(name, attrs["samples"], attrs["tokens"], where)

        commit.discard = discard  # a commit the writer skips (an earlier one failed) leaves no file behind
        return commit
