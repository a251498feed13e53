"""The root manifest as a typed object (docs/cache-format.md §3): `Manifest`, its `PartEntry` list of
committed parts, the storage kinds a manifest may name, and `manifest_mismatch`, the comparison of
the content fields that decides whether a store holds what a run wants. Every backend reads and
writes it (backend.CacheStore); the reader, the writer and derive compare manifests with it.

Both are pydantic models, strict as the params are (no string becomes a number, no bool an int):
a store is input written by someone else (a teammate's lake, a pulled or unpacked cache), so every
field a reader sizes, opens or names a path by is checked once, here, and a refusal names the field.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from deepspec.cache.spec.format import (CODECS, CONTENT_KEYS, DTYPES, FORMAT, FORMAT_VERSION, INDEX_COLUMNS,
                                   INDEX_COLUMNS_V2, INDEX_KEY, PART_NAME, READ_VERSIONS, CacheFormatError)

STORAGES = ("zarr", "hdf5")
# bounds on what a manifest may declare, checked before anything is sized from it
MAX_COUNT = 2**48          # samples or tokens of a part, bytes of an index
MAX_HIDDEN = 2**20
MAX_LAYER = 2**16

Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


def _index_key(key: str) -> str:
    if not INDEX_KEY.fullmatch(key):
        raise ValueError("is not an index key of a store "
                         "(index/<16 hex digits>/c/0/0, index/<16 hex digits>.h5, index/c/0/0 or index.h5)")
    return key


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class PartEntry(_Strict):
    """One committed part as the manifest lists it. `chunk_index` (HDF5 only): byte offset, length
    and crc32c of the part file's chunk table (docs/cache-format.md §11)."""
    # the name's pattern and that the tokens hold the samples are checked for the whole list at once
    # (Manifest) or by `of`: a validator or pattern per part makes opening a large lake twice as slow
    name: str
    samples: Count
    tokens: Count
    chunk_index: Annotated[list[Annotated[int, Field(ge=0, le=2**62)]], Field(min_length=3, max_length=3)] | None = None

    @classmethod
    def of(cls, name: str, samples: int, tokens: int, chunk_index=None, where: str = "") -> "PartEntry":
        """An entry from a part's own commit record: checked as the manifest's are."""
        try:
            entry = cls(name=name, samples=int(samples), tokens=int(tokens),
                        chunk_index=None if chunk_index is None else [int(v) for v in chunk_index])
        except ValidationError as e:
            raise refusal(e, where, f"part {name}") from None
        why = _entry_problem(entry)
        if why:
            raise CacheFormatError(f"{where}part {name}{why[0]}: {why[1]}")
        return entry

    def to_dict(self) -> dict:
        d = {"name": self.name, "samples": self.samples, "tokens": self.tokens}
        if self.chunk_index is not None:
            d["chunk_index"] = list(self.chunk_index)
        return d


def _entry_problem(p: PartEntry) -> tuple[str, str] | None:
    """(the field's key path below the entry, what is wrong), or None."""
    if not PART_NAME.fullmatch(p.name):
        return ".name", f"{p.name[:80]!r} is not a part name (p + 6 digits or p + 24 hex digits)"
    if p.tokens < p.samples:
        return "", f"{p.samples} samples in {p.tokens} tokens"
    return None


class IndexEntry(_Strict):
    """Where the consolidated per-sample index lies (format v2, §3.1)."""
    key: Annotated[str, AfterValidator(_index_key)]
    offset: Count
    nbytes: Count
    crc32c: Annotated[int, Field(ge=0, le=2**32 - 1)]
    samples: Count
    columns: list[str] = Field(default_factory=lambda: list(INDEX_COLUMNS_V2))

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, columns: list[str]) -> list[str]:
        if columns not in (list(INDEX_COLUMNS_V2), list(INDEX_COLUMNS)):
            raise ValueError(f"neither {list(INDEX_COLUMNS_V2)} nor {list(INDEX_COLUMNS)}")
        return columns

    @model_validator(mode="after")
    def _sized_by_its_samples(self) -> "IndexEntry":
        if self.nbytes != 8 * len(self.columns) * self.samples:
            raise ValueError(f"nbytes {self.nbytes}: an index of {self.samples} samples is "
                             f"{8 * len(self.columns) * self.samples} bytes")
        return self


def refusal(e: ValidationError, where: str, what: str = "manifest") -> CacheFormatError:
    """pydantic's first complaint as a CacheFormatError naming the store, the field (as a key path:
    `parts[1].name`) and the value it refused."""
    err = e.errors(include_url=False)[0]
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    msg = err["msg"].removeprefix("Value error, ")
    shown = repr(err.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    if not loc or msg.startswith(loc):  # a check across fields or items: its message starts with the key path it names
        return CacheFormatError(f"{where}{what} field {msg}")
    return CacheFormatError(f"{where}{what} field {loc}: {shown} {msg}")


class Manifest(BaseModel, Mapping):
    """The root manifest (docs/cache-format.md §3). Keys this version does not know are kept in
    `extra` and written back unchanged. Read-only mapping access (`m["layers"]`, `m.get(...)`) gives
    the JSON form, for code that only reads fields; a field is read in O(1) (only `parts` lists
    every part).

    `consolidated` (format v2): true when `parts` and the per-sample `index` describe the store; a
    store a writer is adding parts to (or was, until it was killed) is not, and its parts are found
    by listing (CacheStore.read_manifest does). A v1 manifest always lists its parts; a v3 manifest
    always does too (a writer adds parts beside the listed ones and switches the root once, §7)."""
    model_config = ConfigDict(strict=True, extra="forbid")

    target: dict
    layers: Annotated[list[Annotated[int, Field(ge=-1, le=MAX_LAYER)]], Field(min_length=1)]
    dtype: Literal[tuple(DTYPES)]  # type: ignore[valid-type]
    codec: Literal[tuple(CODECS)] = "none"  # type: ignore[valid-type]
    max_length: Annotated[int, Field(ge=0, le=2**40)] = 0
    chunk_tokens: Annotated[int, Field(ge=1, le=2**30)] = 64
    hidden_size: Annotated[int, Field(ge=0, le=MAX_HIDDEN)] = 0
    bytes_per_token: int | None = None
    storage: Literal[STORAGES] = "zarr"
    parts: list[PartEntry] = Field(default_factory=list)
    format: Literal[FORMAT] = FORMAT
    format_version: Literal[READ_VERSIONS] = FORMAT_VERSION  # type: ignore[valid-type]
    consolidated: bool = True
    index: dict | None = None  # IndexEntry's fields, as a dict: {"key", "offset", "nbytes", "crc32c", "samples", "columns"}
    extra: dict = Field(default_factory=dict)

    @field_validator("layers")
    @classmethod
    def _distinct(cls, layers: list[int]) -> list[int]:
        if len(set(layers)) != len(layers):
            raise ValueError("is not a list of distinct layer ids")
        return layers

    @field_validator("parts")
    @classmethod
    def _named_once_and_sized(cls, parts: list[PartEntry]) -> list[PartEntry]:
        seen = set()
        for k, p in enumerate(parts):
            why = _entry_problem(p) or ((".name", f"part {p.name} is listed twice") if p.name in seen else None)
            if why:
                raise ValueError(f"parts[{k}]{why[0]}: {why[1]}")
            seen.add(p.name)
        return parts

    @field_validator("index")
    @classmethod
    def _an_index(cls, index: dict | None) -> dict | None:
        return None if index is None else IndexEntry.model_validate(index).model_dump()

    @model_validator(mode="after")
    def _index_of_these_parts(self) -> "Manifest":
        if self.index is not None and self.index["samples"] != self.num_samples:
            raise ValueError(f"index.samples: {self.index['samples']}, but its parts hold {self.num_samples} samples")
        return self

    @property
    def num_samples(self) -> int:
        return sum(p.samples for p in self.parts)

    @property
    def num_tokens(self) -> int:
        return sum(p.tokens for p in self.parts)

    @classmethod
    def from_dict(cls, d: Mapping, url: str = "") -> "Manifest":
        """A manifest as stored; refuses another format or version, or any field out of its domain,
        naming the store and the field."""
        d = dict(d)
        where = f"{url}: " if url else ""
        if d.get("format", FORMAT) != FORMAT:
            raise CacheFormatError(f"{where}not a deepspec cache (format attribute is {d.get('format')!r})")
        if d.get("format_version", FORMAT_VERSION) not in READ_VERSIONS:
            raise CacheFormatError(f"{where}format_version {d.get('format_version')} is not supported "
                                   f"(this reader knows {', '.join(map(str, READ_VERSIONS))})")
        missing = [k for k in ("target", "layers", "dtype") if k not in d]
        if missing:
            raise CacheFormatError(f"{where}manifest lacks {missing}")
        known = {k: d.pop(k) for k in list(d) if k in _FIELDS}
        d.pop("num_samples", None)
        d.pop("num_tokens", None)
        if known.get("format_version", FORMAT_VERSION) < 2:
            known["consolidated"], known["index"] = True, None  # v1: the parts list is the store
        try:
            return cls.model_validate({**known, "extra": d})
        except ValidationError as e:
            raise refusal(e, where) from None

    def to_dict(self) -> dict:
        d = dict(self.extra)
        for name in _FIELDS:
            if name == "parts":
                continue
            v = getattr(self, name)
            if name == "storage" and v == "zarr":
                continue  # a Zarr store's manifest is what it was before backends existed
            if name == "consolidated" and self.format_version < 2:
                continue
            if v is not None:
                d[name] = v
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

    # read-only mapping view of the JSON form (pydantic's own iteration yields (field, value) pairs;
    # a Manifest iterates as the mapping it shows)
    def __getitem__(self, key: str):
        if key == "storage":
            return self.storage
        if key in self.extra:
            return self.extra[key]
        if key == "parts":
            return [p.to_dict() for p in self.parts]
        if key in ("num_samples", "num_tokens"):
            return getattr(self, key)
        if key in _FIELDS:
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
        for name in _FIELDS:
            if name == "parts" or name in self.extra:
                continue
            if (name == "storage" and self.storage == "zarr") or \
                    (name == "consolidated" and self.format_version < 2) or getattr(self, name) is None:
                continue
            keys.append(name)
        return keys + [k for k in ("parts", "num_samples", "num_tokens") if k not in keys]


_FIELDS = tuple(name for name in Manifest.model_fields if name != "extra")


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

