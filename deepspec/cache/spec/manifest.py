"""The root manifest as a typed object (docs/cache-format.md §3): `Manifest`, its `PartEntry` list of
committed parts, the storage kinds a manifest may name, and `manifest_mismatch`, the comparison of
the content fields that decides whether a store holds what a run wants. Every backend reads and
writes it (backend.CacheStore); the reader, the writer and derive compare manifests with it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import ClassVar

from deepspec.cache.spec.format import (CODECS, CONTENT_KEYS, DTYPES, FORMAT, FORMAT_VERSION, INDEX_COLUMNS,
                                   INDEX_COLUMNS_V2, INDEX_KEY, PART_NAME, READ_VERSIONS, CacheFormatError)

STORAGES = ("zarr", "hdf5")
# bounds on what a manifest may declare, checked before anything is sized from it (a store is input
# written by someone else: a teammate's lake, a pulled or unpacked cache)
MAX_COUNT = 2**48          # samples or tokens of a part, bytes of an index
MAX_HIDDEN = 2**20
MAX_LAYER = 2**16


def _int(value, field: str, where: str, low: int = 0, high: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CacheFormatError(f"{where}manifest field {field}: {value!r} is not an integer in [{low}, {high}]")
    return value


def _checked_parts(parts, where: str) -> list["PartEntry"]:
    if not isinstance(parts, list):
        raise CacheFormatError(f"{where}manifest field parts: a list expected, got {type(parts).__name__}")
    out, seen = [], set()
    for k, p in enumerate(parts):
        field_ = f"parts[{k}]"
        if not isinstance(p, dict) or set(p) - {"name", "samples", "tokens", "chunk_index"}:
            raise CacheFormatError(f"{where}manifest field {field_}: not a part entry ({str(p)[:80]})")
        name = p.get("name")
        if not isinstance(name, str) or not PART_NAME.fullmatch(name):
            raise CacheFormatError(f"{where}manifest field {field_}.name: {str(name)[:80]!r} is not a part name "
                                   "(p + 6 digits or p + 24 hex digits)")
        if name in seen:
            raise CacheFormatError(f"{where}manifest field {field_}.name: part {name} is listed twice")
        seen.add(name)
        samples = _int(p.get("samples"), f"{field_}.samples", where)
        tokens = _int(p.get("tokens"), f"{field_}.tokens", where)
        if tokens < samples:
            raise CacheFormatError(f"{where}manifest field {field_}: {samples} samples in {tokens} tokens")
        where_ = p.get("chunk_index")
        if where_ is not None:
            if not isinstance(where_, list) or len(where_) != 3:
                raise CacheFormatError(f"{where}manifest field {field_}.chunk_index: (offset, nbytes, crc32c) expected")
            where_ = [_int(v, f"{field_}.chunk_index", where, high=2**62) for v in where_]
        out.append(PartEntry(name, samples, tokens, where_))
    return out


def _checked_index(index, samples: int, where: str) -> dict | None:
    if index is None:
        return None
    if not isinstance(index, dict):
        raise CacheFormatError(f"{where}manifest field index: an object expected")
    key = index.get("key")
    if not isinstance(key, str) or not INDEX_KEY.fullmatch(key):
        raise CacheFormatError(f"{where}manifest field index.key: {str(key)[:80]!r} is not an index key of a store "
                               "(index/<16 hex digits>/c/0/0, index/<16 hex digits>.h5, index/c/0/0 or index.h5)")
    columns = list(index.get("columns", INDEX_COLUMNS_V2))
    if columns not in (list(INDEX_COLUMNS_V2), list(INDEX_COLUMNS)):
        raise CacheFormatError(f"{where}manifest field index.columns: {columns} are neither "
                               f"{list(INDEX_COLUMNS_V2)} nor {list(INDEX_COLUMNS)}")
    n = _int(index.get("samples"), "index.samples", where)
    if n != samples:
        raise CacheFormatError(f"{where}manifest field index.samples: {n}, but its parts hold {samples} samples")
    nbytes = _int(index.get("nbytes"), "index.nbytes", where)
    if nbytes != 8 * len(columns) * n:
        raise CacheFormatError(f"{where}manifest field index.nbytes: {nbytes}; an index of {n} samples is "
                               f"{8 * len(columns) * n} bytes")
    _int(index.get("offset"), "index.offset", where)
    _int(index.get("crc32c"), "index.crc32c", where, high=2**32 - 1)
    return dict(index)


@dataclass
class PartEntry:
    """One committed part as the manifest lists it. `chunk_index` (HDF5 only): byte offset, length
    and crc32c of the part file's chunk table (docs/cache-format.md §11)."""
    name: str
    samples: int
    tokens: int
    chunk_index: list[int] | None = None

    def to_dict(self) -> dict:
        d = {"name": self.name, "samples": int(self.samples), "tokens": int(self.tokens)}
        if self.chunk_index is not None:
            d["chunk_index"] = [int(v) for v in self.chunk_index]
        return d


@dataclass
class Manifest(Mapping):
    """The root manifest (docs/cache-format.md §3). Keys this version does not know are kept in
    `extra` and written back unchanged. Read-only mapping access (`m["layers"]`, `m.get(...)`) gives
    the JSON form, for code that only reads fields.

    `consolidated` (format v2): true when `parts` and the per-sample `index` describe the store; a
    store a writer is adding parts to (or was, until it was killed) is not, and its parts are found
    by listing (CacheStore.read_manifest does). A v1 manifest always lists its parts; a v3 manifest
    always does too (a writer adds parts beside the listed ones and switches the root once, §7)."""
    target: dict
    layers: list[int]
    dtype: str
    codec: str = "none"
    max_length: int = 0
    chunk_tokens: int = 64
    hidden_size: int = 0
    bytes_per_token: int | None = None
    storage: str = "zarr"
    parts: list[PartEntry] = field(default_factory=list)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    consolidated: bool = True
    index: dict | None = None  # {"key", "offset", "nbytes", "crc32c", "samples", "columns"} (v2)
    extra: dict = field(default_factory=dict)

    _KNOWN: ClassVar[tuple[str, ...]] = ()

    @property
    def num_samples(self) -> int:
        return sum(p.samples for p in self.parts)

    @property
    def num_tokens(self) -> int:
        return sum(p.tokens for p in self.parts)

    @classmethod
    def from_dict(cls, d: Mapping, url: str = "") -> "Manifest":
        """A manifest as stored; refuses another format or version, naming the store."""
        d = dict(d)
        where = f"{url}: " if url else ""
        if d.get("format", FORMAT) != FORMAT:
            raise CacheFormatError(f"{where}not a deepspec cache (format attribute is {d.get('format')!r})")
        if d.get("format_version", FORMAT_VERSION) not in READ_VERSIONS:
            raise CacheFormatError(f"{where}format_version {d.get('format_version')} is not supported "
                                   f"(this reader knows {', '.join(map(str, READ_VERSIONS))})")
        names = {f.name for f in fields(cls)} - {"extra"}
        missing = [k for k in ("target", "layers", "dtype") if k not in d]
        if missing:
            raise CacheFormatError(f"{where}manifest lacks {missing}")
        known = {k: d.pop(k) for k in list(d) if k in names}
        d.pop("num_samples", None)
        d.pop("num_tokens", None)
        # every field a reader sizes, opens or names a path by is checked here, once, with its name
        known["parts"] = _checked_parts(known.get("parts", []), where)
        layers = known["layers"]
        if not isinstance(layers, list) or not layers or len(set(map(str, layers))) != len(layers):
            raise CacheFormatError(f"{where}manifest field layers: {str(layers)[:80]} is not a list of distinct layer ids")
        known["layers"] = [_int(i, "layers", where, low=-1, high=MAX_LAYER) for i in layers]
        if known["dtype"] not in DTYPES:
            raise CacheFormatError(f"{where}manifest field dtype: {known['dtype']!r} (known: {list(DTYPES)})")
        if known.get("codec", "none") not in CODECS:
            raise CacheFormatError(f"{where}manifest field codec: {known['codec']!r} (known: {list(CODECS)})")
        for key, low, high in (("hidden_size", 0, MAX_HIDDEN), ("chunk_tokens", 1, 2**30), ("max_length", 0, 2**40)):
            if key in known:
                known[key] = _int(known[key], key, where, low, high)
        if int(known.get("format_version", FORMAT_VERSION)) < 2:
            known["consolidated"], known["index"] = True, None  # v1: the parts list is the store
        if known.get("storage", "zarr") not in STORAGES:
            raise CacheFormatError(f"{where}unknown storage {known['storage']!r} (known: {list(STORAGES)})")
        known["index"] = _checked_index(known.get("index"), sum(p.samples for p in known["parts"]), where)
        return cls(**known, extra=d)

    def to_dict(self) -> dict:
        d = dict(self.extra)
        for f in fields(self):
            if f.name in ("extra", "parts"):
                continue
            v = getattr(self, f.name)
            if f.name == "storage" and v == "zarr":
                continue  # a Zarr store's manifest is what it was before backends existed
            if f.name == "consolidated" and self.format_version < 2:
                continue
            if v is not None:
                d[f.name] = v
        d["parts"] = [p.to_dict() for p in self.parts]
        d["num_samples"], d["num_tokens"] = self.num_samples, self.num_tokens
        return d

    def stored_dict(self) -> dict:
        """What a writer stores: a manifest that is not consolidated holds the content fields only,
        so marking a store as being written costs O(1) bytes whatever its number of parts."""
        d = self.to_dict()
        if not self.consolidated:
            for k in ("parts", "num_samples", "num_tokens", "index"):
                d.pop(k, None)
        return d

    def content(self) -> dict:
        return {k: v for k, v in self.to_dict().items()
                if k not in ("parts", "num_samples", "num_tokens", "consolidated", "index")}

    # read-only mapping view of the JSON form: a field is read in O(1) (only `parts` lists every part)
    def __getitem__(self, key: str):
        if key == "storage":
            return self.storage
        if key in self.extra:
            return self.extra[key]
        if key == "parts":
            return [p.to_dict() for p in self.parts]
        if key in ("num_samples", "num_tokens"):
            return getattr(self, key)
        if key in _FIELDS and key != "extra":
            value = getattr(self, key)
            if value is None or (key == "consolidated" and self.format_version < 2):
                raise KeyError(key)
            return value
        raise KeyError(key)

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def _keys(self) -> list[str]:
        """to_dict()'s keys, without building it."""
        keys = list(self.extra)
        for f in fields(self):
            if f.name in ("extra", "parts") or f.name in self.extra:
                continue
            if (f.name == "storage" and self.storage == "zarr") or \
                    (f.name == "consolidated" and self.format_version < 2) or getattr(self, f.name) is None:
                continue
            keys.append(f.name)
        return keys + [k for k in ("parts", "num_samples", "num_tokens") if k not in keys]


def manifest_mismatch(old: dict, new: dict) -> str | None:
    """First differing content field, spelled as a key path, or None when the store is compatible."""
    for key in CONTENT_KEYS:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(set(a) | set(b)):
                if sub != "id" and a.get(sub) != b.get(sub):
                    return f"{key}.{sub}: store has {a.get(sub)!r}, expected {b.get(sub)!r}"
        elif a != b:
            return f"{key}: store has {a!r}, expected {b!r}"
    return None


_FIELDS = frozenset(f.name for f in fields(Manifest))
