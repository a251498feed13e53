"""The writer's own shard encoder produces exactly what zarr-python writes for the same array, plus
(format v4, uncompressed) the crc32c table zarr-python skips."""
import numpy as np
import pytest
import zarr

from deepspec.cache.spec.format import crc_table, inner_codecs
from deepspec.cache.backends.zarr.shard import encode_shard


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
    ours, theirs = encode_shard(data, chunks[0], codec), key.read_bytes()
    if not crc_table(codec):
        assert ours == theirs
        return
    from crc32c import crc32c

    n = shards[0] // chunks[0]
    index_at = len(ours) - (16 * n + 4)
    table = ours[index_at - (4 * n + 4):index_at]
    assert ours[:index_at - len(table)] + ours[index_at:] == theirs  # the chunks, then zarr-python's index
    body = chunks[0] * int(np.prod(shape[1:], dtype=np.int64)) * data.dtype.itemsize
    assert [int.from_bytes(table[4 * c:4 * c + 4], "little") for c in range(n)] == \
        [crc32c(theirs[c * body:(c + 1) * body]) for c in range(n)]
    assert int.from_bytes(table[-4:], "little") == crc32c(table[:-4])


@pytest.mark.parametrize("dtype, shape, chunk", [("uint16", (203, 24), 16), ("int32", (1500,), 1024),
                                                 ("uint8", (64, 8), 64), ("uint64", (3, 2), 3), ("float32", (0,), 1024),
                                                 # kinds met before, other row counts (one fewer than a chunk)
                                                 ("uint16", (5, 24), 16), ("int32", (1023,), 1024)])
@pytest.mark.parametrize("codec", ["none", "blosc-zstd"])
@pytest.mark.parametrize("name", ["a", "hidden/9"])
@pytest.mark.parametrize("whole", [False, True])
def test_array_metadata_equals_what_zarr_python_writes(tmp_path, dtype, shape, chunk, codec, name, whole, monkeypatch):
    """A local writer writes each array's metadata itself: byte for byte the files zarr-python's
    create_array writes for the same array (a nested one's parent group too), created the way the
    writer once created it; from its kind's document with the row counts put in, or (`whole`, what
    a zarr-python whose documents the writer cannot fill in gets) built whole."""
    from deepspec.cache.backends.base import ArraySpec
    from deepspec.cache.backends.zarr import documents
    from deepspec.cache.backends.zarr.documents import create_array_files
    from deepspec.cache.spec.format import CHUNK_CRC32C

    if whole:
        monkeypatch.setattr(documents, "_kind_document", lambda *a: None)

    codecs = inner_codecs(codec, np.dtype(dtype).itemsize)
    chunks = (min(chunk, max(shape[0], 1)),) + shape[1:]
    shards = (-(-max(shape[0], 1) // chunks[0]) * chunks[0],) + shape[1:]
    group = zarr.open_group(str(tmp_path / "theirs"), mode="a", zarr_format=3)
    group.create_array(name, shape=shape, dtype=dtype, chunks=chunks, shards=shards, serializer=codecs[0],
                       compressors=codecs[1:], fill_value=0, config={"write_empty_chunks": True},
                       attributes={CHUNK_CRC32C: "table"} if crc_table(codec) else None)
    zarr.open_group(str(tmp_path / "ours"), mode="a", zarr_format=3)
    create_array_files(tmp_path / "ours", ArraySpec(name, None, chunk, codec, shape, np.dtype(dtype)))

    def files(root):
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert files(tmp_path / "ours") == files(tmp_path / "theirs")


def test_part_group_files_equal_what_zarr_python_writes(tmp_path):
    """A local writer creates a part's group and later replaces its attributes with the commit record
    itself: the same files zarr-python's create_group then attrs.put write; a second creation of
    the same group, or of a group where an array is, fails."""
    from deepspec.cache.backends.zarr.documents import create_group_files, group_document

    attrs = {"committed": True, "samples": 2, "tokens": 7, "lengths": [3, 4], "keys": ["ab" * 16, "cd" * 16],
             "note": "é\u2028"}
    theirs = zarr.open_group(str(tmp_path / "theirs"), mode="a", zarr_format=3)
    zarr.open_group(str(tmp_path / "ours"), mode="a", zarr_format=3)
    for path in ("parts/p1", "parts/p2", "a/b/c"):
        theirs.create_group(path, attributes={"committed": False})
        create_group_files(tmp_path / "ours", path, {"committed": False})

    def files(root):
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert files(tmp_path / "ours") == files(tmp_path / "theirs")
    theirs["parts/p1"].attrs.put(attrs)
    (tmp_path / "ours" / "parts" / "p1" / "zarr.json").write_bytes(group_document({"committed": False, **attrs}))
    assert files(tmp_path / "ours") == files(tmp_path / "theirs")

    with pytest.raises(FileExistsError):
        create_group_files(tmp_path / "ours", "parts/p1", {"committed": False})
    theirs.create_array("parts/arr", shape=(1,), dtype="uint8")
    zarr.open_group(str(tmp_path / "ours"), mode="a")["parts"].create_array("arr", shape=(1,), dtype="uint8")
    with pytest.raises(FileExistsError):
        create_group_files(tmp_path / "ours", "parts/arr", {"committed": False})
    assert files(tmp_path / "ours") == files(tmp_path / "theirs")


@pytest.mark.parametrize("run_bytes", [1 << 20, 2000])
@pytest.mark.parametrize("codec", ["none", "blosc-lz4"])
def test_a_shard_appended_in_uneven_batches_equals_the_shard_encoded_whole(codec, run_bytes, monkeypatch):
    """The streamed writer's appender holds less than a chunk between batches; the shard it writes
    is the one encoded from all rows at once, whatever the batch boundaries."""
    import io

    from deepspec.cache.backends.zarr import shard as shard_module
    from deepspec.cache.backends.zarr.shard import ShardAppender

    monkeypatch.setattr(shard_module, "RUN_BYTES", run_bytes)  # 2000: whole chunks written two at a time
    rng = np.random.default_rng(1)
    data = rng.integers(0, 1 << 16, size=(203, 24)).astype("uint16")
    for cuts in ([], [1], [15, 16, 17], [5, 40, 41, 190], list(range(1, 203))):
        buf = io.BytesIO()
        shard = ShardAppender(buf, len(data), data.shape[1:], data.dtype, 16, codec)
        for a, b in zip([0, *cuts], [*cuts, len(data)]):
            shard.append(data[a:b])
        shard.finish()
        assert buf.getvalue() == encode_shard(data, 16, codec), cuts


def test_a_shard_refuses_rows_beyond_or_short_of_its_shape():
    import io

    from deepspec.cache.spec.format import CacheFormatError
    from deepspec.cache.backends.zarr.shard import ShardAppender

    shard = ShardAppender(io.BytesIO(), 10, (4,), np.uint16, 4, "none")
    shard.append(np.zeros((6, 4), np.uint16))
    with pytest.raises(CacheFormatError, match="11 rows appended to an array of 10"):
        shard.append(np.zeros((5, 4), np.uint16))
    with pytest.raises(CacheFormatError, match="6 of 10 rows"):
        shard.finish()
    with pytest.raises(CacheFormatError, match="rows of shape"):
        shard.append(np.zeros((1, 5), np.uint16))
