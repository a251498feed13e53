"""What a reading process keeps of the parts it touched is bounded (deepspec/cache/storage/bounded.py)."""
import numpy as np
import pytest

from deepspec.cache.storage.bounded import BoundedCache, nbytes
from deepspec.cache.backends.hdf5.read import HDF5Store
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.read.shards import ShardReader
from tests.cache.test_conformance import expect_equal, make_part, write


def test_least_recently_used_entries_go_first_and_the_bound_holds():
    cache = BoundedCache(3 * nbytes(np.zeros(100, np.uint8)))
    for k in "abc":
        cache[k] = np.zeros(100, np.uint8)
    assert cache.get("a") is not None  # a is now the most recent
    cache["d"] = np.zeros(100, np.uint8)
    assert "b" not in cache and all(k in cache for k in "acd") and cache.evictions == 1
    assert cache.bytes <= cache.max_bytes
    cache["huge"] = np.zeros(10_000, np.uint8)  # larger than the bound: kept alone, for the read in hand
    assert len(cache) == 1 and cache.get("huge") is not None
    assert cache.get("missing", "default") == "default"


def test_a_copy_for_another_process_starts_empty_with_the_same_bound():
    import pickle

    cache = BoundedCache(1000)
    cache["a"] = np.zeros(10, np.uint8)
    copy = pickle.loads(pickle.dumps(cache))  # what a spawned or forkserver loading process receives
    assert (copy.max_bytes, len(copy), copy.bytes) == (1000, 0, 0)
    copy["b"] = np.zeros(10, np.uint8)
    assert "b" in copy and "b" not in cache


@pytest.mark.parametrize("kind", ["zarr", "hdf5"])
def test_a_reader_over_many_parts_keeps_a_bounded_share_of_their_tables(tmp_path, monkeypatch, kind):
    budget = 32 << 10
    monkeypatch.setattr(ShardReader, "TABLE_BYTES", budget)
    monkeypatch.setattr(HDF5Store, "TABLE_BYTES", budget)
    monkeypatch.setattr(CacheReader, "LAYOUT_BYTES", budget)
    parts = [make_part(f"p{k:06d}", k + 1) for k in range(24)]
    url = str(tmp_path / "store")
    write((kind, url, None), parts, codec="none")
    reader = CacheReader(url)
    for _ in range(2):  # twice: evicted tables are read again, and checked again
        expect_equal(reader, parts)
    held = reader.memory()
    assert sorted(held) == sorted(["layouts", "shard_indexes", *(["hdf5_chunk_tables"] if kind == "hdf5" else [])])
    for cache in held.values():
        assert cache["bytes"] <= cache["max_bytes"] == budget and cache["evictions"] > 0
