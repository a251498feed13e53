"""Golden stores of every backend, written once by tests/cache/make_golden.py and checked in (v1 by
the v1 writer, v2 by the v2 writer, v3 by the v3 writer, v4 by the v4 writer): a reader change that misreads a store
written by an earlier writer fails here."""
import shutil

import numpy as np
import pytest
import torch

from deepspec.cache.spec.format import decode_hidden, part_name, sample_keys
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.tools.verify import info, verify
from deepspec.loader.dataset import TargetCacheDataset
from deepspec.cache.spec.format import FORMAT_VERSION
from tests.cache.make_golden import ALL_STORES, GOLDEN, LAYERS, PARTS, SAMPLE_IDS, VERSION, golden_values


def golden_keys(part) -> np.ndarray:
    name, seed, lengths = part
    v = golden_values(seed, lengths)
    return sample_keys(v["input_ids"], v["loss_mask"], np.array(lengths))


def golden_name(part, version: int) -> str:
    """v1/v2 parts were numbered; v3 parts are named by their samples' keys and ids."""
    if version < 3:
        return part[0]
    return part_name(golden_keys(part), np.array(SAMPLE_IDS[part[0]], dtype=np.uint64))


@pytest.mark.parametrize("name,storage,dtype,codec", ALL_STORES)
@pytest.mark.parametrize("fast", [True, False])
def test_golden_store_reads_back_the_values_it_was_written_with(name, storage, dtype, codec, fast):
    url = str(GOLDEN / name)
    reader = CacheReader(url, fast=fast)
    m = reader.manifest
    assert (m.storage, m.dtype, m.codec, m.layers, m.hidden_size) == (storage, dtype, codec, LAYERS, 8)
    assert [p.name for p in m.parts] == [golden_name(part, VERSION[name]) for part in PARTS] and m.num_samples == 3
    assert m.format_version == VERSION[name] and m.consolidated
    assert (m.index is not None) == (VERSION[name] >= 2)  # v1: offsets/sample ids read part by part
    if VERSION[name] >= 3:  # content keys: stored, and equal to the hash of each sample's tokens
        assert np.array_equal(reader.keys(), np.concatenate([golden_keys(part) for part in PARTS]))
    else:
        assert reader.keys() is None
    ds = TargetCacheDataset(url, fast=fast)
    k = 0
    for part, seed, lengths in PARTS:
        v = golden_values(seed, lengths)
        start = 0
        for s, n in enumerate(lengths):
            item = ds[k]
            assert item["sample_id"] == SAMPLE_IDS[part][s]
            assert np.array_equal(item["input_ids"].numpy(), v["input_ids"][start:start + n])
            assert np.array_equal(item["loss_mask"].numpy(), v["loss_mask"][start:start + n])
            for i, layer in enumerate(LAYERS):
                want = torch.from_numpy(v["hidden"][layer][start:start + n]).to(torch.bfloat16)
                if dtype == "bfloat16":
                    assert torch.equal(item["hidden"][i], want)
                else:  # fp8: the decode of the stored bits, and close to the original
                    bits, scale = reader.read(k, layers=[layer], fields=("hidden",))[layer]
                    assert torch.equal(item["hidden"][i], decode_hidden(bits, scale, dtype))
                    assert torch.allclose(item["hidden"][i].float(), want.float(), rtol=0.07, atol=0.02)
            want_last = torch.from_numpy(v["hidden"]["last"][start:start + n]).to(torch.bfloat16)
            assert torch.allclose(item["last_hidden"].float(), want_last.float(), rtol=0.07, atol=0.05)
            start += n
            k += 1
    assert k == len(ds)


@pytest.mark.parametrize("name,storage,dtype,codec", ALL_STORES)
def test_golden_store_verifies_and_reports(name, storage, dtype, codec, tmp_path):
    url = str(tmp_path / name)
    shutil.copytree(GOLDEN / name, url)  # verify reads only, but keep the checked-in files untouched
    assert verify(url)["ok"]
    assert info(url)["storage"] == storage and info(url)["samples"] == 3


@pytest.mark.parametrize("name", ["zarr-bf16", "hdf5-fp8-zstd", "v2-zarr-bf16", "v2-hdf5-fp8-zstd", "v3-zarr-bf16",
                                  "v3-hdf5-fp8-zstd"])
def test_an_earlier_store_derives_into_a_current_store_with_the_same_samples(name, tmp_path):
    """format_version is content (§8): a writer never adds parts to a store of an earlier version;
    `deepspec cache derive` migrates one part for part (hard links for Zarr, nothing recomputed: a
    linked array keeps the chunk layout it was written with), adding the content keys (before v3)
    and naming each part by its content."""
    from deepspec.cache.build.derive import derive_store

    src = str(tmp_path / name)
    shutil.copytree(GOLDEN / name, src)
    out = derive_store(src, str(tmp_path / "v3"))
    a, b = CacheReader(src), CacheReader(str(tmp_path / "v3"))
    assert a.manifest.format_version == VERSION[name] and b.manifest.format_version == FORMAT_VERSION
    assert b.manifest.index is not None
    assert out["parts_derived"] == 2 and list(a.sample_ids()) == list(b.sample_ids())
    assert [p.name for p in b.manifest.parts] == [golden_name(part, 3) for part in PARTS]
    assert np.array_equal(b.keys(), np.concatenate([golden_keys(part) for part in PARTS]))
    assert np.array_equal(a.lengths(), b.lengths())
    if "zarr" in name:
        assert out["method"] == ["hardlink"]
    for k in range(len(a)):
        x, y = a.read(k), b.read(k)
        assert all(np.array_equal(x[f], y[f]) for f in ("input_ids", "loss_mask"))
        for layer in [*LAYERS, "last"]:
            assert np.array_equal(x[layer][0], y[layer][0])
    assert verify(str(tmp_path / "v3"))["ok"]
