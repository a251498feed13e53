"""The writer's own shard encoder produces exactly what zarr-python writes for the same array."""
import numpy as np
import pytest
import zarr

from deepspec.cache.format import inner_codecs
from deepspec.cache.zarr_store import encode_shard


@pytest.mark.parametrize("dtype, shape, chunk", [("uint16", (203, 24), 16), ("int32", (1500,), 1024),
                                                 ("uint8", (64, 8), 64), ("int64", (1,), 1), ("float32", (77,), 1024)])
@pytest.mark.parametrize("codec", ["none", "blosc-zstd", "blosc-lz4"])
def test_encoded_shard_equals_zarr_python(tmp_path, dtype, shape, chunk, codec):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 200, size=shape).astype(dtype)
    codecs = inner_codecs(codec, data.dtype.itemsize)
    chunks = (min(chunk, shape[0]),) + shape[1:]
    shards = (-(-shape[0] // chunks[0]) * chunks[0],) + shape[1:]
    arr = zarr.create_array(str(tmp_path / "a"), shape=shape, dtype=dtype, chunks=chunks, shards=shards,
                            serializer=codecs[0], compressors=codecs[1:], fill_value=0,
                            config={"write_empty_chunks": True})
    arr[...] = data
    key = tmp_path / "a" / "c" / "/".join("0" for _ in shape)
    assert encode_shard(data, chunks[0], codec) == key.read_bytes()
