"""The store interface: what the reader, `verify`, `info` and the loader need from a backend
(`CacheStore`), and what the writer needs besides (`WritableStore`).

A backend (`zarr_store.ZarrStore`, `hdf5_store.HDF5Store`, read-only; `zarr_write.ZarrStoreWriter`,
`hdf5_write.HDF5StoreWriter`, their write side) knows its own layout on disk; everything
above it (part packing, the lease, commit/resume/growth/multi-rank rules, the loader's byte-range
fast path, checksums) is shared. `tests/cache/test_conformance.py` runs one suite against every
backend. The manifest travels as a typed `Manifest` (manifest.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from deepspec.cache.spec.format import FORMAT, INDEX_COLUMNS, INDEX_COLUMNS_V2, CacheFormatError, key_from_str, parsing
from deepspec.cache.spec.manifest import Manifest, PartEntry


@dataclass
class ArrayLayout:
    """What the byte-range fast path needs to know about one array of one part: the file holding it,
    and where each chunk is. Zarr keeps the chunk table at the end of the shard file (read lazily,
    `table is None`); HDF5 records it when the part commits (`table` given)."""
    key: str                 # store key of the file holding the array
    dtype: np.dtype
    shape: tuple[int, ...]
    chunk_rows: int
    n_chunks: int
    blosc: bool
    row_bytes: int = 0
    checksum: str = "crc32c"             # per-chunk trailer: "crc32c" (Zarr) or "fletcher32" (HDF5)
    table: np.ndarray | None = None      # [n_chunks, 2] (offset, nbytes), trailer included
    crcs: np.ndarray | None = None       # HDF5: crc32c of each chunk's bytes before its trailer
    crc_table: bool = False              # Zarr v4: no trailers; the crc32cs are in a table before the index
    name: str = ""                       # "parts/<part>: <array>", for error messages

    @property
    def trailer(self) -> int:
        """Bytes after each chunk's body: its checksum, unless the crc32cs are in the table."""
        return 0 if self.crc_table else 4

    @property
    def suffix_bytes(self) -> int:
        """Bytes at the end of a Zarr shard that locate and check its chunks: the index (16 bytes a
        chunk) and its crc32c, after the crc32c table (4 bytes a chunk) and its crc32c in v4."""
        return 16 * self.n_chunks + 4 + (4 * self.n_chunks + 4 if self.crc_table else 0)


@dataclass
class ArraySpec:
    """One array a writer hands to a backend: its values and its chunking. A streamed array has no
    `data`: its `shape` and `dtype` are given, and its rows arrive in order from the part's feed."""
    name: str
    data: np.ndarray | None
    chunk_rows: int
    codec: str = "none"
    shape: tuple | None = None
    dtype: np.dtype | None = None

    def __post_init__(self):
        if self.data is not None:
            self.shape, self.dtype = tuple(self.data.shape), self.data.dtype


class CacheStore(ABC):
    """One store on local disk or an object store. Construction opens nothing expensive."""

    kind: ClassVar[str]
    layout_entries: ClassVar[frozenset[str]]  # what the store root holds besides the lease
    writable: ClassVar[bool] = False  # WritableStore: a store not created yet reads as empty

    def __init__(self, url: str, storage_options: dict | None = None):
        from deepspec.cache.storage.urls import is_remote

        self.url = url
        self.storage_options = storage_options
        self.remote = is_remote(url)

    # ---- manifest ----------------------------------------------------------------------------
    @abstractmethod
    def root_attrs(self) -> dict:
        """The stored manifest as raw JSON ({} when the store is new)."""

    def read_manifest(self) -> Manifest:
        """The manifest; a store that was never consolidated (a writer is adding parts, or was
        killed before it consolidated) gets its parts by listing the committed parts, in name order."""
        attrs = self.root_attrs()
        if not isinstance(attrs, dict) or attrs.get("format") != FORMAT:
            got = attrs.get("format") if isinstance(attrs, dict) else type(attrs).__name__
            raise CacheFormatError(f"{self.url}: not a deepspec cache (format attribute is {got!r})")
        m = Manifest.from_dict(attrs, self.url)
        self._listed = None
        if not m.consolidated:
            listed = self.committed_parts()
            bad = [f"{n} ({a['damaged']})" for n, a in listed.items() if "damaged" in a]
            if bad:
                raise CacheFormatError(f"{self.url}: committed part {bad[0]} cannot be read")
            m.parts = [entry_of(n, a, f"{self.url}: ") for n, a in listed.items()]
            self._listed = index_rows(m.parts, {n: self.part_rows(n, a) for n, a in listed.items()},
                                      keys=m.format_version >= 3)
        return m

    def open_index(self, manifest: Manifest) -> np.ndarray | None:
        """The per-sample index [samples, 4] (INDEX_COLUMNS) of `manifest`: the consolidated array
        (one ranged read), or the one built while listing an unconsolidated store; None for a v1
        store (its parts' offsets and sample ids are read part by part)."""
        if manifest.index is not None:
            return self.read_index(manifest.index)
        if not manifest.consolidated:
            return getattr(self, "_listed", None)
        return None

    def read_index(self, desc: dict) -> np.ndarray:
        """The index rows [samples, 4 (v2) or 6 (v3)] the descriptor names, checked."""
        from crc32c import crc32c

        n, key = int(desc["samples"]), desc["key"]
        columns = list(desc.get("columns", INDEX_COLUMNS_V2))
        if columns not in (list(INDEX_COLUMNS_V2), list(INDEX_COLUMNS)):
            raise CacheFormatError(f"{self.url}: index columns {columns} are neither {list(INDEX_COLUMNS_V2)} "
                                   f"nor {list(INDEX_COLUMNS)}")
        width = 8 * len(columns)
        if int(desc["nbytes"]) != width * n:
            raise CacheFormatError(f"{self.url}: {key}: index of {n} samples must be {width * n} bytes, "
                                   f"manifest says {desc['nbytes']}")
        if n == 0:
            return np.zeros((0, len(columns)), dtype=np.uint64)
        start = int(desc["offset"])
        raw = self.read_range(key, start, start + width * n)
        if crc32c(raw) != int(desc["crc32c"]):
            raise CacheFormatError(f"{self.url}: {key}: index checksum mismatch (corrupt bytes)")
        return np.frombuffer(raw, dtype="<u8").reshape(n, len(columns)).astype(np.uint64)

    @abstractmethod
    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of one store key, in one request."""

    @abstractmethod
    def index_keys(self) -> list[str]:
        """The names of the index objects the store holds (a local writer deletes those no manifest uses)."""

    @abstractmethod
    def index_key(self, name: str) -> str:
        """The store key of index object `name` (what a manifest's index descriptor names)."""

    def part_rows(self, name: str, attrs: dict) -> "PartRows":
        """(lengths, sample ids, keys) of a committed part: from its commit record when that carries
        them (a v2/v3 Zarr part), else read from its `offsets`, `sample_id` and `sample_key` arrays.
        `keys` is None for a part written before v3."""
        if "lengths" in attrs and "sample_ids" in attrs:
            with parsing(f"{self.url}: parts/{name}: commit record"):
                return record_rows(attrs, entry_of(name, attrs, f"{self.url}: "))
        entry = entry_of(name, attrs, f"{self.url}: ")
        offsets = np.asarray(self.read_slow(entry, "offsets", 0, entry.samples + 1), dtype=np.int64)
        ids = np.asarray(self.read_slow(entry, "sample_id", 0, entry.samples), dtype=np.uint64)
        keys = None
        if self.has_array(entry, "sample_key"):
            keys = np.asarray(self.read_slow(entry, "sample_key", 0, entry.samples), dtype=np.uint64).reshape(-1, 2)
        return PartRows(np.diff(offsets), ids, keys)

    def has_array(self, part: "PartEntry", array: str) -> bool:
        try:
            self.array_rows(part, array)
            return True
        except (CacheFormatError, KeyError):
            return False

    # ---- listing -----------------------------------------------------------------------------
    @abstractmethod
    def committed_parts(self) -> dict[str, dict]:
        """Committed part name -> {"samples", "tokens", "rank", ...}, by name."""

    def part_committed(self, name: str) -> bool:
        """Part `name` is committed (readable from now on), asked of that part alone (a reader waiting
        for another process's commit asks this, not for the listing of a large store)."""
        return name in self.committed_parts()

    # ---- reading -----------------------------------------------------------------------------
    @abstractmethod
    def layout(self, part: PartEntry, array: str) -> ArrayLayout | None:
        """The fast path's view of an array, or None when it must be read through the library."""

    @abstractmethod
    def read_slow(self, part: PartEntry, array: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) through the backend's own library (zarr-python / h5py)."""

    @abstractmethod
    def array_rows(self, part: PartEntry, array: str) -> int: ...

    @abstractmethod
    def computed_by(self, name: str) -> str | None:
        """The fingerprint part `name`'s commit record names (docs/cache-format.md §7), or None: one
        small read of that part alone."""

    @abstractmethod
    def declared(self, part: PartEntry, array: str) -> tuple[np.dtype, tuple]:
        """The dtype and shape a part's array declares in the store (the reader checks them against the manifest)."""


class WritableStore(CacheStore):
    """A store a writer creates, adds parts to, consolidates and prunes (CacheWriter); the reading
    side is CacheStore's. Commit, resume and pruning rules: docs/cache-format.md §7."""

    writable = True
    # threads a streamed part's arrays may be written on at once (CacheWriter's `threads`); a
    # backend that writes a part as one file (HDF5) writes it on one
    write_threads = 1

    @abstractmethod
    def write_index(self, rows: np.ndarray) -> dict:
        """Write the consolidated index `rows` (uint64 [samples, 6], INDEX_COLUMNS) as a new object
        named by its content (an index is never overwritten: a manifest recorded elsewhere keeps
        pointing at the rows it was written with); returns its manifest descriptor
        {"key", "offset", "nbytes", "crc32c", "samples", "columns"}."""

    @abstractmethod
    def delete_index(self, name: str) -> None: ...

    @abstractmethod
    def write_manifest(self, manifest: Manifest) -> None:
        """Replace the root manifest (Manifest.stored_dict) in one atomic, durable step."""

    # ---- listing, debris, damage -------------------------------------------------------------
    def refuse_links_out(self) -> None:
        """A local store whose parts/ or index directory is a symlink out of it would get its new
        parts written wherever that points (and the reader, refusing links out, could not read them):
        refused, naming the link. Not even into the DVC cache, which holds files, never these."""
        if self.remote:
            return
        import os

        from deepspec.cache.storage.door import resolve
        from deepspec.cache.storage.urls import local_path

        root = os.fspath(local_path(self.url))
        for name in sorted(self.layout_entries):
            if os.path.isdir(os.path.join(root, name)):
                resolve(root, name, roots=(os.path.realpath(root),))

    @abstractmethod
    def refuse_foreign(self, keep: set[str]) -> None:
        """Raise CacheFormatError unless the location is empty or holds this kind of cache."""

    @abstractmethod
    def prune_debris(self, keep: set[str]) -> None:
        """Delete whatever an interrupted writer leaves: temp files, uncommitted parts, unknown entries."""

    @abstractmethod
    def part_damage(self, name: str, arrays: list[str]) -> str | None:
        """Why a committed part of a local store cannot be trusted (cheap, no full read), or None."""

    @abstractmethod
    def delete_part(self, name: str) -> None: ...

    @abstractmethod
    def delete_all(self) -> None:
        """Delete the store's manifest and every part (a stale local store, or a switch of backend)."""

    @abstractmethod
    def write_part(self, name: str, arrays: list[ArraySpec], attrs: dict, rank: int, lease,
                   before=None, feed=None) -> PartEntry:
        """Create the part (never over an existing one: PartConflict), write every array, make it
        durable and commit it; `lease.check()` is called right before the commit. `before(part)`, if
        given, runs once the part exists and before its arrays are written: a derive links the
        arrays it keeps from its source there (Zarr only; other backends refuse it). The rows of the
        arrays without `data` come from `feed`, an iterable of {array name: rows}, in order."""

    def write_part_deferred(self, name: str, arrays: list[ArraySpec], attrs: dict, rank: int, lease,
                            before=None, feed=None):
        """write_part in two steps: every array is written now; the returned call makes the part
        durable, checks the lease and commits it, returning its PartEntry (the writer runs it on
        another thread while the next part is written); its `discard()`, where it has one, drops
        what the first step wrote when the commit will not run. A backend without the split does
        all of it in the first step."""
        entry = self.write_part(name, arrays, attrs, rank, lease, before=before, feed=feed)
        return lambda: entry


@dataclass
class PartRows:
    """What the consolidated index holds of one part: its samples' lengths, ids and content keys
    (uint64 [n, 2]; None for a part written before format v3)."""
    lengths: np.ndarray
    sample_ids: np.ndarray
    keys: np.ndarray | None = None

    def __iter__(self):  # (lengths, ids) unpacking, as older callers read it
        return iter((self.lengths, self.sample_ids))


def entry_of(name: str, attrs: dict, where: str = "") -> PartEntry:
    """A part's manifest entry from its commit record (CacheStore.committed_parts)."""
    with parsing(f"{where}parts/{name}: commit record"):
        return PartEntry.of(name, attrs["samples"], attrs["tokens"], attrs.get("chunk_index"), where)


def record_rows(attrs: dict, entry: PartEntry) -> PartRows:
    """A commit record's lengths, sample ids (ints, or hex strings) and keys, each checked for its
    type and range (a length of 2**64 - 5 must not become -5) before any is used."""
    lengths, ids, keys = attrs["lengths"], attrs["sample_ids"], attrs.get("keys")
    for field, values in (("lengths", lengths), ("sample_ids", ids), ("keys", keys)):
        if values is not None and (not isinstance(values, (list, np.ndarray)) or len(values) != entry.samples):
            raise ValueError(f"{field}: not a list of its {entry.samples} samples")
    if any(type(v) is not int and not isinstance(v, np.integer) or not 1 <= v <= entry.tokens for v in lengths):
        raise ValueError(f"lengths: not all whole numbers in [1, {entry.tokens}]")
    ids = [int(v, 16) if isinstance(v, str) else v for v in ids]
    if any(type(v) is not int and not isinstance(v, np.integer) or not 0 <= v < 2**64 for v in ids):
        raise ValueError("sample_ids: not all 64-bit ids")
    if keys is not None:
        keys = np.asarray([key_from_str(k) if isinstance(k, str) else k for k in keys], dtype=np.uint64).reshape(-1, 2)
    return PartRows(np.asarray(lengths, dtype=np.int64), np.asarray(ids, dtype=np.uint64), keys)


def index_rows(parts: list[PartEntry], rows: dict[str, PartRows], keys: bool = True) -> np.ndarray:
    """The consolidated index (docs/cache-format.md §3.1): one row per sample in global order,
    (part position in `parts`, first row in the part, length, sample id[, key hi, key lo]), uint64.
    With `keys` (v3) every part must carry its samples' keys."""
    width = len(INDEX_COLUMNS) if keys else len(INDEX_COLUMNS_V2)
    blocks = []
    for k, p in enumerate(parts):
        r = rows[p.name]
        lengths, ids = r.lengths, r.sample_ids
        if len(lengths) != p.samples or len(ids) != p.samples or int(np.sum(lengths)) != p.tokens:
            raise CacheFormatError(f"parts/{p.name}: its commit record says {p.samples} samples, {p.tokens} tokens; "
                                   f"its rows give {len(lengths)} samples, {int(np.sum(lengths))} tokens")
        block = np.empty((len(lengths), width), dtype=np.uint64)
        block[:, 0] = k
        block[:, 1] = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else []
        block[:, 2] = lengths
        block[:, 3] = ids
        if keys:
            if r.keys is None or len(r.keys) != p.samples:
                raise CacheFormatError(f"parts/{p.name}: no content keys for its samples (written before format v3)")
            block[:, 4:6] = r.keys
        blocks.append(block)
    return np.concatenate(blocks) if blocks else np.zeros((0, width), dtype=np.uint64)


def split_index(index: np.ndarray, parts: list[PartEntry], url: str = "") -> tuple[list, list, list | None]:
    """Per part: offsets int64 [n + 1], sample ids uint64 [n] and keys uint64 [n, 2] (None for a
    4-column index, v2), checked against the parts list: every length in [1, the part's tokens],
    checked as uint64 before it is cast (2**64 - 5 must not become -5). The manifest's `max_length`
    is not a bound here: a store imported or written by other code may hold longer samples."""
    counts = np.array([p.samples for p in parts], dtype=np.int64)
    if len(index) != int(counts.sum()):
        raise CacheFormatError(f"{url}: index has {len(index)} rows, the parts list {int(counts.sum())} samples")
    want = np.repeat(np.arange(len(parts), dtype=np.uint64), counts)
    if len(index) and not np.array_equal(index[:, 0], want):
        bad = int(np.flatnonzero(index[:, 0] != want)[0])
        raise CacheFormatError(f"{url}: index row {bad}: part {int(index[bad, 0])}, expected {int(want[bad])}")
    offsets, ids, keys = [], [], [] if index.shape[1] >= len(INDEX_COLUMNS) else None
    start = 0
    for p, n in zip(parts, counts):
        block = index[start:start + n]
        cap = p.tokens
        bad = np.flatnonzero((block[:, 2] < 1) | (block[:, 2] > cap))
        if len(bad):
            raise CacheFormatError(f"{url}: index row {start + int(bad[0])} (parts/{p.name}): length "
                                   f"{int(block[bad[0], 2])} is not in [1, {cap}]")
        o = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(block[:, 2].astype(np.int64), out=o[1:])
        if n and (not np.array_equal(block[:, 1].astype(np.int64), o[:-1]) or o[-1] != p.tokens):
            raise CacheFormatError(f"{url}: index rows {start}..{start + n - 1} (parts/{p.name}): offsets and "
                                   f"lengths do not tile its {p.tokens} tokens")
        offsets.append(o)
        ids.append(block[:, 3].copy())
        if keys is not None:
            keys.append(np.ascontiguousarray(block[:, 4:6]))
        start += n
    return offsets, ids, keys


def detect(url: str, storage_options: dict | None = None) -> str | None:
    """Which backend's store lives at `url` ("zarr", "hdf5"), or None when neither."""
    import fsspec

    from deepspec.cache.storage.urls import is_remote, local_path, storage_options_for

    if not is_remote(url):
        root = local_path(url)
        for kind, marker in (("zarr", "zarr.json"), ("hdf5", "manifest.json")):
            if (root / marker).exists():
                return kind
        return None
    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options))
    for kind, marker in (("zarr", "zarr.json"), ("hdf5", "manifest.json")):
        fs.invalidate_cache(root)
        if fs.exists(f"{root.rstrip('/')}/{marker}"):
            return kind
    return None


def fletcher32_matches(body, stored: bytes) -> bool:
    """HDF5's Fletcher-32 (H5checksum.c) of `body` against the 4 stored bytes (little-endian).
    Words are big-endian 16-bit pairs (an odd last byte is the high byte of a last word); sums are
    mod 65535. HDF5 may store a zero sum as 0xffff, so both sides are compared mod 65535."""
    b = np.frombuffer(body, dtype=np.uint8)
    if len(b) % 2:
        b = np.concatenate([b, np.zeros(1, np.uint8)])
    w = b.view(">u2").astype(np.int64)
    m = len(w)
    s1 = int(w.sum()) % 65535
    # sum2 = sum over i of the running sum1 = sum of w[i] * (m - i)
    s2 = int(np.dot(w, np.arange(m, 0, -1, dtype=np.int64))) % 65535
    value = int.from_bytes(stored, "little")
    return ((value >> 16) % 65535, (value & 0xFFFF) % 65535) == (s2, s1)
