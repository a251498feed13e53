"""The Zarr v3 layout the writer produces, as the other rooms need it without zarr-python: a part
array's single-shard metadata parsed into an ArrayLayout (where its chunks and shard index are),
and the cheap damage check of a committed local part (docs/cache-format.md §6)."""
from __future__ import annotations

import json
import os

import numpy as np
from crc32c import crc32c

from deepspec.cache.backends.base import ArrayLayout

EMPTY = 2**64 - 1  # shard index marker of a chunk that was never written


def parse_layout(path: str, meta: dict) -> ArrayLayout | None:
    """The shard layout the writer produces, or None if this array is anything else."""
    codecs = meta.get("codecs") or []
    if len(codecs) != 1 or codecs[0]["name"] != "sharding_indexed":
        return None
    cfg = codecs[0]["configuration"]
    shard_shape, chunk = meta["chunk_grid"]["configuration"]["chunk_shape"], cfg["chunk_shape"]
    if meta["shape"][0] > shard_shape[0] or list(chunk[1:]) != list(meta["shape"][1:]):
        return None  # more than one shard, or chunked across columns
    if cfg.get("index_location", "end") != "end":
        return None
    index_names = [c["name"] for c in cfg["index_codecs"]]
    inner = [c["name"] for c in cfg["codecs"]]
    if index_names != ["bytes", "crc32c"] or inner[0] != "bytes" or inner[-1] != "crc32c":
        return None
    if inner[1:-1] not in ([], ["blosc"]):
        return None
    endian = (cfg["codecs"][0].get("configuration") or {}).get("endian", "little")
    dtype = np.dtype(meta["data_type"]).newbyteorder("<" if endian == "little" else ">")
    sep = meta.get("chunk_key_encoding", {}).get("configuration", {}).get("separator", "/")
    if meta.get("chunk_key_encoding", {}).get("name", "default") != "default":
        return None
    key = f"{path}/c" + sep + sep.join("0" for _ in meta["shape"])
    return ArrayLayout(key=key, dtype=dtype, shape=tuple(meta["shape"]), chunk_rows=chunk[0],
                       n_chunks=shard_shape[0] // chunk[0], blosc=len(inner) == 3,
                       row_bytes=dtype.itemsize * int(np.prod(meta["shape"][1:], dtype=np.int64)))


def part_damage(root: str, part: str, arrays: list[str]) -> str | None:
    """Why a committed part of a local store cannot be trusted, or None. Cheap (no chunk is read):
    every array's metadata must parse, and its shard must end with an index whose crc32c holds and
    whose chunks fill the file exactly up to it. A shard that lost its tail, or whose blocks read
    back as zeros after a power loss, fails this; flipped bytes inside a chunk are `verify`'s job."""
    for array in arrays:
        where = f"parts/{part}/{array}"
        try:
            with open(os.path.join(root, where, "zarr.json"), "rb") as f:
                layout = parse_layout(where, json.loads(f.read()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{where}/zarr.json unreadable ({e.__class__.__name__})"
        if layout is None:
            return f"{where}: not the single-shard layout the writer produces"
        index_bytes = 16 * layout.n_chunks + 4
        try:
            with open(os.path.join(root, layout.key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                tail = os.pread(f.fileno(), index_bytes, size - index_bytes) if size >= index_bytes else b""
        except OSError as e:
            return f"{layout.key}: unreadable ({e.__class__.__name__})"
        if len(tail) != index_bytes or crc32c(tail[:-4]) != int.from_bytes(tail[-4:], "little"):
            return f"{layout.key}: shard index missing or corrupt ({size} bytes)"
        index = np.frombuffer(tail[:-4], dtype="<u8").reshape(-1, 2)
        ends = index[:, 0] + index[:, 1]
        if (index[:, 0] == EMPTY).any() or index[0, 0] != 0 or (index[1:, 0] != ends[:-1]).any() \
                or int(ends[-1]) != size - index_bytes:
            return f"{layout.key}: chunks do not fill the shard ({size} bytes)"
    return None
