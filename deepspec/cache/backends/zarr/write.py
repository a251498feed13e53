"""The write side of the Zarr v3 backend (docs/cache-format.md §2–§7): `ZarrStoreWriter` creates
parts, index arrays and the root manifest of a store `ZarrStore` (read.py) reads, encoding
every shard itself (shard.py), and prunes what an interrupted writer leaves."""
from __future__ import annotations

import functools
import json
import logging
import os
from concurrent.futures import wait
from types import MappingProxyType

import numpy as np
import zarr
from crc32c import crc32c

from deepspec.cache.backends.base import ArraySpec, WritableStore
from deepspec.cache.spec.format import (CHUNK_CRC32C, FORMAT, INDEX_COLUMNS, CacheFormatError, crc_table, index_name,
                                       inner_codecs)
from deepspec.cache.spec.manifest import Manifest, PartEntry
from deepspec.cache.storage.urls import local_path, storage_options_for
from deepspec.cache.storage.durable import FlushAhead, durable_replace, fsync_tree
from deepspec.cache.storage.pools import thread_pool
from deepspec.cache.storage.fenced import PartConflict, open_store, refused_as_existing
from deepspec.io import fsync_path, remove_path
from deepspec.cache.backends.zarr.documents import (chunking, create_array_files, create_group_files,
                                                   group_document)
from deepspec.cache.backends.zarr.layout import part_damage
from deepspec.cache.backends.zarr.shard import ShardAppender, encode_shard
from deepspec.cache.backends.zarr.read import INDEX_ARRAY, ZarrStore

log = logging.getLogger(__name__)

# a part group's attributes until its commit record replaces them; read-only, as zarr-python
# updates a group's attributes in the dict it was created with
UNCOMMITTED = MappingProxyType({"committed": False})


class ZarrStoreWriter(ZarrStore, WritableStore):
    def __init__(self, url: str, storage_options: dict | None = None):
        super().__init__(url, storage_options)
        self._wfs = self._wroot = None  # S3: the filesystem streamed shards are uploaded with

    def open_group(self) -> zarr.Group:
        store = open_store(self.url, "a", self.storage_options)
        return zarr.open_group(store=store, mode="a", zarr_format=3)

    def __getstate__(self):
        return dict(super().__getstate__(), _wfs=None)

    @functools.cached_property
    def _local_root(self) -> str:
        """A local store's directory, as the path string the part writer joins its keys to."""
        return os.fspath(local_path(self.url))

    # ---- manifest ----------------------------------------------------------------------------
    def write_manifest(self, manifest: Manifest) -> None:
        self.root.attrs.put(manifest.stored_dict())

    def write_index(self, rows: np.ndarray) -> dict:
        """The index is an ordinary single-shard array `index/<name>` whose only chunk is the whole
        array, so its rows are bytes [0, 48 n) of `index/<name>/c/0/0`. `<name>` is a hash of the
        rows: the same rows land in the same array, which is then written no more."""
        rows = np.ascontiguousarray(rows, dtype="<u8").reshape(-1, len(INDEX_COLUMNS))
        name = index_name(rows)
        key = self.index_key(name)
        desc = {"key": key, "offset": 0, "nbytes": int(rows.nbytes), "crc32c": crc32c(rows.tobytes()),
                "samples": len(rows), "columns": list(INDEX_COLUMNS)}
        if name in self.index_keys():
            try:
                self.read_index(desc)
                return desc
            except CacheFormatError:
                self.delete_index(name)  # a torn earlier write of these rows: write it again
        group = self.root.require_group(INDEX_ARRAY)
        key, chunk_rows = self._create(group, ArraySpec(name, rows, max(len(rows), 1)))
        self._put(key, encode_shard(rows, chunk_rows, "none"))
        if not self.remote:
            path = local_path(self.url)
            fsync_tree(path / INDEX_ARRAY / name)
            fsync_path(path / INDEX_ARRAY)
            fsync_path(path)
        return desc

    def delete_index(self, name: str) -> None:
        self._delete(f"{INDEX_ARRAY}/{name}")

    # ---- debris, damage ----------------------------------------------------------------------
    def refuse_foreign(self, keep: set[str]) -> None:
        """Before zarr-python creates anything: a location that holds anything but a deepspec cache
        (or what a writer of one leaves) is refused, so that pruning debris never deletes a user's files."""
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        store = open_store(self.url, "a", self.storage_options)
        names = self.list_dir("", store)
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
        for name in self.list_dir(""):
            if name not in self.layout_entries and name not in keep:
                log.info("%s: deleting %s (not part of a cache; left by an interrupted writer)", self.url, name)
                self._delete(name)
        if not self.remote:  # a torn index write (an S3 object appears whole or not at all)
            for name in self.index_keys():
                if not (local_path(self.url) / INDEX_ARRAY / name / "c" / "0" / "0").exists():
                    log.info("%s: deleting index/%s (an interrupted index write)", self.url, name)
                    self.delete_index(name)
        for name, mark in self.part_marks(committed_only=False).items():
            if mark is None or not mark.get("committed"):
                log.info("%s: pruning uncommitted part %s (left by an interrupted run)", self.url, name)
                self._delete(f"parts/{name}")

    def part_damage(self, name: str, arrays: list[str]) -> str | None:
        return part_damage(str(local_path(self.url)), name, arrays)

    def _delete(self, path: str) -> None:
        from zarr.core.sync import sync

        if self.remote:
            sync(self.root.store.delete_dir(path))
            sync(self.root.store.delete(path))  # a plain object of that name
            return
        remove_path(local_path(self.url) / path)

    def delete_part(self, name: str) -> None:
        self._delete(f"parts/{name}")

    def delete_all(self) -> None:
        self._delete("parts")
        self._delete(INDEX_ARRAY)
        self._delete("zarr.json")
        self.__dict__.pop("root", None)  # reopened on next use

    # ---- writing -----------------------------------------------------------------------------
    def _create_part_group(self, name: str) -> zarr.Group:
        """The new part's group, uncommitted. On a local store its files are written here
        (documents.py) and the group is opened without reading them back."""
        if self.remote:
            return self.root.create_group(f"parts/{name}", attributes=dict(UNCOMMITTED))
        from zarr.core.group import GroupMetadata
        from zarr.storage import StorePath

        create_group_files(self._local_root, f"parts/{name}", dict(UNCOMMITTED))
        return zarr.Group(zarr.AsyncGroup(metadata=GroupMetadata(attributes=dict(UNCOMMITTED), zarr_format=3),
                                          store_path=StorePath(self.root.store, f"parts/{name}")))

    def _create(self, group: zarr.Group, spec: ArraySpec) -> tuple[str, int]:
        """The array's metadata (`zarr.json`); returns the key of its one shard and the rows of an
        inner chunk. The shard itself is encoded here (ShardAppender): zarr-python's own shard
        writer pays Python overhead per inner chunk (~6x slower than a raw write for narrow rows)
        and cannot write v4's crc32c table; without the table the bytes are identical
        (tests/cache/test_writer.py compares them). On a local store the metadata document is
        written here too (array_document, byte for byte what zarr-python's create_array writes,
        tested): create_array's round trips through its event loop cost more than a narrow part's
        data (benchmarks/cache_write.py --parts)."""
        chunks, shards = chunking(spec)
        prefix = f"{group.path}/{spec.name}/".lstrip("/")
        key = prefix + "c/" + "/".join("0" for _ in spec.shape)
        if not self.remote:
            create_array_files(os.path.join(self._local_root, group.path), spec)
            return key, chunks[0]
        codecs = inner_codecs(spec.codec, np.dtype(spec.dtype).itemsize)
        group.create_array(spec.name, shape=tuple(spec.shape), dtype=np.dtype(spec.dtype), chunks=chunks, shards=shards,
                           serializer=codecs[0], compressors=codecs[1:], fill_value=0,
                           config={"write_empty_chunks": True},
                           attributes={CHUNK_CRC32C: "table"} if crc_table(spec.codec) else None)
        return key, chunks[0]

    def _put(self, key: str, blob: bytes) -> None:
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        sync(self.root.store.set(key, default_buffer_prototype().buffer.from_bytes(blob)))

    def _put_new(self, key: str, blob: bytes) -> None:
        """A new object of an uncommitted part: on a local store a plain exclusive write (fsynced
        with its part), without a round trip through zarr-python's event loop."""
        if self.remote:
            self._put(key, blob)
            return
        path = os.path.join(self._local_root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "xb") as f:
            f.write(blob)

    # bytes an S3 shard stream buffers before it uploads them as one part of its multipart upload
    UPLOAD_BLOCK = 64 << 20

    def open_shard(self, key: str):
        """Where a streamed shard's bytes go: its file, created, on a local store; on S3 a create-only
        multipart upload (`If-None-Match: *` on its completion) that sends each UPLOAD_BLOCK as it
        fills; elsewhere a local spool file, PUT when the shard is finished (finish_shard)."""
        import tempfile

        if not self.remote:
            path = os.path.join(self._local_root, key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return open(path, "xb")
        if self.url.startswith("s3://"):
            import fsspec

            if self._wfs is None:
                self._wfs, self._wroot = fsspec.core.url_to_fs(self.url, **storage_options_for(self.url, self.storage_options))
            return self._wfs.open(f"{self._wroot.rstrip('/')}/{key}", "xb", block_size=self.UPLOAD_BLOCK)
        return tempfile.NamedTemporaryFile(prefix="deepspec-shard-")

    def finish_shard(self, key: str, sink) -> None:
        """Make a finished shard durable/visible (a local file is fsynced with its part)."""
        if not self.remote:
            sink.close()
        elif self.url.startswith("s3://"):
            try:
                sink.close()  # completes the upload
            except OSError as e:
                if refused_as_existing(e):
                    raise PartConflict(f"{self.url}: {key}: another writer created this object meanwhile; "
                                       "not overwriting it (was this writer's lease taken over?)") from None
                raise
            finally:
                self._wfs.invalidate_cache()
        else:
            sink.flush()
            sink.seek(0)
            self._put(key, sink.read())
            sink.close()

    @staticmethod
    def drop_shard(sink) -> None:
        """A shard left unfinished: an S3 upload is aborted (nothing becomes visible), a file closed."""
        if getattr(sink, "closed", True):
            return
        if hasattr(sink, "discard"):
            sink.discard()
            # discard() leaves the file open, and closing it (its __del__ does) would upload the
            # buffer discard() dropped: an error raised wherever the collector happens to run
            sink.closed = True
        else:
            sink.close()

    def _append_all(self, feed, streamed: list, flush: FlushAhead) -> None:
        """Every batch of `feed` appended to the shards of `streamed`; with `write_threads` > 1 a
        batch's arrays are appended on that many threads at once (each shard is its own file, and
        its checksums and writes release the GIL), a batch finishing before the next one starts."""
        def append(item, rows) -> None:
            spec, _, sink, shard = item
            shard.append(rows[spec.name])
            if not self.remote:
                flush.wrote(sink, shard.nbytes)

        threads = min(self.write_threads, len(streamed))
        if threads <= 1:
            for rows in feed:
                for item in streamed:
                    append(item, rows)
            return
        pool = thread_pool("shard-append", threads)
        for rows in feed:
            running = [pool.submit(append, item, rows) for item in streamed]
            wait(running)  # all of them, before a failure closes the shards under the others
            for done in running:
                done.result()

    def write_part(self, name: str, arrays: list[ArraySpec], attrs: dict, rank: int, lease,
                   before=None, feed=None) -> PartEntry:
        return self.write_part_deferred(name, arrays, attrs, rank, lease, before=before, feed=feed)()

    def write_part_deferred(self, name: str, arrays: list[ArraySpec], attrs: dict, rank: int, lease,
                            before=None, feed=None):
        # a part is only ever created (on S3 by conditional PUTs, store.FencedS3Store): a name that
        # exists is an error, never an overwrite
        try:
            group = self._create_part_group(name)
        except (zarr.errors.ContainsGroupError, zarr.errors.ContainsArrayError, FileExistsError):
            raise PartConflict(f"{self.url}: parts/{name} already exists; a committed part is never "
                               "rewritten") from None
        if before is not None:  # a derive links the arrays it keeps from its source into the new part
            before(group)
        streamed = []
        flush = FlushAhead()
        try:
            for spec in arrays:
                key, chunk_rows = self._create(group, spec)
                if spec.data is not None:
                    self._put_new(key, encode_shard(spec.data, chunk_rows, spec.codec))
                    continue
                sink = self.open_shard(key)
                streamed.append((spec, key, sink, ShardAppender(sink, spec.shape[0], spec.shape[1:], spec.dtype,
                                                                chunk_rows, spec.codec, f"parts/{name}/{spec.name}")))
            if streamed:
                # the part's streamed arrays take their rows batch by batch: what is held is a batch
                # (and less than a chunk of each array), not the part
                self._append_all(feed, streamed, flush)
                for spec, key, sink, shard in streamed:
                    shard.finish()
                    flush.done(sink)
                    self.finish_shard(key, sink)
        finally:
            for _, _, sink, _ in streamed:
                try:
                    flush.done(sink)
                except OSError:
                    pass  # the part fails already; its descriptor must still outlive the flush
                self.drop_shard(sink)

        def commit() -> PartEntry:
            if not self.remote:  # an S3 PUT is durable when it returns; a local file only once fsynced
                path = local_path(self.url)
                fsync_tree(path / "parts" / name)
                for p in (path / "parts" / "zarr.json", path / "parts", path):
                    fsync_path(p)
            lease.check()  # never commit over the parts of a job that took the store over
            # the commit record: O(samples of this part) bytes, nothing at the root
            if self.remote:
                group.attrs.put(attrs)
            else:  # what the attrs.put writes (DurableLocalStore: a crash-atomic replacement)
                durable_replace(path / "parts" / name / "zarr.json", group_document({**UNCOMMITTED, **attrs}))
            return PartEntry.of(name, attrs["samples"], attrs["tokens"])

        return commit
