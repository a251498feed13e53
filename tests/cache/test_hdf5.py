"""The HDF5 backend beyond the conformance suite: plain h5py sees what the loader returns, the
recorded chunk table is HDF5's own, `deepspec cache convert` is lossless both ways, the cache stage
writes it, and a draft trained on a Zarr store and on its HDF5 conversion sees identical batches."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from deepspec.cache.tools.convert import convert
from deepspec.cache.spec.format import part_arrays
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.tools.verify import verify
from deepspec.loader.dataset import TargetCacheDataset
from tests.cache.test_cache import LAYERS, array_hashes, build, regen_rows, workdir


@pytest.fixture(scope="module")
def h5_cache(small_cache, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("h5") / "cache.h5d"
    convert(str(small_cache), str(dst))
    return dst


def same_samples(a: str, b: str, options=None) -> None:
    da, db = TargetCacheDataset(a), TargetCacheDataset(b, storage_options=options)
    assert len(da) == len(db) > 0
    for i in range(len(da)):
        x, y = da[i], db[i]
        assert x.keys() == y.keys() and x["sample_id"] == y["sample_id"]
        for k in ("input_ids", "loss_mask", "hidden", "last_hidden"):
            assert x[k].dtype == y[k].dtype and torch.equal(x[k].view(torch.uint8) if x[k].is_floating_point()
                                                            else x[k], y[k].view(torch.uint8)
                                                            if y[k].is_floating_point() else y[k]), (i, k)


def test_part_files_open_with_plain_h5py_and_every_dataset_equals_the_loader(h5_cache):
    import h5py

    reader = CacheReader(str(h5_cache))
    assert reader.storage == "hdf5"
    assert sorted(os.listdir(h5_cache)) == ["index", "manifest.json", "parts"]
    # the consolidated index: one file named by its content, a plain [samples, 6] uint64 dataset
    assert [f"index/{n}" for n in os.listdir(h5_cache / "index")] == [reader.manifest.index["key"]]
    with h5py.File(h5_cache / reader.manifest.index["key"], "r") as f:
        assert f["index"].shape == (len(reader), 6) and list(f.attrs["columns"])[-2:] == ["key_hi", "key_lo"]
        assert np.array_equal(f["index"][:, 4:], reader.keys())
    assert sorted(os.listdir(h5_cache / "parts")) == sorted(f"{p}.h5" for p in reader.parts)
    for p, name in enumerate(reader.parts):
        with h5py.File(h5_cache / "parts" / f"{name}.h5", "r") as f:
            for array in part_arrays(reader.layers, reader.dtype):
                d = f[array]
                assert d.fletcher32 and d.chunks is not None, array
                rows = d.shape[0]
                assert np.array_equal(d[...], reader.read_array(p, array, 0, rows)), (name, array)
            assert f.attrs["committed"] and int(f.attrs["samples"]) == reader.entries[p].samples


def test_the_recorded_chunk_table_is_hdf5s_own(h5_cache):
    import h5py

    reader = CacheReader(str(h5_cache))
    for p, name in enumerate(reader.parts):
        with h5py.File(h5_cache / "parts" / f"{name}.h5", "r") as f:
            for array in part_arrays(reader.layers, reader.dtype):
                layout = reader.array_layout(p, array)
                d = f[array].id
                own = [d.get_chunk_info(i) for i in range(d.get_num_chunks())]
                assert [(i.byte_offset, i.size) for i in own] == [tuple(int(v) for v in r) for r in layout.table]


def test_convert_is_bitwise_both_ways(small_cache, h5_cache, tmp_path):
    same_samples(str(small_cache), str(h5_cache))
    back = tmp_path / "back.zarr"
    convert(str(h5_cache), str(back))
    assert CacheReader(str(back)).storage == "zarr"
    assert array_hashes(str(back)) == array_hashes(str(small_cache))  # the same shard bytes
    a, b = CacheReader(str(small_cache)).manifest, CacheReader(str(back)).manifest
    assert a.content() == b.content() and [p.to_dict() for p in a.parts] == [p.to_dict() for p in b.parts]
    assert verify(str(h5_cache))["ok"]


def test_convert_refuses_a_destination_that_holds_anything(small_cache, tmp_path):
    from deepspec.cache.spec.format import CacheFormatError

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("keep")
    with pytest.raises(CacheFormatError, match="not empty"):
        convert(str(small_cache), str(tmp_path / "x"))
    assert os.listdir(tmp_path / "x") == ["notes.txt"]


def test_cli_convert_and_info(small_cache, tmp_path):
    from deepspec.cli import main

    assert main(["cache", "convert", str(small_cache), str(tmp_path / "c.h5d"), "--codec", "blosc-zstd"]) == 0
    assert main(["cache", "info", str(tmp_path / "c.h5d")]) == 0
    m = CacheReader(str(tmp_path / "c.h5d")).manifest
    assert (m.storage, m.codec) == ("hdf5", "blosc-zstd")
    same_samples(str(small_cache), str(tmp_path / "c.h5d"))


def test_hdf5_on_s3_is_one_object_per_part_and_reads_back(h5_cache, moto):
    bucket = moto.bucket("h5-s3")
    url = f"s3://{bucket}/store"
    convert(str(h5_cache), url, storage="hdf5", dst_storage_options=moto.storage_options)
    keys = sorted(o["Key"] for o in moto.client().list_objects_v2(Bucket=bucket)["Contents"])
    parts = CacheReader(str(h5_cache)).parts
    index = CacheReader(url, moto.storage_options).manifest.index["key"]
    assert keys == [f"store/{index}", "store/manifest.json"] + sorted(f"store/parts/{p}.h5" for p in parts)
    same_samples(str(h5_cache), url, moto.storage_options)
    assert verify(url, moto.storage_options)["ok"]


def test_part_file_is_fsynced_before_it_is_linked_and_listed(tmp_path, monkeypatch):
    """The commit order on a filesystem: the complete temp file reaches the disk, then its final name
    is created (the commit), then parts/ is fsynced, then the manifest is replaced."""
    from deepspec.cache.write.writer import CacheWriter
    from tests.cache.test_conformance import make_part, manifest

    events = []
    real_fsync, real_link, real_replace = os.fsync, os.link, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def link(src, dst, **kw):
        events.append(("link", os.path.abspath(dst), os.path.abspath(src)))
        return real_link(src, dst, **kw)

    def replace(src, dst, **kw):
        events.append(("replace", os.path.abspath(dst)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "replace", replace)
    url = (tmp_path / "s").resolve()
    with CacheWriter(str(url), manifest("hdf5")) as w:
        w.submit(make_part("p000000", 1))
    monkeypatch.undo()
    i = next(k for k, e in enumerate(events) if e[0] == "link")
    tmp = events[i][2]
    assert events[i][1] == str(url / "parts" / "p000000.h5")
    assert ("fsync", tmp) in events[:i]
    j = next(k for k, e in enumerate(events) if k > i and e == ("replace", str(url / "manifest.json")))
    assert ("fsync", str(url / "parts")) in events[i:j]
    assert not list((url / "parts").glob("*.partial"))


def test_cache_stage_writes_hdf5_equal_to_zarr(tmp_path, trained_target):
    rows = regen_rows(12)
    z = workdir(tmp_path / "z", trained_target, rows)
    h = workdir(tmp_path / "h", trained_target, rows)
    build(z, part_tokens=200)
    report = build(h, part_tokens=200, format="hdf5")
    url = str(h / "data" / "cache.zarr")
    assert report["manifest"]["storage"] == "hdf5" and CacheReader(url).storage == "hdf5"
    same_samples(str(z / "data" / "cache.zarr"), url)
    build(h, part_tokens=200, format="hdf5")  # a rerun finds everything and writes nothing new
    build(h, part_tokens=200)  # switching the format is a content change: rebuilt in place as Zarr
    assert CacheReader(url).storage == "zarr"
    assert array_hashes(url) == array_hashes(str(z / "data" / "cache.zarr"))
    assert not (Path(url) / "manifest.json").exists()
    assert json.loads((Path(url) / "zarr.json").read_text())["attributes"]["layers"] == LAYERS


def test_a_draft_trained_on_zarr_and_on_its_hdf5_conversion_sees_identical_batches(small_cache, h5_cache,
                                                                                   trained_target, tmp_path):
    from safetensors.torch import load_file

    from deepspec.config import TrainConfig
    from deepspec.train.run import build_trainer, run_training

    cfg = TrainConfig(block_size=3, draft_layers=1, markov_rank=16, anchors_per_sample=6, batch_size=4, steps=6,
                      lr=5e-3, warmup_steps=2, checkpoint_every=100, seed=0)
    streams = []
    for name, url in (("zarr", small_cache), ("hdf5", h5_cache)):
        trainer = build_trainer(cfg, LAYERS, str(url), trained_target, tmp_path / name / "out",
                                tmp_path / name / "state")
        batches = trainer.batches()
        streams.append([next(batches) for _ in range(2 * len(trainer.sampler))])  # two epochs
    assert len(streams[0]) == len(streams[1]) > 0
    for a, b in zip(*streams):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
            else:
                assert a[k] == b[k], k
    for name, url in (("zarr", small_cache), ("hdf5", h5_cache)):
        run_training(cfg, LAYERS, str(url), trained_target, tmp_path / name / "draft", tmp_path / name / "train",
                     tmp_path / name / "state2")
    wa = load_file(next((tmp_path / "zarr" / "draft").glob("*.safetensors")))
    wb = load_file(next((tmp_path / "hdf5" / "draft").glob("*.safetensors")))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


GC_ON_FSSPEC_THREAD = r"""
import gc, sys
import h5py
from deepspec.cache.backends.hdf5.read import HDF5Store

url, endpoint = sys.argv[1:3]
store = HDF5Store(url, {"endpoint_url": endpoint, "key": "testing", "secret": "testing"})
held = [[h5py.h5p.create(h5py.h5p.FILE_ACCESS)]]  # an h5py object that only a reference cycle will keep
held[0].append(held[0])
real = type(store.fs)._call_s3

async def _call_s3(self, method, *args, **kwargs):
    # on fsspec's IO thread, serving a read h5py makes while it holds its lock: what an automatic
    # collection starting here does (one runs only while collection is enabled)
    if method == "get_object" and held and gc.isenabled():
        held.clear()
        gc.collect()
    return await real(self, method, *args, **kwargs)

type(store.fs)._call_s3 = _call_s3
print(sorted(store.committed_parts()))
"""


def test_a_collection_on_fsspecs_io_thread_during_an_hdf5_read_on_s3_does_not_deadlock(moto, tmp_path):
    """h5py holds its global lock while it reads through the S3 file object, whose reads wait for
    fsspec's IO thread; a cyclic collection there that frees an h5py object needs that lock
    (h5py/h5py#2019). A remote part is read with automatic collection off. In a subprocess: the
    deadlock it guards against would leave this process's fsspec loop stuck for every later test."""
    import subprocess
    import sys

    from tests.cache.test_conformance import make_part, write
    from tests.conftest import REPO, project_env

    url = f"s3://{moto.bucket('h5-gc')}/store"
    write(("hdf5", url, moto.storage_options), [make_part("p000000", 1)])
    try:
        out = subprocess.run([sys.executable, "-c", GC_ON_FSSPEC_THREAD, url, moto.endpoint], cwd=tmp_path,
                             env=project_env(REPO, **moto.env), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("reading an HDF5 part on S3 deadlocked (a collection on fsspec's IO thread freed an h5py object)")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["['p000000']"]
