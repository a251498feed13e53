"""Where a derived part's arrays come from (docs/cache-format.md §12): `Source`, a store that parts of
the wanted store are taken from, part by part, either linked file for file (local: hardlink, else
reflink, else a copy; S3: a server-side copy created only if absent) when the wanted arrays are
byte-identical files of the source (`links_only`), or read and re-encoded a batch of tokens at a
time. derive.py decides which source a build uses and runs `deepspec cache derive`; the writer
commits what a Source hands it like any computed part.
"""
from __future__ import annotations

import errno
import os
import shutil
import time
from functools import partial

import numpy as np
import torch

from deepspec.cache.spec.format import encode_hidden, hidden_name, part_arrays, part_name, scale_name
from deepspec.cache.write.lease import acquire
from deepspec.cache.write.part_data import PartData
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.storage import door
from deepspec.cache.storage.urls import is_remote, local_path, storage_options_for
from deepspec.cache.storage.fenced import PartConflict, refused_as_existing
from deepspec.cache.write.writer import CacheWriter

FICLONE = 0x40049409  # ioctl: share the source's extents (btrfs, xfs, ...)


def links_only(src: dict, want: dict) -> bool:
    """The wanted arrays are byte-identical files of the source: same encoding of every value, and
    both stores Zarr (an HDF5 part is one file holding every array, so it is re-encoded)."""
    return (all(src.get(k) == want[k] for k in ("dtype", "codec", "chunk_tokens"))
            and src.get("storage", "zarr") == want.get("storage", "zarr") == "zarr")


class Source:
    """A store parts are taken from. `part(name, samples)` is the wanted part when the source has one
    of the same composition (else None); `part_at(k, name)` is the source's k-th part, re-encoded."""

    def __init__(self, url: str, storage_options: dict | None, want: dict, lease: bool = False):
        self.url = url
        self.storage_options = storage_options
        # a local store the run will replace is leased like a writer's, so no other job writes it meanwhile
        self.lease = acquire(url, storage_options) if lease else None
        try:
            self.reader = CacheReader(url, storage_options)
        except BaseException:
            self.release()
            raise
        self.manifest = self.reader.manifest
        self.want = want
        self.link = links_only(self.manifest, want)
        self.remote = is_remote(url)
        self.by_name = {name: k for k, name in enumerate(self.reader.parts)}
        self.parts_derived = 0
        self.seconds = 0.0  # time spent deriving (reading, re-encoding, linking), in both threads
        self.methods: set[str] = set()
        self._fs = None

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def part(self, name: str, samples) -> PartData | None:
        """The planned part `name` from the source, when it holds it. A v3 part's name is a hash of
        its samples' keys and ids in order, so an equal name is an equal composition; the keys are
        compared anyway (a cheap guard against a hash collision or a damaged index)."""
        t0 = time.time()
        try:
            k = self.by_name.get(name)
            if k is None:
                return None
            want = np.array([s.key for s in samples], dtype=np.uint64).reshape(-1, 2)
            if not np.array_equal(self.reader.part_keys(k), want):
                return None
            part = self._assemble(k, name)
            self.parts_derived += 1
            return part
        finally:
            self.seconds += time.time() - t0

    def part_at(self, k: int) -> PartData:
        """The source's k-th part, named by its content (a part of a store written before v3 gets the
        v3 name of what it holds)."""
        t0 = time.time()
        try:
            r = self.reader
            part = self._assemble(k, part_name(r.part_keys(k), r.part_sample_ids(k)))
            self.parts_derived += 1
            return part
        finally:
            self.seconds += time.time() - t0

    def _assemble(self, k: int, name: str) -> PartData:
        r = self.reader
        offsets = r.part_offsets(k)
        tokens = int(offsets[-1])
        part = PartData(name=name, sample_ids=np.asarray(r.part_sample_ids(k), dtype=np.uint64),
                        keys=r.part_keys(k), lengths=np.diff(offsets).astype(np.int64),
                        input_ids=r.read_array(k, "input_ids", 0, tokens),
                        loss_mask=r.read_array(k, "loss_mask", 0, tokens),
                        computed_by=r.store.computed_by(r.parts[k]))  # the source's bits: and their origin
        layers, dtype = self.want["layers"], self.want["dtype"]
        if self.link:
            # a part written before v3 has no sample_key array: the writer writes it (from `keys`)
            arrays = [a for a in part_arrays(layers, dtype) if a != "sample_key" or self.manifest.format_version >= 3]
            part.copied, part.copy = tuple(arrays), partial(self._copy, r.parts[k], arrays)
            return part
        part.batches = self._reencoded(k, tokens, [*layers, "last"], dtype)  # streamed by writer.submit
        return part

    # tokens of a part re-encoded at a time: a re-encode holds this much of a part, not the part
    REENCODE_TOKENS = 65536

    def _reencoded(self, k: int, tokens: int, keys: list, dtype: str):
        r = self.reader
        for a in range(0, max(tokens, 1), self.REENCODE_TOKENS):
            b = min(tokens, a + self.REENCODE_TOKENS)
            t0, out = time.time(), {}
            for layer in keys:
                bits = r.read_array(k, hidden_name(layer), a, b)
                if self.manifest["dtype"] == dtype:  # a codec or chunking change: the values stay as they are
                    scale = r.read_array(k, scale_name(layer), a, b) if dtype != "bfloat16" else None
                    out[layer] = (bits, scale)
                else:  # bfloat16 -> fp8: the same function of the bfloat16 values the stage applies
                    out[layer] = encode_hidden(torch.from_numpy(bits).view(torch.bfloat16), dtype)
            self.seconds += time.time() - t0
            yield out

    # ---- linking (runs on the writer's thread, between the part's creation and its commit) --------
    def _copy(self, src_part: str, arrays: list[str], writer: CacheWriter, group) -> None:
        t0 = time.time()
        keys = []
        for array in arrays:
            keys += [f"{array}/{rel}" for rel in self._files(f"parts/{src_part}/{array}")]
        for parent in sorted({a.rsplit("/", 1)[0] for a in arrays if "/" in a}):
            if self._files(f"parts/{src_part}/{parent}", "zarr.json"):  # zarr's implicit group node
                keys.append(f"{parent}/zarr.json")
        for key in keys:
            self._copy_key(f"parts/{src_part}/{key}", writer, f"{group.path}/{key}")
        self.seconds += time.time() - t0

    def _files(self, prefix: str, only: str | None = None) -> list[str]:
        """Keys under `prefix` (relative to it); with `only`, that one key if it exists."""
        if self.remote:
            fs, root = self._filesystem()
            base = f"{root}/{prefix}"
            if only:
                return [only] if fs.exists(f"{base}/{only}") else []
            return sorted(p[len(base) + 1:] for p in fs.find(base))
        base = local_path(self.url) / prefix
        if only:
            return [only] if (base / only).is_file() else []
        return sorted(str(p.relative_to(base)).replace(os.sep, "/") for p in base.rglob("*") if p.is_file())

    def _filesystem(self):
        if self._fs is None:
            import fsspec

            self._fs = fsspec.core.url_to_fs(self.url, **storage_options_for(self.url, self.storage_options))
        return self._fs

    def _copy_key(self, src_key: str, writer: CacheWriter, dst_key: str) -> None:
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        if not self.remote and not writer.remote:  # the source's file, as the door finds it (never a link out)
            root = str(local_path(self.url))
            os.close(door.open_fd(root, src_key))
            self.methods.add(link_file(door.resolve(root, src_key), local_path(writer.url) / dst_key))
            return
        store = writer.root.store
        if (self.remote and writer.remote and self.url.startswith("s3://") and writer.url.startswith("s3://")
                and storage_options_for(self.url, self.storage_options)
                == storage_options_for(writer.url, writer.storage_options)):
            sync(_s3_copy(store, f"{self._filesystem()[1]}/{src_key}", dst_key))
            self.methods.add("s3-copy")
            return
        fs, root = self._filesystem() if self.remote else (None, None)
        data = fs.cat_file(f"{root}/{src_key}") if self.remote else door.read_file(str(local_path(self.url)), src_key, limit=None)
        sync(store.set(dst_key, default_buffer_prototype().buffer.from_bytes(data)))
        self.methods.add("copy")


async def _s3_copy(store, src_path: str, dst_key: str) -> None:
    """Server-side copy into a part, created only if absent (the writer's create-only rule, §7)."""
    # zarr-python (3.1) opens a store instance only through its private `_open` (the public
    # `Store.open` builds a new instance); its own FsspecStore methods open it this same way
    if not store._is_open:
        await store._open()
    fs = store.fs
    src_bucket, src_name, _ = fs.split_path(src_path)
    dst_path = store.s3_path(dst_key)
    bucket, name, _ = fs.split_path(dst_path)
    try:
        await fs._call_s3("copy_object", Bucket=bucket, Key=name, CopySource={"Bucket": src_bucket, "Key": src_name},
                          IfNoneMatch="*")
    except OSError as e:
        if refused_as_existing(e):
            raise PartConflict(f"{dst_key}: another writer created this object meanwhile; not overwriting it") \
                from None
        raise
    finally:
        fs.invalidate_cache(dst_path)


def link_file(src, dst) -> str:
    """Give `dst` (new) the bytes of `src` without writing to `src`: a hardlink, else a reflink, else
    a copy. Returns which one it was."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)
        return "hardlink"
    except FileExistsError:
        raise PartConflict(f"{dst}: exists; a part is only ever created, never overwritten") from None
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
    import fcntl

    with open(src, "rb") as fin, open(dst, "xb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
            return "reflink"
        except OSError:
            shutil.copyfileobj(fin, fout, 1 << 22)
            return "copy"
