"""The reference pipeline's cache directory (DeepSpec target cache, version 2; docs/cache-format.md
§10) as this project reads it: the 56-byte record of `samples.idx`, the manifest fields a directory
must have, and `ReferenceCache`, which validates a directory's manifest, index and shard sizes before
anything is read and then reads one record's arrays at a time. reference.py's import reads through
it; its export writes the same layout.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.storage import door

REF_VERSION = 2
RECORD = np.dtype([("sample_id", "<u8"), ("shard_id", "<u4"), ("seq_len", "<u4"),
                   ("input_ids", "<u8"), ("attention_mask", "<u8"), ("loss_mask", "<u8"),
                   ("target_hidden_states", "<u8"), ("target_last_hidden_states", "<u8")])
assert RECORD.itemsize == 56
REQUIRED = ("version", "num_samples", "num_shards", "target_layer_ids", "hidden_dtype", "token_dtype",
            "mask_dtype", "index_record_size", "hidden_size", "shards")
HIDDEN_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
SAMPLE_IDS_FILE = "deepspec_sample_ids.bin"
INDEX_BLOCK = 1 << 18  # records checked per vectorised step of the index scan


def _nbytes(seq_len: np.ndarray, hidden: int, layers: int, itemsize: int) -> dict[str, np.ndarray]:
    n = seq_len.astype(np.uint64)
    return {"input_ids": n * 4, "attention_mask": n, "loss_mask": n,
            "target_hidden_states": n * np.uint64(layers * hidden * itemsize),
            "target_last_hidden_states": n * np.uint64(hidden * itemsize)}


class ReferenceCache:
    """A validated reference cache directory. Construction checks the manifest and the presence and
    sizes of its files; `check_index` checks every record (call it before writing anything)."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        self.manifest_path = self.dir / "manifest.json"
        m = self._load_manifest()
        self.manifest = m
        self.num_samples = self._int(m, "num_samples", minimum=0)
        self.hidden_size = self._int(m, "hidden_size", minimum=1)
        self.hidden_dtype = m["hidden_dtype"]
        self.layers = self._layers(m["target_layer_ids"])
        self.itemsize = HIDDEN_ITEMSIZE[self.hidden_dtype]
        self.shard_files, self.shard_sizes = self._shards(m)
        self.index_path = self.dir / "samples.idx"
        if not self.index_path.is_file():
            raise CacheFormatError(f"{self.index_path}: missing (every reference cache has an index)")
        size = self._size("samples.idx")
        if size != self.num_samples * RECORD.itemsize:
            raise CacheFormatError(f"{self.index_path}: {size} bytes, but manifest.json num_samples "
                                   f"{self.num_samples} needs {self.num_samples * RECORD.itemsize} "
                                   f"({RECORD.itemsize}-byte records)")
        self._fd: tuple[int, int] | None = None  # (shard id, open fd)

    def _load_manifest(self) -> dict:
        where = self.manifest_path
        if not where.is_file():
            raise CacheFormatError(f"{where}: missing (not a reference target cache directory)")
        try:
            m = json.loads(door.read_file(str(self.dir), "manifest.json"))
        except json.JSONDecodeError as e:
            raise CacheFormatError(f"{where}: not valid JSON (line {e.lineno}: {e.msg})") from None
        if not isinstance(m, dict):
            raise CacheFormatError(f"{where}: not a JSON object")
        missing = [k for k in REQUIRED if k not in m]
        if missing:
            raise CacheFormatError(f"{where}: missing required field(s) {missing}")
        checks = (("version", REF_VERSION), ("index_record_size", RECORD.itemsize), ("token_dtype", "int32"),
                  ("mask_dtype", "uint8"))
        for key, want in checks:
            if m[key] != want:
                raise CacheFormatError(f"{where}: field {key} is {m[key]!r}; only {want!r} is supported")
        if m["hidden_dtype"] not in HIDDEN_ITEMSIZE:
            raise CacheFormatError(f"{where}: field hidden_dtype is {m['hidden_dtype']!r} "
                                   f"(known: {list(HIDDEN_ITEMSIZE)})")
        return m

    def _int(self, m: dict, key: str, minimum: int) -> int:
        value = m[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise CacheFormatError(f"{self.manifest_path}: field {key} must be an integer >= {minimum}, "
                                   f"got {value!r}")
        return value

    def _layers(self, ids) -> list[int]:
        where = f"{self.manifest_path}: field target_layer_ids"
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise CacheFormatError(f"{where} must be a non-empty list of integers, got {ids!r}")
        if ids != sorted(ids):
            raise CacheFormatError(f"{where} {ids} is not in ascending order (the reference reader requires it)")
        if len(set(ids)) != len(ids):
            raise CacheFormatError(f"{where} {ids} repeats a layer")
        if ids[0] < -1:
            raise CacheFormatError(f"{where} {ids}: {ids[0]} is not a layer (-1 is the embedding output)")
        return list(ids)

    def _shards(self, m: dict) -> tuple[list[Path], np.ndarray]:
        shards = m["shards"]
        if not isinstance(shards, list) or m["num_shards"] != len(shards):
            raise CacheFormatError(f"{self.manifest_path}: field num_shards is {m['num_shards']!r} but shards "
                                   f"lists {len(shards) if isinstance(shards, list) else shards!r}")
        files = []
        for k, entry in enumerate(shards):
            if not isinstance(entry, dict) or "shard_id" not in entry or "file_name" not in entry:
                raise CacheFormatError(f"{self.manifest_path}: shards[{k}] needs shard_id and file_name, got {entry!r}")
            if entry["shard_id"] != k:
                raise CacheFormatError(f"{self.manifest_path}: shards[{k}].shard_id is {entry['shard_id']!r}; "
                                       f"shard ids must be 0, 1, 2, ... in order")
            name = str(entry["file_name"])
            if os.path.isabs(name) or ".." in Path(name).parts:
                raise CacheFormatError(f"{self.manifest_path}: shards[{k}].file_name {name!r} leaves the cache directory")
            path = self.dir / name
            if not path.is_file():
                raise CacheFormatError(f"{path}: missing (manifest.json shards[{k}])")
            files.append(path)
        return files, np.array([self._size(p.relative_to(self.dir).as_posix()) for p in files], dtype=np.uint64)

    def _size(self, name: str) -> int:
        """The size of one file of the cache, opened through the door (storage/door.py): inside the
        directory (or the DVC cache of its repository), a regular file."""
        return door.file_size(str(self.dir), name)

    def index(self) -> np.ndarray:
        if self.num_samples == 0:
            return np.zeros(0, dtype=RECORD)
        with door.open_file(str(self.dir), "samples.idx", size=self.num_samples * RECORD.itemsize) as f:
            return np.memmap(f, dtype=RECORD, mode="r", shape=(self.num_samples,))

    def check_index(self) -> None:
        """Every record: its sample id is its position, its shard exists, its length is positive and
        each of its five arrays lies inside its shard. Reads the index in blocks."""
        idx = self.index()
        where = self.index_path
        for lo in range(0, self.num_samples, INDEX_BLOCK):
            block = np.asarray(idx[lo:lo + INDEX_BLOCK])
            pos = np.arange(lo, lo + len(block), dtype=np.uint64)
            bad = np.flatnonzero(block["sample_id"] != pos)
            if bad.size:
                k = int(bad[0])
                raise CacheFormatError(f"{where}: record {lo + k}: sample_id is {int(block['sample_id'][k])}, "
                                       f"expected {lo + k} (record k must hold sample k)")
            bad = np.flatnonzero(block["shard_id"] >= len(self.shard_files))
            if bad.size:
                k = int(bad[0])
                raise CacheFormatError(f"{where}: record {lo + k}: shard_id {int(block['shard_id'][k])} is not "
                                       f"in manifest.json shards (it lists {len(self.shard_files)})")
            bad = np.flatnonzero(block["seq_len"] == 0)
            if bad.size:
                raise CacheFormatError(f"{where}: record {lo + int(bad[0])}: seq_len is 0")
            sizes = self.shard_sizes[block["shard_id"]]
            for field, nbytes in _nbytes(block["seq_len"], self.hidden_size, len(self.layers), self.itemsize).items():
                end = block[field] + nbytes
                bad = np.flatnonzero((end > sizes) | (end < block[field]))
                if bad.size:
                    k = int(bad[0])
                    shard = self.shard_files[int(block["shard_id"][k])]
                    raise CacheFormatError(
                        f"{shard}: record {lo + k} of {where.name}: {field} bytes {int(block[field][k])}.."
                        f"{int(end[k])} lie outside the shard ({int(sizes[k])} bytes; truncated shard or bad offset)")

    def read(self, record: np.void, field: str, nbytes: int) -> bytes:
        shard = int(record["shard_id"])
        if self._fd is None or self._fd[0] != shard:
            self.close()
            self._fd = (shard, door.open_fd(str(self.dir), self.shard_files[shard].relative_to(self.dir).as_posix()))
        offset = int(record[field])
        data = os.pread(self._fd[1], nbytes, offset)
        if len(data) != nbytes:  # the file shrank after check_index
            raise CacheFormatError(f"{self.shard_files[shard]}: record {int(record['sample_id'])}: {field}: "
                                   f"short read ({len(data)} of {nbytes} bytes at {offset})")
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd[1])
            self._fd = None

    def deepspec_block(self) -> dict:
        block = self.manifest.get("deepspec")
        if block is None:
            return {}
        if not isinstance(block, dict):
            raise CacheFormatError(f"{self.manifest_path}: field deepspec must be an object, got {block!r}")
        return block

    def sample_ids(self) -> np.ndarray | None:
        """This project's row ids when the cache was exported from a store here, else None."""
        name = self.deepspec_block().get("sample_ids_file")
        if name is None:
            return None
        path = self.dir / str(name)
        if os.path.isabs(str(name)) or ".." in Path(str(name)).parts or not path.is_file():
            raise CacheFormatError(f"{path}: missing (manifest.json field deepspec.sample_ids_file)")
        if path.stat().st_size != 8 * self.num_samples:
            raise CacheFormatError(f"{path}: {path.stat().st_size} bytes, expected 8 per sample "
                                   f"({8 * self.num_samples} for {self.num_samples} samples)")
        raw = door.read_file(str(self.dir), str(name), size=8 * self.num_samples, limit=None)
        ids = np.frombuffer(raw, dtype="<u8").copy()
        uniq, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            dup = int(uniq[np.argmax(counts > 1)])
            raise CacheFormatError(f"{path}: sample id {dup:016x} appears {int(counts.max())} times "
                                   f"(records {np.flatnonzero(ids == dup).tolist()[:4]})")
        return ids
