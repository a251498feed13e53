"""loader.batches: a batch read straight into place equals the collated samples on every store a reader
opens (Zarr v4 and the older trailer layout, compressed, 8-bit, HDF5, S3 with and without a part
mirror), still names a corrupt chunk, and comes out of DataLoader workers in shared memory."""
import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import get_worker_info

from deepspec.cache.read.checks import ChecksumError
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.read.samples import read_samples
from deepspec.loader import batches as batches_module
from deepspec.loader.batches import Batches, read_batch
from deepspec.loader.collate import collate
from deepspec.loader.dataset import TargetCacheDataset
from deepspec.loader.sampler import ResumableBatchSampler
from tests.cache.old_layout import to_trailer_layout
from tests.loader.test_loader import H, LAYERS, synthetic_parts, write_store

INDEX_LISTS = [[0], [4, 0, 11, 7], [17, 6, 12], list(range(18))[::-1]]


def bits(t):
    return t.view(torch.uint16) if t.dtype == torch.bfloat16 else t


def assert_same_batch(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(bits(got[k]), bits(v)), k
        else:
            assert got[k] == v, k


@pytest.fixture
def garbage(monkeypatch):
    """Memory a batch is carved from may hold anything: fill it, so that unwritten padding shows."""
    real = batches_module.host_empty
    monkeypatch.setattr(batches_module, "host_empty", lambda shape, dtype: real(shape, dtype).fill_(3))


def check_every_layout(ds: TargetCacheDataset) -> None:
    for layers in (LAYERS, [7, -1], [3]):
        for fields in (("input_ids", "loss_mask", "hidden", "last_hidden"), ("input_ids", "hidden"),
                       ("input_ids", "last_hidden")):
            for indices in INDEX_LISTS:
                want = collate(read_samples(ds.reader, indices, layers, fields))
                assert_same_batch(read_batch(ds.reader, indices, layers, fields), want)


@pytest.mark.parametrize("dtype, codec, layout", [("bfloat16", "none", "v4"), ("bfloat16", "none", "trailer"),
                                                  ("bfloat16", "blosc-lz4", "v4"), ("fp8", "none", "v4"),
                                                  ("bfloat16", "none", "hdf5")])
def test_a_batch_read_in_place_equals_the_collated_samples(tmp_path, garbage, dtype, codec, layout):
    parts = synthetic_parts()
    if layout == "hdf5":
        url = write_store(str(tmp_path / "c.h5d"), parts, storage="hdf5")
    else:
        url = write_store(str(tmp_path / "c.zarr"), parts, dtype, codec)
    if layout == "trailer":
        assert to_trailer_layout(url)
    for check_threads in (0, 2):
        ds = TargetCacheDataset(url, check_threads=check_threads)
        check_every_layout(ds)
        assert_same_batch(Batches(ds)[[5, 2]], collate([ds[5], ds[2]]))


def test_a_batch_padded_to_a_multiple_is_the_collated_samples_then_zeros(tmp_path, garbage):
    """What a CUDA trainer reads (Batches(ds, multiple)): the token axis rounded up, every row's tail zero."""
    ds = TargetCacheDataset(write_store(str(tmp_path / "c.zarr"), synthetic_parts()))
    for indices in INDEX_LISTS:
        want = collate([ds[i] for i in indices])
        got = Batches(ds, multiple=64)[indices]
        T = want["input_ids"].shape[1]
        assert got["input_ids"].shape[1] == -(-T // 64) * 64 > 0
        for k, v in want.items():
            if isinstance(v, torch.Tensor) and v.ndim >= 2:
                assert torch.equal(bits(got[k][:, :T]), bits(v)) and not bits(got[k][:, T:]).any(), k
            else:
                assert (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v), k


def test_a_batch_from_s3_equals_the_collated_samples(tmp_path, moto, garbage):
    bucket = moto.bucket("batches")
    parts = synthetic_parts(parts=2)
    url = write_store(f"s3://{bucket}/c.zarr", parts, storage_options=moto.storage_options)
    for cache_dir in (None, str(tmp_path / "mirror")):
        ds = TargetCacheDataset(url, storage_options=moto.storage_options, cache_dir=cache_dir)
        for indices in ([0], [3, 9, 1], [11, 10, 2, 8]):
            assert_same_batch(read_batch(ds.reader, indices, ds.layers, ds.fields), collate([ds[i] for i in indices]))


@pytest.mark.parametrize("check_threads", [0, 2])
def test_a_corrupt_chunk_fails_the_batch_naming_it(tmp_path, check_threads):
    parts = synthetic_parts(parts=1)
    url = write_store(str(tmp_path / "c.zarr"), parts)
    shard = Path(url) / "parts" / "p000000" / "hidden" / "7" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[2 * 16 * H * 2 + 10] ^= 0x01  # one bit inside chunk 2 (v4: the chunks lie back to back)
    shard.write_bytes(bytes(data))
    ds = TargetCacheDataset(url, check_threads=check_threads)
    with pytest.raises(ChecksumError, match=r"parts/p000000/hidden/7/c/0/0: chunk 2 checksum mismatch"):
        Batches(ds)[list(range(len(ds)))]
    assert read_batch(ds.reader, list(range(len(ds))), [3, -1], ds.fields)  # the other arrays read fine


def test_rows_land_in_a_strided_slot_and_nowhere_else(tmp_path):
    """The one-copy path writes a layer's rows L*H apart into a larger array: the bytes between them,
    and the rows after the range, stay as they were."""
    parts = synthetic_parts(parts=1)
    ds = TargetCacheDataset(write_store(str(tmp_path / "c.zarr"), parts))
    part, start, stop = ds.reader.locate(2)
    n = stop - start
    big = np.full((n + 3, 3, H), 0xABCD, dtype=np.uint16)
    ds.reader.read_array(part, "hidden/3", start, stop, big[:n, 1])
    want = ds[2]["hidden"][LAYERS.index(3)].view(torch.uint16).numpy()
    assert np.array_equal(big[:n, 1], want)
    assert (big[:, [0, 2]] == 0xABCD).all() and (big[n:] == 0xABCD).all()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_dataloader_workers_hand_over_each_batch_as_one_shared_buffer(tmp_path, method):
    parts = synthetic_parts(parts=2)
    ds = TargetCacheDataset(write_store(str(tmp_path / "c.zarr"), parts))
    ds[0]  # opened in the parent first: a worker opens the store again
    sampler = ResumableBatchSampler(ds.lengths(), batch_size=3, seed=0)
    want = [collate([ds[i] for i in b]) for b in sampler.batches(0)]
    loader = torch.utils.data.DataLoader(Batches(ds), sampler=sampler, batch_size=None, num_workers=2,
                                         multiprocessing_context=mp.get_context(method), timeout=120)
    got = list(loader)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same_batch(g, w)
        tensors = [v for v in g.values() if isinstance(v, torch.Tensor)]
        # made in shared memory by the worker, every tensor a view of one buffer: torch sends it once,
        # as is, instead of a file descriptor per tensor (or a copy into shared memory)
        assert all(t.is_shared() for t in tensors)
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1


def _check_threads_here(batch):
    return get_worker_info().dataset.dataset.reader.check_threads


@pytest.mark.parametrize("given, used", [(None, 0), (2, 2)])
def test_a_worker_checks_in_its_reading_thread_unless_told_otherwise(tmp_path, given, used):
    """DataLoader workers already keep the cores busy: a checksum thread in each only competes with them."""
    ds = TargetCacheDataset(write_store(str(tmp_path / "c.zarr"), synthetic_parts(parts=1)), check_threads=given)
    assert ds.reader.check_threads == (given if given is not None else CacheReader.check_threads)
    loader = torch.utils.data.DataLoader(Batches(ds), sampler=[[0, 1]], batch_size=None, num_workers=1,
                                         collate_fn=_check_threads_here, multiprocessing_context=mp.get_context("fork"))
    assert list(loader) == [used]
