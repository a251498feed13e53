"""The Zarr v3 layout the writer produces, as the other rooms need it without zarr-python: a part
array's single-shard metadata parsed into an ArrayLayout (where its chunks and shard index are),
and the cheap damage check of a committed local part (docs/cache-format.md §6)."""
from __future__ import annotations

import json
import os

import numpy as np
from crc32c import crc32c

from deepspec.cache.backends.base import ArrayLayout
from deepspec.cache.spec.format import CHUNK_CRC32C, PARSE_ERRORS
from deepspec.cache.storage import door

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
    if index_names != ["bytes", "crc32c"] or inner[0] != "bytes":
        return None
    table = inner == ["bytes"] and (meta.get("attributes") or {}).get(CHUNK_CRC32C) == "table"
    if not table and (inner[-1] != "crc32c" or inner[1:-1] not in ([], ["blosc"])):
        return None  # a chunk without a crc32c anywhere is not the writer's: read (unchecked) by the library
    endian = (cfg["codecs"][0].get("configuration") or {}).get("endian", "little")
    dtype = np.dtype(meta["data_type"]).newbyteorder("<" if endian == "little" else ">")
    sep = meta.get("chunk_key_encoding", {}).get("configuration", {}).get("separator", "/")
    if meta.get("chunk_key_encoding", {}).get("name", "default") != "default":
        return None
    key = f"{path}/c" + sep + sep.join("0" for _ in meta["shape"])
    return ArrayLayout(key=key, dtype=dtype, shape=tuple(meta["shape"]), chunk_rows=chunk[0],
                       n_chunks=shard_shape[0] // chunk[0], blosc="blosc" in inner, crc_table=table,
                       row_bytes=dtype.itemsize * int(np.prod(meta["shape"][1:], dtype=np.int64)))


def split_suffix(layout: ArrayLayout, raw: bytes) -> tuple[np.ndarray, np.ndarray | None]:
    """A shard's last `layout.suffix_bytes` bytes -> (index [n_chunks, 2] of (offset, nbytes), the
    chunks' crc32cs [n_chunks] or None before v4); ValueError naming which part is corrupt."""
    n = layout.n_chunks
    if len(raw) != layout.suffix_bytes:
        raise ValueError(f"{len(raw)} bytes cannot hold the index of {n} chunks")
    idx = raw[-(16 * n + 4):]
    if crc32c(idx[:-4]) != int.from_bytes(idx[-4:], "little"):
        raise ValueError("shard index checksum mismatch")
    crcs = None
    if layout.crc_table:
        table = raw[:4 * n + 4]
        if crc32c(table[:-4]) != int.from_bytes(table[-4:], "little"):
            raise ValueError("chunk crc32c table checksum mismatch")
        crcs = np.frombuffer(table[:-4], dtype="<u4")
    return np.frombuffer(idx[:-4], dtype="<u8").reshape(n, 2), crcs


def part_damage(root: str, part: str, arrays: list[str]) -> str | None:
    """Why a committed part of a local store cannot be trusted, or None. Cheap (no chunk is read):
    every array's metadata must parse, and its shard must end with an index whose crc32c holds and
    whose chunks fill the file exactly up to it. A shard that lost its tail, or whose blocks read
    back as zeros after a power loss, fails this; flipped bytes inside a chunk are `verify`'s job."""
    try:
        door.read_file(root, f"parts/{part}/zarr.json")
    except (OSError, ValueError) as e:  # the door's refusal is a CacheFormatError, a ValueError
        return f"parts/{part}/zarr.json unreadable ({e.__class__.__name__})"
    for array in arrays:
        where = f"parts/{part}/{array}"
        try:
            layout = parse_layout(where, json.loads(door.read_file(root, f"{where}/zarr.json")))
        except (OSError, *PARSE_ERRORS) as e:
            return f"{where}/zarr.json unreadable ({e.__class__.__name__})"
        if layout is None:
            return f"{where}: not the single-shard layout the writer produces"
        suffix = layout.suffix_bytes
        try:
            fd = door.open_fd(root, layout.key)
        except (OSError, ValueError) as e:
            return f"{layout.key}: unreadable ({e.__class__.__name__})"
        try:
            size = os.fstat(fd).st_size
            tail = os.pread(fd, suffix, size - suffix) if size >= suffix else b""
        finally:
            os.close(fd)
        try:
            index, _ = split_suffix(layout, tail)
        except ValueError:
            return f"{layout.key}: shard index missing or corrupt ({size} bytes)"
        ends = index[:, 0] + index[:, 1]
        if (index[:, 0] == EMPTY).any() or index[0, 0] != 0 or (index[1:, 0] != ends[:-1]).any() \
                or int(ends[-1]) != size - suffix:
            return f"{layout.key}: chunks do not fill the shard ({size} bytes)"
    return None
