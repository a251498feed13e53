"""The root manifest as a typed object (docs/cache-format.md §3): `Manifest`, its `PartEntry` list of
committed parts, the storage kinds a manifest may name, and `manifest_mismatch`, the comparison of
the content fields that decides whether a store holds what a run wants. Every backend reads and
writes it (backend.CacheStore); the reader, the writer and derive compare manifests with it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import ClassVar

from deepspec.cache.format import CONTENT_KEYS, FORMAT, FORMAT_VERSION, READ_VERSIONS, CacheFormatError

STORAGES = ("zarr", "hdf5")


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
        known["parts"] = [PartEntry(**p) for p in known.get("parts", [])]
        known["layers"] = [int(i) for i in known["layers"]]
        if int(known.get("format_version", FORMAT_VERSION)) < 2:
            known["consolidated"], known["index"] = True, None  # v1: the parts list is the store
        if known.get("storage", "zarr") not in STORAGES:
            raise CacheFormatError(f"{where}unknown storage {known['storage']!r} (known: {list(STORAGES)})")
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

    # read-only mapping view of the JSON form
    def __getitem__(self, key: str):
        if key == "storage":
            return self.storage
        return self.to_dict()[key]

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


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
