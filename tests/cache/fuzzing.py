"""A property-based fuzzer of stores written by anyone (docs/cache-format.md §13, DESIGN.md §12): the
harness tests/cache/test_fuzz.py (CI, a fixed seeded set) and benchmarks/fuzz_stores.py (N cases,
a table) share.

A case copies a small pristine store (built once per backend and variant: Zarr or HDF5, local or on
S3, bfloat16 uncompressed or fp8 + blosc-zstd; 2 parts, 5 samples), applies 1-3 hostile mutations
(`Mutation`: JSON fields, truncation, bit flips, links in and out of the store, /dev/zero, FIFOs,
directories, sparse or oversized files, duplicated names and keys, deleted files, index rows and
shard indexes rewritten with valid checksums), then reads it through the library in one or more
modes (`CacheReader(fast=True)` always; `fast=False` and `tools.verify.verify` for a drawn subset)
and checks, for every mode:

  1. it returns the pristine store's samples (len, every array of every sample with its dtype and
     shape, every sample id) or raises CacheFormatError (its subclasses ChecksumError, LeaseError, ...
     included) whose message names the store (its URL or path); any other exception is a failure;
  2. nothing outside the store is opened (what is recorded, and what is not, below);
  3. the tracemalloc peak above what was held when the mode started stays under `MEMORY_BOUND`
     (less for a case with an oversized object: a quarter of that object);
  4. it ends within its timeout: `signal.setitimer` raises `CaseTimeout` in the main thread (it
     interrupts a blocking open of a FIFO there), FIFOs of the case are then opened for writing and
     closed so a reader blocked on one in a helper thread (zarr's I/O threads) gets EOF, and
     `faulthandler.dump_traceback_later(..., exit=True)` is the backstop that kills the process
     loudly if the main thread is stuck where no signal handler runs. (A mode cut short may leave a
     lock of the library held or a request in flight: cases after a hang may fail for that reason.)

Recorded for 2, only while a mode runs (`Recorder.active`; audit hooks cannot be removed, so the
hook is installed once per process and does nothing otherwise), from any thread:
  - the audit events `open` (builtins.open, io.open, os.open, and io.open_code of imports),
    `os.listdir` and `os.scandir`, each path resolved with os.path.realpath when the event fires;
  - h5py's file opens (HDF5 opens files in C, unaudited): a wrapper around h5py._hl.files.make_fid
    records the name of every h5py.File opened by name (a file object handed to h5py was opened,
    and recorded, by Python);
  - on S3, every request s3fs makes (S3FileSystem._call_s3: its Bucket and Key, Prefix or
    CopySource), which must lie under the case's store prefix.
  Allowed beside the case's store: Python's stdlib, the venv's site-packages and this checkout's
  deepspec/ (modules imported lazily), /dev/urandom, /proc/self (`ALLOWED_FILES`).
Not recorded: stat/lstat/exists/realpath/readlink (no audit event: metadata only, no bytes), an mmap
of a descriptor (its open was recorded), files opened in C by other libraries (blosc, hdf5plugin's
dlopen of filters), anything a child process does.

The harness only ever reads or rewrites regular files of the case's own copy; a mutation whose file
an earlier mutation turned into something else (a link, a FIFO, a directory) is skipped and says so.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import faulthandler
import json
import os
import shutil
import signal
import stat
import struct
import sys
import sysconfig
import tempfile
import threading
import time
import tracemalloc
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from crc32c import crc32c
from hypothesis import strategies as st

from deepspec.cache.spec.format import CacheFormatError

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ("zarr-local", "hdf5-local", "zarr-s3", "hdf5-s3")
VARIANTS = {"bf16": {"dtype": "bfloat16", "codec": "none"}, "fp8-zstd": {"dtype": "fp8", "codec": "blosc-zstd"}}
ROOT_DOC = {"zarr": "zarr.json", "hdf5": "manifest.json"}
COLUMNS = {"part": 0, "offset": 1, "length": 2}  # the index columns a hostile row edit sets
TABLE = "#chunk_index"  # suffix of an HDF5 part file's chunk table as a JSON document of its own

# the peak a mode may allocate over what it started with: a pristine store's reads need under 1 MiB,
# and the sizes hostile fields declare (2**31 and up) or oversized files hold lie far above it
MEMORY_BOUND = 64 << 20
HUGE_SPARSE = 1 << 40        # a local file extended (sparse: no disk, no time) far past what it declares
HUGE_OBJECT = 32 << 20       # an S3 object with a declared size (shard, part file, index) replaced by this many bytes
try:  # the most a JSON document without a declared size may be (the library's door); one just past it is refused
    from deepspec.cache.storage.door import DOCUMENT_BYTES
except ImportError:  # pragma: no cover - an older library
    DOCUMENT_BYTES = 64 << 20
REWRITE_LIMIT = 8 << 20      # a later mutation of the same case skips a file an earlier one made oversized
TIMEOUT_LOCAL_S = 5.0
TIMEOUT_S3_S = 10.0          # a case reads ~30 ranges from moto in well under a second
BACKSTOP_S = 60.0            # past a mode's timeout: the process is stuck where no handler runs


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


# ---- hostile values -----------------------------------------------------------------------------------

class Raw:
    """JSON text written as it is (a value json.dumps cannot make: deep nesting), shown by name."""

    def __init__(self, name: str, text: str):
        self.name, self.text = name, text

    def __repr__(self) -> str:
        return f"<{self.name}>"


class Big:
    """A large list or string, shown by name (reports stay short)."""

    def __init__(self, name: str, value: Any):
        self.name, self.value = name, value

    def __repr__(self) -> str:
        return f"<{self.name}>"


DEEP = Raw("nesting 100000 deep", "[" * 100_000 + "]" * 100_000)
CONSTANTS: tuple = (
    None, True, False, -1, 0, 1, 2**31, 2**32, 2**48, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 5, 2**64, 10**20,
    -2**63, 0.5, -0.0, 1e308, float("inf"), float("nan"), "", "0", "12", "../x", "/etc/passwd", "p000000",
    "index/0123456789abcdef/c/0/0", [], [0], [-1, -1], {}, {"a": 1},
    Big("list of 100000 zeros", [0] * 100_000), Big("string of 1 MB", "x" * (1 << 20)), DEEP,
)
UINT64: tuple = (0, 1, 2**31, 2**32, 2**40, 2**48, 2**63 - 1, 2**63, 2**64 - 5, 2**64 - 1)


def derived(original: Any) -> list:
    """Values near `original`: off by one, scaled, another type: what passes a careless check."""
    if isinstance(original, bool):
        return [not original, int(original)]
    if isinstance(original, int):
        return [original - 1, original + 1, -original, original * 1000, original + 2**32, str(original),
                float(original), [original]]
    if isinstance(original, float):
        return [original + 1, -original, int(original), str(original)]
    if isinstance(original, str):
        return [original + "x", original[:-1], original.upper(), "../" + original, "/" + original,
                original + "/..", original * 2]
    if isinstance(original, list):
        return [original[:-1], original + original[-1:], original[::-1], [original], original * 1000]
    if isinstance(original, dict):
        return [dict(list(original.items())[:-1]), list(original.values())]
    return []


def hostile(original: Any) -> st.SearchStrategy:
    near = derived(original)
    choices = [st.sampled_from(CONSTANTS), st.integers(-(2**65), 2**65)]
    if near:
        choices.append(st.sampled_from(near))
    return st.one_of(*choices)


def uint64_values(original: int) -> st.SearchStrategy:
    near = [(original + d) % 2**64 for d in (-8, -1, 1, 8, 2**32)] + [original * 1000 % 2**64]
    return st.one_of(st.sampled_from(UINT64), st.sampled_from(near), st.integers(0, 2**64 - 1))


def dumps(node: Any) -> str:
    """JSON text of `node`: Raw as its text, Big as its value, a DupKeys with its repeated keys."""
    if isinstance(node, Raw):
        return node.text
    if isinstance(node, Big):
        return dumps(node.value)
    if isinstance(node, DupKeys):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dumps(v)}" for k, v in node.pairs) + "}"
    if isinstance(node, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dumps(v)}" for k, v in node.items()) + "}"
    if isinstance(node, list):
        return "[" + ", ".join(dumps(v) for v in node) + "]"
    return json.dumps(node)


class DupKeys:
    """A JSON object written with a key twice (Python's json keeps the last)."""

    def __init__(self, pairs: list[tuple[str, Any]]):
        self.pairs = pairs


# ---- mutations ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Mutation:
    kind: str                   # see KINDS
    key: str                    # the store file (object, directory, JSON document) it acts on
    params: tuple = ()          # (name, value) pairs

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    def __str__(self) -> str:
        shown = ", ".join(f"{k}={short(v)}" for k, v in self.params)
        return f"{self.kind} {self.key}" + (f" ({shown})" if shown else "")


def short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


KINDS_ANY = ("json_set", "json_delete", "json_dup_key", "json_dup_item", "truncate", "bitflip", "delete",
             "index_row", "index_key_outside", "part_listed_twice")
KINDS_ZARR = ("shard_index",)
KINDS_HDF5 = ("h5_attr",)
KINDS_LOCAL = ("link_inside", "link_outside", "dev_zero", "fifo", "directory", "link_loop", "dangling_link",
               "huge_sparse", "dir_link_outside", "dir_link_inside", "delete_dir")
KINDS_S3 = ("huge_object",)


def kinds_for(p: Pristine) -> tuple[str, ...]:
    return KINDS_ANY + (KINDS_ZARR if p.kind == "zarr" else KINDS_HDF5) + (KINDS_S3 if p.remote else KINDS_LOCAL)


def path_text(path: tuple) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in path).lstrip(".") or "<document>"


def json_paths(doc: Any, op: str) -> set[tuple]:
    """The paths into `doc` an edit `op` can act on: any node for "set" (the document itself too),
    a key of an object for "dup_key", an item of a list for "dup_item", either for "delete"."""
    out: set[tuple] = {()} if op == "set" else set()

    def walk(node: Any, path: tuple) -> None:
        steps = sorted(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else ()
        for step in steps:
            if op in ("set", "delete") or (op == "dup_key") == isinstance(node, dict):
                out.add(path + (step,))
            walk(node[step], path + (step,))

    walk(doc, ())
    return out


@st.composite
def json_mutation(draw, p: Pristine, op: str) -> Mutation:
    """A JSON edit: a walk from the document's root down to a node `op` can act on, stopping early
    with some chance (the whole document rarely, a field three times in four), so top-level fields
    are drawn as often as the items of long lists."""
    key = draw(st.sampled_from([k for k in sorted(p.docs) if json_paths(p.docs[k], op)]))
    doc = p.docs[key]
    targets = json_paths(doc, op)
    on_the_way = {t[:i] for t in targets for i in range(len(t) + 1)}
    node, path = doc, ()
    while True:
        steps = sorted(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else ()
        children = [s for s in steps if path + (s,) in on_the_way]
        if not children or (path in targets and draw(st.integers(0, 9)) < (1 if not path else 3)):
            break
        step = draw(st.sampled_from(children))
        path, node = path + (step,), node[step]
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    params: list = [("path", path)]
    if op in ("set", "dup_key"):
        params.append(("value", draw(hostile(node))))
    if op == "dup_key":
        params.append(("last", draw(st.booleans())))  # last: the hostile value is the one Python's json keeps
    if op == "dup_item":
        params.append(("at", draw(st.integers(0, len(parent)))))
    return Mutation(f"json_{op}", key, tuple(params))


def mutation(p: Pristine) -> st.SearchStrategy[Mutation]:
    """A mutation of any kind `p`'s backend has, on one of its files."""
    return st.sampled_from(kinds_for(p)).flatmap(lambda kind: mutation_of(p, kind))


@st.composite
def mutation_of(draw, p: Pristine, kind: str) -> Mutation:
    if kind.startswith("json_"):
        return draw(json_mutation(p, kind.removeprefix("json_")))
    files = sorted(p.files)
    if kind in ("truncate", "bitflip", "huge_object"):
        key = draw(st.sampled_from(files))
        size = len(p.files[key])
        if kind == "truncate":
            return Mutation(kind, key, (("length", draw(st.integers(0, max(size - 1, 0)))),))
        if kind == "bitflip":
            flips = draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, 7)), min_size=1, max_size=4,
                                  unique=True))
            return Mutation(kind, key, (("flips", tuple(flips)),))
        return Mutation(kind, key)
    if kind == "index_row":
        row, column = draw(st.integers(0, len(p.samples) - 1)), draw(st.sampled_from(sorted(COLUMNS)))
        index = manifest_of(p.docs[p.root_doc], p.kind)["index"]
        at = int(index["offset"]) + (row * len(index["columns"]) + COLUMNS[column]) * 8
        stored = struct.unpack("<Q", p.files[index["key"]][at:at + 8])[0]
        return Mutation(kind, p.root_doc, (("row", row), ("column", column), ("value", draw(uint64_values(stored)))))
    if kind == "index_key_outside":
        return Mutation(kind, p.root_doc, (("absolute", draw(st.booleans())),))
    if kind == "part_listed_twice":
        n = len(manifest_of(p.docs[p.root_doc], p.kind)["parts"])
        return Mutation(kind, p.root_doc, (("part", draw(st.integers(0, n - 1))), ("at", draw(st.integers(0, n)))))
    if kind == "shard_index":
        key = draw(st.sampled_from(sorted(p.shards)))
        n, _ = p.shards[key]
        chunk = draw(st.integers(0, n - 1))
        field = draw(st.sampled_from(["offset", "nbytes", "absent"]))
        stored = read_shard_index(p.files[key], n)[chunk][0 if field == "offset" else 1]
        value = 0 if field == "absent" else draw(uint64_values(int(stored)))
        return Mutation(kind, key, (("chunk", chunk), ("field", field), ("value", value)))
    if kind == "h5_attr":
        key = draw(st.sampled_from([f for f in files if f.startswith("parts/")]))
        name = draw(st.sampled_from(["committed", "samples", "tokens", "rank", "format", "chunk_index"]))
        value = draw(st.sampled_from([-1, 0, 1, 2**62, 2**63 - 1, "x", "../x", (0, 0, 0), (2**62, 1, 1), (-1,)]))
        return Mutation(kind, key, (("name", name), ("value", value),
                                    ("drop_manifest_table", draw(st.booleans()))))
    if kind in ("link_inside", "link_outside", "dev_zero", "fifo", "directory", "link_loop", "dangling_link",
                "huge_sparse", "delete"):
        key = draw(st.sampled_from(files))
        params: tuple = ()
        if kind == "link_inside":
            params = (("target", draw(st.sampled_from([f for f in files if f != key] or files))),
                      ("absolute", draw(st.booleans())))
        elif kind == "link_outside":
            params = (("absolute", draw(st.booleans())),)
        elif kind == "directory":
            params = (("with_child", draw(st.booleans())),)
        return Mutation(kind, key, params)
    # directories
    key = draw(st.sampled_from(p.dirs))
    if kind == "dir_link_inside":
        return Mutation(kind, key, (("target", draw(st.sampled_from(["", *[d for d in p.dirs if d != key]]))),))
    if kind == "dir_link_outside":
        return Mutation(kind, key, (("absolute", draw(st.booleans())),))
    return Mutation(kind, key)


@dataclasses.dataclass(frozen=True)
class Case:
    pristine: Pristine
    mutations: tuple[Mutation, ...]
    modes: tuple[str, ...]             # "fast" always; "slow" (fast=False), "verify" for some

    def __repr__(self) -> str:
        return f"Case({self.pristine.backend}/{self.pristine.variant}: " + "; ".join(map(str, self.mutations)) + \
            f"; modes {'+'.join(self.modes)})"

    def _repr_pretty_(self, printer, cycle) -> None:  # how hypothesis shows a failing case
        printer.text(repr(self))


def cases(pristines: list[Pristine]) -> st.SearchStrategy[Case]:
    """A case over one of `pristines` (the variants of one backend)."""
    @st.composite
    def draw_case(draw) -> Case:
        p = draw(st.sampled_from(pristines))
        muts = tuple(draw(st.lists(mutation(p), min_size=1, max_size=3)))
        # one case in eight (sixteen on S3) also reads through zarr-python/h5py (several times the
        # fast path's time: a request per chunk on S3), as many also run verify
        extra = draw(st.integers(0, 15 if p.remote else 7))
        modes = ("fast",) + (("slow",) if extra == 1 else ("verify",) if extra == 2 else ())
        return Case(p, muts, modes)

    return draw_case()


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


# ---- applying mutations -------------------------------------------------------------------------------

def manifest_of(doc: dict, kind: str) -> dict:
    return doc["attributes"] if kind == "zarr" else doc


def read_doc(place: Place, p: Pristine, key: str) -> Any:
    """A JSON document of the case's copy (Skip when earlier mutations made it unreadable)."""
    if key.endswith(TABLE):
        file = key[:-len(TABLE)]
        off, n, _ = table_entry(place, p, file)
        data = place.read(file)[off:off + n]
    else:
        data = place.read(key)
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise Skip(f"{key} is no longer JSON") from None


def table_entry(place: Place, p: Pristine, file: str) -> list[int]:
    """The manifest's [offset, nbytes, crc32c] of an HDF5 part file's chunk table."""
    name = file.removeprefix("parts/").removesuffix(".h5")
    try:
        m = read_doc(place, p, p.root_doc)
        entry = next(e for e in m["parts"] if isinstance(e, dict) and e.get("name") == name)
        off, n, crc = (int(v) for v in entry["chunk_index"])
    except (Skip, StopIteration, KeyError, TypeError, ValueError):
        raise Skip(f"the manifest no longer locates {file}'s chunk table") from None
    return [off, n, crc]


def write_doc(place: Place, p: Pristine, key: str, text: str) -> None:
    if not key.endswith(TABLE):
        place.write(key, text.encode())
        return
    # the chunk table is covered by a crc32c in the manifest: a hostile writer recomputes it
    file = key[:-len(TABLE)]
    off, n, _ = table_entry(place, p, file)
    blob, data = text.encode(), bytearray(place.read(file))
    if len(blob) <= n:
        blob = blob + b" " * (n - len(blob))
    else:  # too long to fit: appended to the file, which HDF5 ignores
        off, n = len(data), len(blob)
    data[off:off + n] = blob
    place.write(file, bytes(data))
    m = read_doc(place, p, p.root_doc)
    for e in manifest_of(m, p.kind)["parts"]:
        if isinstance(e, dict) and e.get("name") == file.removeprefix("parts/").removesuffix(".h5"):
            e["chunk_index"] = [off, n, crc32c(blob)]
    place.write(p.root_doc, json.dumps(m).encode())


def json_edit(place: Place, p: Pristine, m: Mutation) -> None:
    doc = read_doc(place, p, m.key)
    path = m.get("path")
    op = m.kind.removeprefix("json_")
    if not path:
        write_doc(place, p, m.key, dumps(m.get("value")))
        return
    parent = doc
    try:
        for step in path[:-1]:
            parent = parent[step]
        last = path[-1]
        parent[last]  # noqa: B018 - the path must still lead somewhere
    except (KeyError, IndexError, TypeError):
        raise Skip(f"{path_text(path)} is gone") from None
    if not isinstance(parent, list if op == "dup_item" else dict if op == "dup_key" else (list, dict)):
        raise Skip(f"{path_text(path)} is no longer in a {'list' if op == 'dup_item' else 'object'}")
    if op == "set":
        parent[last] = m.get("value")
    elif op == "delete":
        del parent[last]
    elif op == "dup_item":
        parent.insert(min(m.get("at"), len(parent)), copy.deepcopy(parent[last]))
    elif op == "dup_key":
        pairs, extra = list(parent.items()), (last, m.get("value"))
        node = DupKeys(pairs + [extra] if m.get("last") else [extra] + pairs)
        if len(path) == 1:  # a key of the document itself
            write_doc(place, p, m.key, dumps(node))
            return
        grandparent = doc
        for step in path[:-2]:
            grandparent = grandparent[step]
        grandparent[path[-2]] = node
    write_doc(place, p, m.key, dumps(doc))


def read_shard_index(data: bytes, n: int) -> np.ndarray:
    return np.frombuffer(data[-(16 * n + 4):-4], dtype="<u8").reshape(n, 2)


def shard_index_edit(place: Place, p: Pristine, m: Mutation) -> None:
    """One entry of a Zarr shard's chunk index set, its crc32c recomputed (a hostile writer's valid index)."""
    n, _ = p.shards[m.key]
    data = bytearray(place.read(m.key))
    if len(data) < 16 * n + 4:
        raise Skip(f"{m.key} no longer holds an index")
    idx = read_shard_index(bytes(data), n).copy()
    chunk, field = m.get("chunk"), m.get("field")
    if field == "absent":
        idx[chunk] = 2**64 - 1
    else:
        idx[chunk, 0 if field == "offset" else 1] = m.get("value")
    raw = idx.astype("<u8").tobytes()
    data[-(16 * n + 4):] = raw + crc32c(raw).to_bytes(4, "little")
    place.write(m.key, bytes(data))


def index_row_edit(place: Place, p: Pristine, m: Mutation, value: int) -> None:
    """A cell of the consolidated index set to `value` with every checksum over it recomputed: the
    manifest's crc32c and, in a Zarr index shard, its chunk's entry in the crc32c table."""
    doc = read_doc(place, p, p.root_doc)
    try:
        index = manifest_of(doc, p.kind)["index"]
        key, off, nbytes, columns = index["key"], int(index["offset"]), int(index["nbytes"]), len(index["columns"])
    except (KeyError, TypeError, ValueError):
        raise Skip("the manifest no longer locates the index") from None
    data = bytearray(place.read(key))
    at = off + (m.get("row") * columns + COLUMNS[m.get("column")]) * 8
    if at + 8 > min(len(data), off + nbytes):
        raise Skip("the index no longer holds that row")
    data[at:at + 8] = struct.pack("<Q", value)
    index["crc32c"] = crc32c(bytes(data[off:off + nbytes]))
    if p.kind == "zarr" and key in p.shards:
        data = bytearray(fix_crc_table(bytes(data), *p.shards[key]))
    place.write(key, bytes(data))
    place.write(p.root_doc, json.dumps(doc).encode())


def fix_crc_table(data: bytes, n: int, table: bool) -> bytes:
    """A v4 shard's crc32c table made to hold its chunks' crc32cs again."""
    if not table:
        return data
    idx = read_shard_index(data, n)
    crcs = b"".join(crc32c(data[int(o):int(o) + int(s)]).to_bytes(4, "little") for o, s in idx)
    start = len(data) - (16 * n + 4) - (4 * n + 4)
    return data[:start] + crcs + crc32c(crcs).to_bytes(4, "little") + data[start + 4 * n + 4:]


def index_key_outside(place: Place, p: Pristine, m: Mutation) -> None:
    """The index copied outside the store, right bytes and all, and the manifest pointed at the copy."""
    doc = read_doc(place, p, p.root_doc)
    try:
        index = manifest_of(doc, p.kind)["index"]
        data = place.read(index["key"])
    except (KeyError, TypeError):
        raise Skip("the manifest no longer locates the index") from None
    key = place.write_outside("index-copy", data)
    if m.get("absolute") and isinstance(place, LocalPlace):
        key = os.path.join(place.outside, "index-copy")
    index["key"] = key
    place.write(p.root_doc, json.dumps(doc).encode())


def part_listed_twice(place: Place, p: Pristine, m: Mutation) -> None:
    """A part listed twice by an otherwise consistent store: its manifest entry and its index rows
    repeated, the index written anew (named, sized and checksummed by the library's own writer),
    the totals summed. Only the rule "no part listed twice" (§13) stands in the way."""
    from deepspec.cache.backends.writers import open_for_write

    doc = read_doc(place, p, p.root_doc)
    man = manifest_of(doc, p.kind)
    try:
        parts, index = list(man["parts"]), man["index"]
        data = place.read(index["key"])
        off, nbytes, columns = int(index["offset"]), int(index["nbytes"]), len(index["columns"])
        rows = np.frombuffer(data[off:off + nbytes], dtype="<u8").reshape(-1, columns)
        segments = [rows[rows[:, 0] == k] for k in range(len(parts))]
        twice, at = m.get("part"), m.get("at")
        parts.insert(at, copy.deepcopy(parts[twice]))
        segments.insert(at, segments[twice])
        new = np.concatenate([np.column_stack([np.full(len(s), k, dtype="<u8"), s[:, 1:]]) for k, s in
                              enumerate(segments)]).astype("<u8")
        added = dict(man["parts"][twice])
        man["num_samples"] = int(man["num_samples"]) + int(added["samples"])
        man["num_tokens"] = int(man["num_tokens"]) + int(added["tokens"])
        desc = open_for_write(place.url, p.kind, place.options).write_index(new)
    except (Skip, KeyError, TypeError, ValueError, IndexError, OSError, CacheFormatError) as e:
        raise Skip(f"the store no longer has a consistent index to repeat a part in ({type(e).__name__})") from None
    place.created(desc["key"])
    if p.kind == "zarr":
        place.created(desc["key"].removesuffix("/c/0/0") + "/zarr.json")
        place.created("index/zarr.json")
    man["parts"], man["index"] = parts, desc
    place.write(p.root_doc, json.dumps(doc).encode())


def h5_attr_edit(place: Place, p: Pristine, m: Mutation) -> None:
    """A root attribute of an HDF5 part file rewritten by h5py (the part's own commit record); with
    drop_manifest_table the manifest no longer says where the chunk table is, so readers ask the file."""
    import h5py

    with tempfile.TemporaryDirectory(prefix="fuzz-h5-") as tmp:
        path = os.path.join(tmp, "part.h5")
        Path(path).write_bytes(place.read(m.key))
        value = m.get("value")
        try:
            with h5py.File(path, "r+") as f:
                f.attrs[m.get("name")] = np.asarray(value, dtype=np.int64) if isinstance(value, tuple) else value
        except (OSError, ValueError, TypeError) as e:
            raise Skip(f"h5py cannot write that attribute ({e.__class__.__name__})") from None
        place.write(m.key, Path(path).read_bytes())
    if m.get("drop_manifest_table"):
        doc = read_doc(place, p, p.root_doc)
        name = m.key.removeprefix("parts/").removesuffix(".h5")
        for e in manifest_of(doc, p.kind).get("parts") or []:
            if isinstance(e, dict) and e.get("name") == name:
                e.pop("chunk_index", None)
        place.write(p.root_doc, json.dumps(doc).encode())


def fs_edit(place: LocalPlace, m: Mutation) -> None:
    """The local-filesystem mutations: what a path in the store is, not what its bytes are."""
    path = place.path(m.key)
    if m.kind in ("dir_link_outside", "dir_link_inside", "delete_dir"):
        if not os.path.isdir(path) or os.path.realpath(path) != os.path.abspath(path):
            raise Skip(f"{m.key} is no longer a directory reached through no link")
    elif m.kind != "delete":
        place.regular(m.key)
    if m.kind == "link_inside":
        target = place.path(m.get("target"))
        os.unlink(path)
        os.symlink(target if m.get("absolute") else os.path.relpath(target, os.path.dirname(path)), path)
    elif m.kind in ("link_outside", "dir_link_outside"):
        os.makedirs(place.outside, exist_ok=True)
        moved = os.path.join(place.outside, m.key.replace("/", "__"))
        shutil.move(path, moved)
        os.symlink(moved if m.get("absolute") else os.path.relpath(moved, os.path.dirname(path)), path)
    elif m.kind == "dev_zero":
        os.unlink(path)
        os.symlink("/dev/zero", path)
    elif m.kind == "fifo":
        os.unlink(path)
        os.mkfifo(path)
        place.fifos.append(path)
    elif m.kind == "directory":
        os.unlink(path)
        os.mkdir(path)
        if m.get("with_child"):
            Path(path, "0").write_bytes(b"{}")
    elif m.kind == "link_loop":
        os.unlink(path)
        os.symlink(os.path.basename(path), path)
    elif m.kind == "dangling_link":
        os.unlink(path)
        os.symlink(os.path.basename(path) + ".missing", path)
    elif m.kind == "huge_sparse":
        os.truncate(path, HUGE_SPARSE)
    elif m.kind == "dir_link_inside":
        shutil.rmtree(path)
        os.symlink(place.path(m.get("target")) if m.get("target") else place.url, path)
    elif m.kind == "delete_dir":
        shutil.rmtree(path)
    elif m.kind == "delete":
        place.delete(m.key)


def huge_size(key: str) -> int:
    """An oversized object's size: past the document bound for a JSON document (no declared size),
    far past the declared size of anything else."""
    return DOCUMENT_BYTES + 4096 if key.endswith(".json") else HUGE_OBJECT


def apply(place: Place, p: Pristine, m: Mutation) -> str:
    """Apply `m` to the case's copy; returns how it was applied ("skipped: why" when it could not be)."""
    try:
        if m.kind.startswith("json_"):
            json_edit(place, p, m)
        elif m.kind == "truncate":
            place.write(m.key, place.read(m.key)[:m.get("length")])
        elif m.kind == "bitflip":
            data = bytearray(place.read(m.key))
            for at, bit in m.get("flips"):
                if at < len(data):
                    data[at] ^= 1 << bit
            place.write(m.key, bytes(data))
        elif m.kind == "delete" and isinstance(place, S3Place):
            place.read(m.key)
            place.delete(m.key)
        elif m.kind == "shard_index":
            shard_index_edit(place, p, m)
        elif m.kind == "index_row":
            index_row_edit(place, p, m, m.get("value"))
        elif m.kind == "index_key_outside":
            index_key_outside(place, p, m)
        elif m.kind == "part_listed_twice":
            part_listed_twice(place, p, m)
        elif m.kind == "h5_attr":
            h5_attr_edit(place, p, m)
        elif m.kind == "huge_object":
            data = place.read(m.key)
            size = huge_size(m.key)
            place.write(m.key, data + (b" " if m.key.endswith(".json") else b"\0") * (size - len(data)))
        else:
            fs_edit(place, m)
    except Skip as e:
        return f"skipped: {e}"
    return "applied"


# ---- guards: what a mode may open, allocate and take ---------------------------------------------------

class CaseTimeout(BaseException):
    """A mode ran past its timeout (BaseException: a library's `except Exception` must not swallow it)."""


class Recorder:
    """What the running mode opened (local paths, resolved) and asked S3 for; see the module docstring."""

    def __init__(self):
        self.active = False
        self.opened: list[tuple[str, str]] = []     # (event, resolved path)
        self.s3: list[tuple[str, str]] = []         # (method, bucket/key)
        self._busy = threading.local()

    def record_path(self, event: str, path: Any) -> None:
        if isinstance(path, int) or path is None:
            return  # a descriptor: its open was recorded
        if getattr(self._busy, "on", False):
            return
        self._busy.on = True
        try:
            text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
            self.opened.append((event, os.path.realpath(text)))
        except Exception:  # noqa: BLE001 - a hook must never raise into the library
            self.opened.append((event, repr(path)))
        finally:
            self._busy.on = False


RECORDER = Recorder()
_HOOKED = False
_PATCHED: list[tuple[Any, str, Any]] = []   # (owner, attribute, original) of what install_recorders wrapped
AUDITED = {"open", "os.listdir", "os.scandir"}


def _audit(event: str, args: tuple) -> None:
    if RECORDER.active and event in AUDITED:
        RECORDER.record_path(event, args[0] if args else None)


def install_recorders() -> None:
    """The audit hook (once per process: it cannot be removed), h5py's opener and s3fs's request
    wrapper (put back by uninstall_recorders); all inert unless RECORDER.active."""
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    if _PATCHED:
        return
    import h5py
    import h5py._hl.files as h5files

    make_fid = h5files.make_fid

    def recording_make_fid(name, mode, userblock_size, fapl, *args, **kwargs):
        # a file object handed to h5py (its name is then the object's repr) was opened by Python: recorded
        if RECORDER.active and fapl.get_driver() != h5py.h5fd.fileobj_driver:
            RECORDER.record_path("h5py.File", name)
        return make_fid(name, mode, userblock_size, fapl, *args, **kwargs)

    _PATCHED.append((h5files, "make_fid", make_fid))
    h5files.make_fid = recording_make_fid
    try:
        import s3fs
    except ImportError:  # pragma: no cover
        return
    call = s3fs.S3FileSystem._call_s3

    async def recording_call(self, method, *args, **kwargs):
        if RECORDER.active:
            bucket = kwargs.get("Bucket", "")
            named = [f for f in ("Key", "Prefix") if f in kwargs]
            RECORDER.s3.extend((f"{method} {f}", f"{bucket}/{kwargs[f]}") for f in named)
            if "CopySource" in kwargs:
                RECORDER.s3.append((f"{method} CopySource", str(kwargs["CopySource"])))
            elif not named:
                RECORDER.s3.append((method, f"{bucket}/"))
        return await call(self, method, *args, **kwargs)

    _PATCHED.append((s3fs.S3FileSystem, "_call_s3", call))
    s3fs.S3FileSystem._call_s3 = recording_call


def uninstall_recorders() -> None:
    while _PATCHED:
        owner, name, original = _PATCHED.pop()
        setattr(owner, name, original)


def library_roots() -> tuple[str, ...]:
    """Where a mode may open files outside its store: Python's and the venv's libraries and this
    checkout's package (lazy imports, botocore's data files)."""
    roots = {str(REPO / "deepspec")}
    for scheme_vars in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=scheme_vars or None)
        roots.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    return tuple(sorted({os.path.realpath(r) for r in roots}))


# files every process may read: entropy, its own /proc entries (thread and memory introspection)
ALLOWED_FILES = ("/dev/urandom", "/dev/random")
ALLOWED_PREFIXES = ("/proc/self/", f"/proc/{os.getpid()}/")


def outside(opened: list[tuple[str, str]], store: str | None, roots: tuple[str, ...]) -> list[str]:
    """The recorded paths that lie neither in `store` (None: a remote store) nor in an allowed place."""
    allowed = tuple(r.rstrip("/") + "/" for r in roots)
    store_real = os.path.realpath(store) if store else None
    bad = []
    for event, path in opened:
        if store_real and (path == store_real or path.startswith(store_real + "/")):
            continue
        if path.startswith(allowed) or path in ALLOWED_FILES or path.startswith(ALLOWED_PREFIXES):
            continue
        bad.append(f"{event} {path}")
    return sorted(set(bad))


def s3_outside(requests: list[tuple[str, str]], store: str) -> list[str]:
    """The requests for keys outside the store's prefix; a key's `..` segments count as climbing
    (S3 keeps them literally, but a proxy or another server may not)."""
    import posixpath

    prefix = store.removeprefix("s3://").rstrip("/")
    out = set()
    for method, key in requests:
        norm = posixpath.normpath(key) + ("/" if key.endswith("/") else "")
        if not (norm == prefix or norm.startswith(prefix + "/")):
            out.add(f"{method} {key}")
    return sorted(out)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """CaseTimeout in the main thread after `seconds`; an outer ITIMER_REAL (pytest-timeout's) is
    put back with what it had left; the backstop kills the process if no handler can run."""
    def expire(signum, frame):
        raise CaseTimeout(f"no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 0.001))


def cancel_background() -> None:
    """Cancel every task of the event loops the libraries run I/O on (fsspec's, s3fs instances',
    zarr-python's): the main thread left a mode cut short, but a task it waited on (a few billion
    range requests) would go on allocating and requesting in the background, for every later case."""
    import asyncio

    loops = set()
    with contextlib.suppress(Exception):
        import fsspec.asyn

        loops.add(fsspec.asyn.loop[0])
    with contextlib.suppress(Exception):
        import s3fs

        loops.update(fs.loop for fs in s3fs.S3FileSystem._cache.values())
    with contextlib.suppress(Exception):
        import zarr.core.sync

        loops.add(zarr.core.sync.loop[0])
    for loop in loops:
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(lambda loop=loop: [t.cancel() for t in asyncio.all_tasks(loop)])
    time.sleep(0.1)


def start_tracing() -> bool:
    """tracemalloc on (one frame: the cheapest); True when this call started it."""
    if tracemalloc.is_tracing():
        return False
    tracemalloc.start(1)
    return True


# ---- one case -----------------------------------------------------------------------------------------

@dataclasses.dataclass
class ModeResult:
    mode: str                   # "fast" | "slow" | "verify"
    outcome: str                # "same" | "refused" | "failed"
    error: str = ""             # the exception's class ("" when none)
    message: str = ""
    where: str = ""             # the frame that raised (deepspec's innermost, else the last)
    failures: list[str] = dataclasses.field(default_factory=list)   # property failures: "class: detail"
    peak: int = 0               # tracemalloc peak over the mode's start, bytes
    seconds: float = 0.0


@dataclasses.dataclass
class Outcome:
    case: Case
    applied: list[str]
    results: list[ModeResult]
    seconds: float

    @property
    def failures(self) -> list[str]:
        return [f"{r.mode}: {f}" for r in self.results for f in r.failures]

    @property
    def summary(self) -> str:
        """The fast mode's outcome, for the table: "same", "refused <Error>" or "failed"."""
        r = self.results[0]
        return "failed" if r.failures else "same" if r.outcome == "same" else f"refused {r.error}"

    def report(self) -> str:
        p = self.case.pristine
        lines = [f"{p.backend}/{p.variant}: {len(self.case.mutations)} mutation(s)"]
        lines += [f"  {m}  [{a}]" for m, a in zip(self.case.mutations, self.applied)]
        for r in self.results:
            head = f"  {r.mode}: {r.outcome}" + (f" {r.error}: {r.message[:300]}" if r.error else "")
            lines.append(head + (f"  (raised at {r.where})" if r.where and r.failures else ""))
            lines += [f"    PROPERTY FAILURE {f}" for f in r.failures]
        return "\n".join(lines)


def raised_at(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if f"{os.sep}deepspec{os.sep}" in f.filename and "site-packages" not in f.filename]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return ""
    name = os.path.relpath(frame.filename, REPO) if frame.filename.startswith(str(REPO)) else \
        frame.filename.split("site-packages/")[-1]
    return f"{name}:{frame.lineno} in {frame.name}"


def read_mode(place: Place, p: Pristine, mode: str) -> str | None:
    """Read the case's store in `mode`; None when it gave the pristine samples, else what differs."""
    from deepspec.cache.read.reader import CacheReader

    if mode == "verify":
        from deepspec.cache.tools.verify import verify

        got = verify(place.url, place.options)
        return None if got.get("ok") and got.get("samples") == len(p.samples) else f"verify returned {short(got)}"
    reader = CacheReader(place.url, place.options, fast=mode == "fast")
    try:
        n = len(reader)
        if n != len(p.samples):
            return f"{n} samples where the store has {len(p.samples)}"
        for k in range(n):
            why = differs(p.samples[k], reader.read(k))
            if why:
                return f"sample {k}: {why}"
            if reader.sample_id(k) != p.ids[k]:
                return f"sample {k}: id {reader.sample_id(k):#x} where it is {p.ids[k]:#x}"
        return None
    finally:
        close_reader(reader)


def run_mode(place: Place, p: Pristine, mode: str, bound: int, roots: tuple[str, ...]) -> ModeResult:
    result = ModeResult(mode, "same")
    timeout = TIMEOUT_S3_S if p.remote else TIMEOUT_LOCAL_S
    RECORDER.opened.clear()
    RECORDER.s3.clear()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    try:
        with time_limit(timeout):
            RECORDER.active = True
            try:
                why = read_mode(place, p, mode)
            finally:
                RECORDER.active = False
        if why:
            result.outcome = "failed"
            result.failures.append(f"different-samples: {why}")
    except CaseTimeout as e:
        result.outcome, result.error, result.message = "failed", "CaseTimeout", str(e)
        result.where = raised_at(e)
        result.failures.append(f"hang: {e}")
        cancel_background()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - every other exception is the property's to judge
        result.error, result.message, result.where = type(e).__name__, str(e), raised_at(e)
        if isinstance(e, CacheFormatError):
            result.outcome = "refused"
            if not any(name in result.message for name in place.names()):
                result.failures.append(f"message-without-store: {type(e).__name__}: {result.message[:200]}")
        else:
            result.outcome = "failed"
            result.failures.append(f"wrong-exception: {type(e).__name__}: {result.message[:200]}")
    finally:
        RECORDER.active = False
        result.seconds = time.perf_counter() - start
        place.release_fifos()
    result.peak = tracemalloc.get_traced_memory()[1] - base
    if result.peak > bound:
        result.failures.append(f"memory: peak {result.peak / 2**20:.1f} MiB over the {bound / 2**20:.0f} MiB bound")
    store = None if p.remote else place.url
    bad = outside(RECORDER.opened, store, roots) + (s3_outside(RECORDER.s3, place.url) if p.remote else [])
    if bad:
        result.failures.append("read-outside: " + "; ".join(bad[:5]) + (f" (+{len(bad) - 5})" if len(bad) > 5 else ""))
    return result


def scratch(prefix: str) -> str:
    """A fresh directory for pristine stores and case copies: on tmpfs (/dev/shm) where there is one,
    since a case creates and removes ~50 directories and rmdir costs ~1.5 ms each on an overlay disk."""
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=where)


class Harness:
    """Runs cases: where local copies go, the S3 bucket and client for remote ones."""

    def __init__(self, work: str, s3_client=None, bucket: str | None = None):
        self.work = work
        self.client, self.bucket = s3_client, bucket
        self.copies: dict[tuple[str, str], S3Place] = {}
        self.roots = library_roots()
        install_recorders()
        self.started_tracing = start_tracing()

    def close(self) -> None:
        uninstall_recorders()
        if self.started_tracing:
            tracemalloc.stop()

    @contextlib.contextmanager
    def place(self, p: Pristine) -> Iterator[Place]:
        if p.remote:
            key = (p.backend, p.variant)
            if key not in self.copies:
                self.copies[key] = S3Place(p, self.client, self.bucket)
            place: Place = self.copies[key]
            forget_listings()
        else:
            place = LocalPlace(tempfile.mkdtemp(prefix="case-", dir=self.work), p)
        try:
            yield place
        finally:
            place.close()

    def run(self, case: Case) -> Outcome:
        p = case.pristine
        start = time.perf_counter()
        with self.place(p) as place:
            applied = [apply(place, p, m) for m in case.mutations]
            bound = MEMORY_BOUND
            for m, a in zip(case.mutations, applied):
                if m.kind == "huge_object" and a == "applied":
                    bound = min(bound, huge_size(m.key) // 4)
            results = [run_mode(place, p, mode, bound, self.roots) for mode in case.modes]
        return Outcome(case, applied, results, time.perf_counter() - start)


# ---- summaries ----------------------------------------------------------------------------------------

def failure_class(f: str) -> str:
    """"fast: wrong-exception: OverflowError: ..." -> "wrong-exception OverflowError"."""
    body = f.split(": ", 1)[1]
    kind, rest = body.split(": ", 1) if ": " in body else (body, "")
    if kind in ("wrong-exception", "message-without-store"):
        return f"{kind} {rest.split(':', 1)[0]}"
    return kind


def file_class(key: str) -> str:
    """A store key with its part, layer and index names folded: parts/<part>/hidden/<l>/c/0/0."""
    import re

    key = re.sub(r"p\d{6}|p[0-9a-f]{24}", "<part>", key)
    key = re.sub(r"index/[0-9a-f]{16}", "index/<h>", key)
    key = re.sub(r"(hidden|scale)/(-?\d+|last)", r"\1/<l>", key)
    return key


def failure_groups(outcomes: list[Outcome]) -> dict[tuple[str, str], list[Outcome]]:
    """Property failures by (class, where raised) -> their outcomes, fewest applied mutations first
    (the clearest example of a group comes first)."""
    out: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        for r in o.results:
            for f in r.failures:
                group = out.setdefault((failure_class(f"{r.mode}: {f}"), r.where), [])
                if not any(x is o for x in group):
                    group.append(o)
    for outs in out.values():
        outs.sort(key=lambda o: sum(a == "applied" for a in o.applied))
    return dict(sorted(out.items(), key=lambda kv: -len(kv[1])))


def format_groups(groups: dict[tuple[str, str], list[Outcome]], examples: int = 1) -> str:
    """Each failure group: its class, where it was raised, the mutation kinds and files of its cases
    and `examples` whole cases."""
    import collections

    lines = []
    for (cls, where), outs in groups.items():
        applied = [m for o in outs for m, a in zip(o.case.mutations, o.applied) if a == "applied"]
        kinds = collections.Counter(m.kind for m in applied)
        files = collections.Counter(file_class(m.key) for m in applied)
        backends = collections.Counter(o.case.pristine.backend for o in outs)
        lines.append(f"## {cls}  at {where or '-'}: {len(outs)} case(s) "
                     f"[{', '.join(f'{b} {n}' for b, n in backends.items())}]")
        lines.append(f"   kinds: {', '.join(f'{k} {n}' for k, n in kinds.most_common(8))}")
        lines.append(f"   files: {', '.join(f'{k} {n}' for k, n in files.most_common(6))}")
        lines += ["   " + o.report().replace("\n", "\n   ") for o in outs[:examples]]
    return "\n".join(lines)
