"""The metadata documents (`zarr.json`) a local Zarr writer puts into a store itself: byte for byte
what zarr-python writes for the same node (tests/cache/test_writer.py compares them), built with
zarr-python's own metadata classes but written without its store and event loop. A round trip
through them (an existence check, a write handed to a thread, a wait) cost more than a narrow
part's data: benchmarks/cache_write.py --parts."""
from __future__ import annotations

import functools
import json
import math
import os

import numpy as np

from deepspec.cache.backends.base import ArraySpec
from deepspec.cache.spec.format import CHUNK_CRC32C, crc_table, inner_codecs


def chunking(spec: ArraySpec) -> tuple[tuple, tuple]:
    """(inner chunk shape, shard shape) of an array: one shard holding every row."""
    shape = tuple(spec.shape)
    rows = shape[0]
    chunks = (min(spec.chunk_rows, max(rows, 1)),) + shape[1:]
    return chunks, (math.ceil(max(rows, 1) / chunks[0]) * chunks[0],) + shape[1:]


# stand-ins for an array's row counts in its kind's document (_kind_document): no real array is
# this long, and each appears in the document once
_ROWS, _SHARD_ROWS, _CHUNK_ROWS = "-7000000001", "-7000000002", "-7000000003"


def array_document(spec: ArraySpec) -> bytes:
    """The `zarr.json` of a single-shard array: zarr-python's document for an array of its kind
    (row shape, dtype, chunk rows, codec), built once with zarr-python's own metadata classes
    without touching a store, with this array's row counts put in. Building one costs more than
    writing a narrow array's rows, and a part has several of each kind (tests/cache/test_writer.py
    compares the bytes with zarr-python's for each shape)."""
    doc = _kind_document(tuple(spec.shape[1:]), np.dtype(spec.dtype).str, spec.chunk_rows, spec.codec)
    if doc is None:
        return _zarr_document(spec)
    chunks, shards = chunking(spec)
    for stand_in, rows in ((_ROWS, spec.shape[0]), (_SHARD_ROWS, shards[0]), (_CHUNK_ROWS, chunks[0])):
        doc = doc.replace(stand_in, str(int(rows)))
    return doc.encode()


@functools.lru_cache(maxsize=64)
def _kind_document(row_shape: tuple, dtype: str, chunk_rows: int, codec: str) -> str | None:
    """zarr-python's document of an array of `chunk_rows` rows of this kind, its row counts replaced
    by the stand-ins; None where its bytes are not json.dumps(indent=2) of its content (a zarr-python
    that writes them otherwise: each document is then built whole)."""
    built = _zarr_document(ArraySpec("", None, chunk_rows, codec, (chunk_rows, *row_shape), np.dtype(dtype)))
    doc = json.loads(built)
    if json.dumps(doc, indent=2).encode() != built or any(s in built.decode() for s in (_ROWS, _SHARD_ROWS,
                                                                                          _CHUNK_ROWS)):
        return None
    doc["shape"][0] = int(_ROWS)
    doc["chunk_grid"]["configuration"]["chunk_shape"][0] = int(_SHARD_ROWS)
    doc["codecs"][0]["configuration"]["chunk_shape"][0] = int(_CHUNK_ROWS)
    return json.dumps(doc, indent=2)


def _zarr_document(spec: ArraySpec) -> bytes:
    """The `zarr.json` zarr-python's own metadata classes build for the array."""
    from zarr.codecs import ShardingCodec
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.dtype import parse_dtype
    from zarr.core.metadata.v3 import ArrayV3Metadata

    chunks, shards = chunking(spec)
    dtype = np.dtype(spec.dtype)
    meta = ArrayV3Metadata(
        shape=tuple(spec.shape), data_type=parse_dtype(dtype, zarr_format=3),
        chunk_grid={"name": "regular", "configuration": {"chunk_shape": shards}},
        chunk_key_encoding={"name": "default", "configuration": {"separator": "/"}}, fill_value=0,
        codecs=[ShardingCodec(chunk_shape=chunks, codecs=inner_codecs(spec.codec, dtype.itemsize))],
        attributes={CHUNK_CRC32C: "table"} if crc_table(spec.codec) else {}, dimension_names=None)
    return meta.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()


def group_document(attributes: dict | None = None) -> bytes:
    """The `zarr.json` of a group with these attributes."""
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.group import GroupMetadata

    meta = GroupMetadata(attributes=attributes or {}, zarr_format=3)
    return meta.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()


@functools.lru_cache(maxsize=1)
def _plain_group_document() -> bytes:
    return group_document()


def create_parent_groups(root: str | os.PathLike, path: str) -> None:
    """A plain group's zarr.json at each level between `root` (a group) and `path` where there is
    none yet, as zarr-python writes them for a node it creates below them."""
    at = os.fspath(root)
    for name in path.split("/")[:-1]:
        at = os.path.join(at, name)
        os.makedirs(at, exist_ok=True)
        try:
            with open(os.path.join(at, "zarr.json"), "xb") as f:
                f.write(_plain_group_document())
        except FileExistsError:
            pass


def create_group_files(root: str | os.PathLike, path: str, attributes: dict) -> None:
    """What zarr-python's create_group writes into a local group for a new group at `path`; raises
    FileExistsError where a node (a group or an array) is there already. Created exclusively
    ("x"): of two writers creating the same node, one fails."""
    create_parent_groups(root, path)
    at = os.path.join(root, path)
    os.makedirs(at, exist_ok=True)
    with open(os.path.join(at, "zarr.json"), "xb") as f:
        f.write(group_document(attributes))


def create_array_files(group_dir: str | os.PathLike, spec: ArraySpec) -> None:
    """What zarr-python's create_array writes into a local group for a new array (`spec.name` may
    be nested, "hidden/9"): the array's zarr.json and, for each level between the group and the
    array, a group's zarr.json where there is none yet."""
    create_parent_groups(group_dir, spec.name)
    at = os.path.join(group_dir, spec.name)
    os.makedirs(at, exist_ok=True)
    # "x": never overwrite, as create_array(overwrite=False): it may be another writer's part
    with open(os.path.join(at, "zarr.json"), "xb") as f:
        f.write(array_document(spec))
