"""The stores a case starts from and the copy it mutates: the pristine stores (built once per backend
and variant with the conformance suite's writer, every file, JSON document and shard of them kept, and
the samples they read as), how two samples are compared (`differs`), and a case's copy of its store
(`LocalPlace`: a fresh directory per case; `S3Place`: one copy per pristine store on S3, every key a case
touched put back when it ends) with the byte-level operations mutations use, which raise `Skip` on a
file an earlier mutation made something else than a regular file."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import stat
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

BACKENDS = ("zarr-local", "hdf5-local", "zarr-s3", "hdf5-s3")
VARIANTS = {"bf16": {"dtype": "bfloat16", "codec": "none"}, "fp8-zstd": {"dtype": "fp8", "codec": "blosc-zstd"}}
ROOT_DOC = {"zarr": "zarr.json", "hdf5": "manifest.json"}
TABLE = "#chunk_index"  # suffix of an HDF5 part file's chunk table as a JSON document of its own
REWRITE_LIMIT = 8 << 20      # a later mutation of the same case skips a file an earlier one made oversized


# ---- pristine stores ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Pristine:
    """One store as the writer made it, with what every case of it compares against."""
    backend: str                      # "zarr-local", ...
    variant: str                      # a VARIANTS key
    kind: str                         # "zarr" | "hdf5"
    url: str                          # local directory or s3://bucket/prefix
    options: dict | None
    files: dict[str, bytes]           # every file (object) of the store -> its bytes
    dirs: tuple[str, ...]             # local stores: every directory under the root ("" excluded)
    docs: dict[str, Any]              # JSON documents by key (an HDF5 part's chunk table: "<file>#chunk_index")
    shards: dict[str, tuple[int, bool]]  # Zarr shard key -> (chunks in it, crc32c table: v4 uncompressed)
    samples: list[dict]               # CacheReader.read(k) of every sample
    ids: list[int]                    # CacheReader.sample_id(k)

    @property
    def remote(self) -> bool:
        return self.url.startswith("s3://")

    def __repr__(self) -> str:
        return f"<pristine {self.backend}/{self.variant}>"

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis prints dataclasses field by field otherwise
        printer.text(repr(self))

    @property
    def root_doc(self) -> str:
        return ROOT_DOC[self.kind]


def make_parts(dtype: str, remote: bool) -> list:
    """Two parts: 3 + 2 samples locally, 2 + 1 on S3 (every array of every sample is a request there)."""
    from tests.cache.test_conformance import make_part

    return [make_part("p000000", 1, dtype, samples=2 if remote else 3),
            make_part("p000001", 2, dtype, samples=1 if remote else 2)]


def build_pristine(backend: str, variant: str, url: str, options: dict | None) -> Pristine:
    """Write the store at `url` with the conformance suite's writer and parts, and read it back."""
    from tests.cache.test_conformance import write

    kind = backend.split("-")[0]
    write((kind, url, options), make_parts(VARIANTS[variant]["dtype"], url.startswith("s3://")), **VARIANTS[variant])
    files = read_all(url, options)
    dirs: tuple[str, ...] = ()
    if not url.startswith("s3://"):
        dirs = tuple(sorted(os.path.relpath(d, url) for d, _, _ in os.walk(url) if d != url))
    docs = {k: json.loads(v) for k, v in files.items() if k.endswith(".json")}
    shards = {}
    if kind == "hdf5":
        for part in json.loads(files["manifest.json"])["parts"]:
            off, n, _ = part["chunk_index"]
            key = f"parts/{part['name']}.h5"
            docs[key + TABLE] = json.loads(files[key][off:off + n])
    else:
        for key, meta in docs.items():
            if meta.get("node_type") == "array":
                shard_key, n_chunks, table = shard_of(key.rsplit("/", 1)[0], meta)
                shards[shard_key] = (n_chunks, table)
    samples, ids = read_samples(url, options, fast=True)
    if not url.startswith("s3://"):  # both paths agree on the pristine store (on S3 this read takes seconds)
        slow, slow_ids = read_samples(url, options, fast=False)
        assert ids == slow_ids and all(differs(a, b) is None for a, b in zip(samples, slow)), "the paths disagree"
    return Pristine(backend, variant, kind, url, options, files, dirs, docs, shards, samples, ids)


def shard_of(array: str, meta: dict) -> tuple[str, int, bool]:
    """(key of the array's single shard, its inner chunks, whether a crc32c table precedes its index)."""
    cfg = meta["codecs"][0]["configuration"]
    outer = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
    table = (meta.get("attributes") or {}).get("deepspec_chunk_crc32c") == "table"
    return f"{array}/c/" + "/".join("0" for _ in meta["shape"]), outer // cfg["chunk_shape"][0], table


def read_all(url: str, options: dict | None) -> dict[str, bytes]:
    if url.startswith("s3://"):
        import fsspec

        fs, root = fsspec.core.url_to_fs(url, **(options or {}))
        fs.invalidate_cache()
        return {p[len(root) + 1:]: fs.cat_file(p) for p in sorted(fs.find(root))}
    out = {}
    for d, _, names in os.walk(url):
        for n in names:
            out[os.path.relpath(os.path.join(d, n), url)] = Path(d, n).read_bytes()
    return out


def read_samples(url: str, options: dict | None, fast: bool) -> tuple[list[dict], list[int]]:
    from deepspec.cache.read.reader import CacheReader

    reader = CacheReader(url, options, fast=fast)
    try:
        return [reader.read(k) for k in range(len(reader))], [reader.sample_id(k) for k in range(len(reader))]
    finally:
        close_reader(reader)


def close_reader(reader) -> None:
    """Close the descriptors a reader keeps (ByteRanges' LRU of open files): thousands of cases
    would otherwise run out of them."""
    state = getattr(reader, "_state", None)
    files = getattr(state, "files", None)
    if files is not None:
        with contextlib.suppress(Exception):
            files.close()


def differs(a: dict, b: dict) -> str | None:
    """What differs between two samples as CacheReader.read returns them (None: every field's
    arrays are equal, dtype, shape and bytes). A manifest may list fewer of the layers its parts hold
    (a writer's claim, as a layer subset's manifest is): the layers it lists must read as written."""
    if list(a) != list(b) and not (set(b) < set(a) and {"input_ids", "loss_mask", "last"} <= set(b)):
        return f"fields {list(a)} != {list(b)}"
    for field in b:
        x, y = a[field], b[field]
        xs, ys = (x, y) if isinstance(x, tuple) else ((x,), (y,))
        if not isinstance(y, tuple if isinstance(x, tuple) else np.ndarray) or len(xs) != len(ys):
            return f"{field}: {type(y).__name__} where {type(x).__name__} was"
        for u, v in zip(xs, ys):
            if (u is None) != (v is None):
                return f"{field}: {v is None and 'None' or 'an array'} where {u is None and 'None' or 'an array'} was"
            if u is not None and (u.dtype != v.dtype or u.shape != v.shape or u.tobytes() != v.tobytes()):
                return f"{field}: {v.dtype}{list(v.shape)} differs from {u.dtype}{list(u.shape)}"
    return None


def manifest_of(doc: dict, kind: str) -> dict:
    return doc["attributes"] if kind == "zarr" else doc


def read_shard_index(data: bytes, n: int) -> np.ndarray:
    return np.frombuffer(data[-(16 * n + 4):-4], dtype="<u8").reshape(n, 2)


# ---- the case's copy of the store ---------------------------------------------------------------------

class Skip(Exception):
    """A mutation that cannot apply (its file is gone or no longer a regular file): skipped."""


class Place:
    """Where a case's copy lives: its URL and the byte-level operations mutations use."""
    url: str
    options: dict | None
    fifos: list[str]

    def read(self, key: str) -> bytes: ...
    def write(self, key: str, data: bytes) -> None: ...
    def delete(self, key: str) -> None: ...
    def write_outside(self, name: str, data: bytes) -> str: ...   # returns the key (relative to the store) of a copy outside

    def created(self, key: str) -> None:
        """`key` was written by something else than this place (the library's writer)."""

    def names(self) -> tuple[str, ...]:
        """How a message may name the store."""
        return (self.url,)


class LocalPlace(Place):
    def __init__(self, case_dir: str, pristine: Pristine):
        self.case_dir = case_dir
        self.url = os.path.join(case_dir, "store")
        self.options = None
        self.outside = os.path.join(case_dir, "outside")
        self.fifos = []
        shutil.copytree(pristine.url, self.url, symlinks=True)

    def names(self) -> tuple[str, ...]:
        return (self.url, os.path.realpath(self.url))

    def path(self, key: str) -> str:
        return os.path.join(self.url, key)

    def regular(self, key: str) -> str:
        """The path of `key`, which must be a regular file reached through no link (else Skip): the
        harness never reads a FIFO nor writes through a link."""
        path = self.path(key)
        real = os.path.realpath(path)
        try:
            st_ = os.lstat(path)
        except OSError:
            raise Skip(f"{key} is gone") from None
        if real != os.path.abspath(path) or not stat.S_ISREG(st_.st_mode):
            raise Skip(f"{key} is no longer a regular file")
        if st_.st_size > REWRITE_LIMIT:
            raise Skip(f"{key} is too large to rewrite")
        return path

    def read(self, key: str) -> bytes:
        return Path(self.regular(key)).read_bytes()

    def write(self, key: str, data: bytes) -> None:
        Path(self.regular(key)).write_bytes(data)

    def delete(self, key: str) -> None:
        path = self.path(key)
        if not os.path.lexists(path):
            raise Skip(f"{key} is gone")
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)

    def write_outside(self, name: str, data: bytes) -> str:
        os.makedirs(self.outside, exist_ok=True)
        Path(self.outside, name).write_bytes(data)
        return f"../outside/{name}"

    def release_fifos(self) -> None:
        """A reader blocked opening or reading one of the case's FIFOs (on a helper thread no signal
        reaches) is given a writer that closes at once: its open returns and its read sees EOF."""
        for fifo in self.fifos:
            for _ in range(3):
                try:
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:  # ENXIO: nobody has it open for reading; ENOENT: gone
                    break
                os.close(fd)
                time.sleep(0.001)

    def close(self) -> None:
        self.release_fifos()
        shutil.rmtree(self.case_dir, ignore_errors=True)


class S3Place(Place):
    """A pristine store's working copy on S3, shared by the cases of that store: made once, and every
    key a case touches is put back when it ends (a fresh copy per case would be ~40 PUTs, most of a
    case's time on moto). s3fs's listings are forgotten between cases, so none outlives the bytes."""

    def __init__(self, pristine: Pristine, client, bucket: str):
        self.pristine, self.client, self.bucket = pristine, client, bucket
        self.prefix = f"copy-{pristine.backend}-{pristine.variant}-{uuid.uuid4().hex[:8]}"
        self.url = f"s3://{bucket}/{self.prefix}/store"
        self.options = pristine.options
        self.fifos = []
        self.touched: set[str] = set()
        self.sizes: dict[str, int] = {}  # of the keys this case wrote
        self.outside_keys: set[str] = set()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda kv: self.put(*kv), pristine.files.items()))

    def names(self) -> tuple[str, ...]:
        return (self.url, self.url.removeprefix("s3://"))

    def object(self, key: str) -> str:
        return f"{self.prefix}/store/{key}"

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.object(key), Body=data)

    def read(self, key: str) -> bytes:
        if self.sizes.get(key, 0) > REWRITE_LIMIT:
            raise Skip(f"{key} is too large to rewrite")
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.object(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            raise Skip(f"{key} is gone") from None

    def write(self, key: str, data: bytes) -> None:
        self.touched.add(key)
        self.sizes[key] = len(data)
        self.put(key, data)

    def delete(self, key: str) -> None:
        self.touched.add(key)
        self.client.delete_object(Bucket=self.bucket, Key=self.object(key))

    def created(self, key: str) -> None:
        self.touched.add(key)

    def write_outside(self, name: str, data: bytes) -> str:
        key = f"{self.prefix}/outside/{name}"
        self.outside_keys.add(key)
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        return f"../outside/{name}"

    def release_fifos(self) -> None:
        pass

    def close(self) -> None:
        """Every key the case touched back to its pristine bytes (or gone, if it had none)."""
        for key in sorted(self.touched):
            if key in self.pristine.files:
                self.put(key, self.pristine.files[key])
            else:
                self.client.delete_object(Bucket=self.bucket, Key=self.object(key))
        for key in sorted(self.outside_keys):
            self.client.delete_object(Bucket=self.bucket, Key=key)
        self.touched.clear()
        self.sizes.clear()
        self.outside_keys.clear()
        forget_listings()


def forget_listings() -> None:
    """Drop the listings every cached s3fs filesystem keeps (fsspec caches the instances by options)."""
    import s3fs

    for fs in list(s3fs.S3FileSystem._cache.values()):
        fs.invalidate_cache()


def scratch(prefix: str) -> str:
    """A fresh directory for pristine stores and case copies: on tmpfs (/dev/shm) where there is one,
    since a case creates and removes ~50 directories and rmdir costs ~1.5 ms each on an overlay disk."""
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=where)
