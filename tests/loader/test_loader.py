"""Loader: round trips (local + S3), layer subsets, corruption, sampler, DataLoader workers."""
import multiprocessing as mp
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from deepspec.cache.read.checks import ChecksumError
from deepspec.cache.spec.format import CacheFormatError, encode_hidden, decode_hidden
from deepspec.cache.write.part_data import PartData
from deepspec.cache.write.writer import CacheWriter
from deepspec.loader.collate import collate
from deepspec.loader.dataset import TargetCacheDataset
from deepspec.loader.prefetch import Prefetcher
from deepspec.loader.sampler import ResumableBatchSampler

H = 24
LAYERS = [-1, 3, 7]


def synthetic_parts(seed=0, parts=3, samples=6):
    rng = np.random.default_rng(seed)
    out, sid = [], 1
    for p in range(parts):
        lens = rng.integers(1, 150, size=samples)
        T = int(lens.sum())
        hidden = {k: torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32) * (1 + 10 * (k == 3)))
                  for k in [*LAYERS, "last"]}
        hidden[3][:, 5] *= 50  # an outlier channel, as real activations have
        out.append(PartData(f"p{p:06d}", np.arange(sid, sid + samples, dtype=np.uint64), lens,
                            rng.integers(0, 5000, T).astype(np.int32), rng.integers(0, 2, T).astype(np.uint8),
                            hidden))
        sid += samples
    return out


def write_store(url, parts, dtype="bfloat16", codec="none", storage_options=None, chunk_tokens=16, storage="zarr"):
    manifest = {"target": {"id": "t", "hidden_size": H}, "layers": LAYERS, "dtype": dtype, "codec": codec,
                "max_length": 4096, "chunk_tokens": chunk_tokens, "hidden_size": H, "storage": storage}
    w = CacheWriter(url, manifest, storage_options)
    for part in parts:
        w.submit(part)
    w.close()
    w.write_manifest()
    w.release()
    return url


def expected(parts, dtype):
    """What every sample must read back as: the written values through the format's own encoding."""
    rows = []
    for part in parts:
        offs = np.concatenate([[0], np.cumsum(part.lengths)])
        enc = {k: encode_hidden(v, dtype) for k, v in part.hidden.items()}
        for i in range(len(part.lengths)):
            a, b = offs[i], offs[i + 1]
            rows.append({"input_ids": part.input_ids[a:b], "loss_mask": part.loss_mask[a:b],
                         "sample_id": int(part.sample_ids[i]),
                         **{k: decode_hidden(bits[a:b], None if s is None else s[a:b], dtype)
                            for k, (bits, s) in enc.items()}})
    return rows


def check_round_trip(ds, parts, dtype, layers=LAYERS):
    want = expected(parts, dtype)
    assert len(ds) == len(want)
    for i, w in enumerate(want):
        got = ds[i]
        assert got["sample_id"] == w["sample_id"]
        assert got["input_ids"].dtype == torch.int32 and got["loss_mask"].dtype == torch.uint8
        assert np.array_equal(got["input_ids"].numpy(), w["input_ids"])
        assert np.array_equal(got["loss_mask"].numpy(), w["loss_mask"])
        assert got["hidden"].dtype == torch.bfloat16 and got["hidden"].shape == (len(layers), len(w["input_ids"]), H)
        for k, layer in enumerate(layers):
            assert torch.equal(got["hidden"][k], w[layer]), (i, layer)
        assert torch.equal(got["last_hidden"], w["last"])


@pytest.mark.parametrize("dtype, codec", [("bfloat16", "none"), ("bfloat16", "blosc-zstd"),
                                          ("bfloat16", "blosc-lz4"), ("fp8", "none"), ("fp8", "blosc-zstd")])
def test_local_round_trip_every_field(tmp_path, dtype, codec):
    parts = synthetic_parts()
    url = write_store(str(tmp_path / "c.zarr"), parts, dtype, codec)
    for fast in (True, False):
        check_round_trip(TargetCacheDataset(url, fast=fast), parts, dtype)
    if dtype == "bfloat16":  # lossless: equal to the bf16 of the written floats
        ds = TargetCacheDataset(url)
        assert torch.equal(ds[0]["last_hidden"], parts[0].hidden["last"][:parts[0].lengths[0]].to(torch.bfloat16))


def test_layer_subset_and_fields(tmp_path):
    parts = synthetic_parts(parts=1)
    url = write_store(str(tmp_path / "c.zarr"), parts)
    ds = TargetCacheDataset(url, layers=[7, -1])
    check_round_trip(ds, parts, "bfloat16", layers=[7, -1])
    slim = TargetCacheDataset(url, fields=("input_ids", "loss_mask"))
    assert set(slim[0]) == {"input_ids", "loss_mask", "sample_id"}
    with pytest.raises(CacheFormatError, match=r"layers \[9\] are not cached \(cached layers: \[-1, 3, 7\]\)"):
        TargetCacheDataset(url, layers=[3, 9])


def test_corrupted_chunk_raises_naming_it(tmp_path):
    parts = synthetic_parts(parts=1)
    url = write_store(str(tmp_path / "c.zarr"), parts)
    shard = Path(url) / "parts" / "p000000" / "hidden" / "7" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    chunk_bytes = 16 * H * 2 + 4
    data[2 * chunk_bytes + 10] ^= 0x01  # one bit inside chunk 2
    shard.write_bytes(bytes(data))
    ds = TargetCacheDataset(url)
    with pytest.raises(ChecksumError, match=r"parts/p000000/hidden/7/c/0/0: chunk 2 checksum mismatch"):
        for i in range(len(ds)):
            ds[i]
    assert TargetCacheDataset(url, layers=[3])[0]  # the damage is confined to the corrupted array


def test_checks_on_checksum_threads_match_and_still_catch_a_flipped_bit(tmp_path, monkeypatch):
    """The threaded path (check_threads > 0, tasks of CHECK_BYTES): same values as checking inline,
    and a corrupt chunk raises from the item (never handed out), naming array and chunk, even when
    the damaged array's checks are still running while later arrays of the sample are read."""
    import threading

    import deepspec.cache.read.shards as shard_reader_mod
    monkeypatch.setattr(shard_reader_mod, "CHECK_BYTES", 2 * (16 * H * 2 + 4))  # two chunks a task at H = 24
    parts = synthetic_parts(parts=2)
    url = write_store(str(tmp_path / "c.zarr"), parts)
    threaded = TargetCacheDataset(url, check_threads=3)
    check_round_trip(threaded, parts, "bfloat16")
    assert any(t.name.startswith("crc32c") for t in threading.enumerate())  # the checks ran on helper threads
    shard = Path(url) / "parts" / "p000001" / "hidden" / "3" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[3 * (16 * H * 2 + 4) + 7] ^= 0x10  # one bit inside chunk 3
    shard.write_bytes(bytes(data))
    ds = TargetCacheDataset(url, check_threads=3)
    with pytest.raises(ChecksumError, match=r"parts/p000001/hidden/3/c/0/0: chunk 3 checksum mismatch"):
        for i in range(len(ds)):
            ds[i]
    reader = ds.reader
    with pytest.raises(ChecksumError, match=r"p000001/hidden/3/c/0/0: chunk 3 checksum mismatch"):
        for i in range(int(reader.part_start[1]), len(reader)):
            reader.read(i)
    with pytest.raises(ChecksumError, match="chunk 3 checksum mismatch"):  # one array read outside a sample too
        reader.read_array(1, "hidden/3", 0, int(reader._offsets[1][-1]))
    assert TargetCacheDataset(url, layers=[7], check_threads=3)[len(ds) - 1]  # other arrays read fine


def test_s3_round_trip_with_and_without_local_cache(tmp_path, moto):
    bucket = moto.bucket("loader-rt")
    parts = synthetic_parts()
    url = write_store(f"s3://{bucket}/c.zarr", parts, "bfloat16", "blosc-lz4", moto.storage_options)
    check_round_trip(TargetCacheDataset(url, storage_options=moto.storage_options), parts, "bfloat16")
    cached = TargetCacheDataset(url, storage_options=moto.storage_options, cache_dir=str(tmp_path / "blocks"))
    check_round_trip(cached, parts, "bfloat16")
    assert list((tmp_path / "blocks").glob("*/parts/p000001/hidden/3/zarr.json"))  # the part mirror, per store content
    url8 = write_store(f"s3://{bucket}/c8.zarr", parts, "fp8", "none", moto.storage_options)
    check_round_trip(TargetCacheDataset(url8, storage_options=moto.storage_options), parts, "fp8")
    # corrupt one object in the bucket: the reader refuses it
    key = "c.zarr/parts/p000001/hidden/3/c/0/0"
    s3 = moto.client()
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[40] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    ds = TargetCacheDataset(url, storage_options=moto.storage_options)
    with pytest.raises(ChecksumError, match="p000001/hidden/3/c/0/0: chunk 0 checksum mismatch"):
        ds[6]


def test_s3_read_ahead_keeps_requests_in_flight_and_reads_the_same_samples(moto, monkeypatch):
    """A sampler's batch through __getitems__ with read_ahead 8 (arrays cut into 2,000-byte ranges):
    the same samples as one request at a time, with more than one request in flight at once."""
    import asyncio

    dtype = "bfloat16"  # fp8's decode after the read is the local round trip's (same __getitems__)
    bucket = moto.bucket("loader-read-ahead")
    parts = synthetic_parts(parts=2)
    url = write_store(f"s3://{bucket}/c.zarr", parts, dtype, "none", moto.storage_options)
    want = expected(parts, dtype)
    serial = TargetCacheDataset(url, storage_options=moto.storage_options, read_ahead=1)
    ahead = TargetCacheDataset(url, storage_options=moto.storage_options, read_ahead=8, range_bytes=2000)
    ahead[0]  # open the store and the shard indexes first: what follows is sample reads only
    fs = ahead.reader._process_state()[2].fs
    original, now, peak = fs._cat_file, [0], [0]

    async def counting(*args, **kwargs):
        now[0] += 1
        peak[0] = max(peak[0], now[0])
        try:
            await asyncio.sleep(0.01)  # hold the slot a little, as a real network round trip does
            return await original(*args, **kwargs)
        finally:
            now[0] -= 1

    monkeypatch.setattr(fs, "_cat_file", counting)
    for batch in ResumableBatchSampler(serial.lengths(), batch_size=5, seed=3):
        got, ref = ahead.__getitems__(batch), serial.__getitems__(batch)
        for i, g, r in zip(batch, got, ref):
            assert g["sample_id"] == r["sample_id"] == want[i]["sample_id"]
            for key in ("input_ids", "loss_mask", "hidden", "last_hidden"):
                assert torch.equal(g[key], r[key]), (i, key)
            assert torch.equal(g["hidden"][1], want[i][3]) and torch.equal(g["last_hidden"], want[i]["last"])
    assert peak[0] > 1


# ---- sampler ---------------------------------------------------------------------------------------

LENGTHS = np.random.default_rng(1).integers(1, 300, size=103)


def test_same_seed_same_order_and_epochs_differ():
    a = ResumableBatchSampler(LENGTHS, batch_size=4, seed=3)
    b = ResumableBatchSampler(LENGTHS, batch_size=4, seed=3)
    assert list(a) == list(b)
    assert a.batches(0) != a.batches(1)
    assert ResumableBatchSampler(LENGTHS, batch_size=4, seed=4).batches(0) != a.batches(0)
    flat = sorted(i for batch in a.batches(0) for i in batch)
    assert flat == list(range(len(LENGTHS)))


PARTS = np.sort(np.random.default_rng(2).integers(0, 11, size=len(LENGTHS)))  # 11 parts of uneven size


@pytest.mark.parametrize("window", [1, 3, 11])
def test_a_window_of_parts_is_read_before_the_next_and_every_sample_once(window):
    s = ResumableBatchSampler(LENGTHS, batch_size=4, seed=5, parts=PARTS, window_parts=window)
    for epoch in (0, 1):
        order = [i for b in s.batches(epoch) for i in b]
        assert sorted(order) == list(range(len(LENGTHS)))
        parts_seen = [int(PARTS[i]) for i in order]
        windows, seen = [], set()
        for p in parts_seen:  # the windows in the order their parts first appear
            if p not in seen:
                seen.add(p)
                windows.append(p)
        assert s.part_order(epoch) == windows  # what a read-through run computes the parts in
        groups = [set(windows[w:w + window]) for w in range(0, len(windows), window)]
        at = 0
        for group in groups:  # all samples of one window come before any of the next
            n = int(np.isin(PARTS, list(group)).sum())
            assert set(parts_seen[at:at + n]) == group
            at += n
    assert s.batches(0) != s.batches(1)
    assert ResumableBatchSampler(LENGTHS, batch_size=4, seed=5, parts=PARTS, window_parts=window).batches(0) == s.batches(0)
    with pytest.raises(ValueError, match="window_parts=2 needs the part"):
        ResumableBatchSampler(LENGTHS, window_parts=2)


def test_growing_windows_hold_2_2_4_8_parts_in_the_first_epoch_and_later_epochs_mix_all_samples():
    many = np.repeat(np.arange(40), 3)  # 40 parts of 3 samples
    lengths = np.full(len(many), 10)
    s = ResumableBatchSampler(lengths, batch_size=3, seed=5, parts=many, window_parts="growing")
    order = [i for b in s.batches(0) for i in b]
    assert sorted(order) == list(range(len(many)))
    first_seen = s.part_order(0)
    at = 0
    for size in (2, 2, 4, 8, 16, 8):  # the last window takes what is left (40 parts in all)
        group = set(first_seen[:size])
        first_seen = first_seen[size:]
        assert {int(many[i]) for i in order[at:at + 3 * size]} == group
        at += 3 * size
    assert {int(many[i]) for i in s.batches(0)[0]} <= set(s.part_order(0)[:2])  # the first batch: two parts
    later = [i for b in s.batches(1) for i in b]
    assert sorted(later) == list(range(len(many)))
    assert later == [i for b in ResumableBatchSampler(lengths, batch_size=3, seed=5).batches(1) for i in b]
    with pytest.raises(ValueError, match="window_parts='wide'"):
        ResumableBatchSampler(lengths, parts=many, window_parts="wide")


def test_the_gate_sees_each_batch_before_it_is_handed_out():
    s = ResumableBatchSampler(LENGTHS, batch_size=4, seed=5, parts=PARTS, window_parts=3)
    gated, handed = [], []
    s.gate = lambda batch: gated.append((list(batch), len(handed)))
    for batch in s:
        handed.append(batch)
    assert [b for b, _ in gated] == handed and [n for _, n in gated] == list(range(len(handed)))


@pytest.mark.parametrize("kw", [dict(batch_size=5), dict(batch_size=4, token_budget=600, group_by_length=True),
                                dict(batch_size=3, parts=PARTS, window_parts=4),
                                dict(batch_size=3, parts=PARTS, window_parts="growing")])
def test_resume_mid_epoch_continues_exactly(kw):
    full = ResumableBatchSampler(LENGTHS, seed=9, **kw)
    run = [b for _ in range(2) for b in full]  # two epochs uninterrupted
    first = ResumableBatchSampler(LENGTHS, seed=9, **kw)
    it = iter(first)
    done = [next(it) for _ in range(7)]
    state = first.state_dict(epoch=0, position=7)
    resumed = ResumableBatchSampler(LENGTHS, seed=9, **kw)
    resumed.load_state_dict(state)
    rest = list(resumed) + list(resumed)
    assert done + rest == run


def test_ranks_are_disjoint_and_complete():
    world = 3
    samplers = [ResumableBatchSampler(LENGTHS, batch_size=2, seed=1, rank=r, world_size=world) for r in range(world)]
    per_rank = [set(i for b in s.batches(0) for i in b) for s in samplers]
    assert all(not (per_rank[i] & per_rank[j]) for i in range(world) for j in range(i + 1, world))
    union = set().union(*per_rank)
    global_batches = samplers[0].global_batches(0)
    assert union == set(i for b in global_batches for i in b)
    assert len(union) >= len(LENGTHS) - 2 * world  # at most world-1 trailing batches are cut
    assert len({len(s) for s in samplers}) == 1  # every rank takes the same number of steps
    budget = [ResumableBatchSampler(LENGTHS, batch_size=4, token_budget=700, seed=1, rank=r, world_size=2)
              for r in range(2)]
    for b in budget[0].batches(0) + budget[1].batches(0):
        assert max(LENGTHS[b]) * len(b) <= 700 or len(b) == 1


def test_changed_world_size_is_refused():
    state = ResumableBatchSampler(LENGTHS, batch_size=2, world_size=2, rank=1).state_dict()
    with pytest.raises(ValueError, match="world_size 2, this run has 4"):
        ResumableBatchSampler(LENGTHS, batch_size=2, world_size=4).load_state_dict(state)


# ---- DataLoader ------------------------------------------------------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_dataloader_with_two_workers_finishes(tmp_path, method):
    parts = synthetic_parts(parts=2)
    url = write_store(str(tmp_path / "c.zarr"), parts)
    ds = TargetCacheDataset(url)
    ds[0]  # open the store in the parent first: workers must not inherit a broken handle
    pickle.loads(pickle.dumps(ds))
    sampler = ResumableBatchSampler(ds.lengths(), batch_size=3, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=2, collate_fn=collate,
                                         multiprocessing_context=mp.get_context(method), timeout=120)
    seen = []
    for batch in Prefetcher(loader, "cpu"):
        assert batch["input_ids"].dtype == torch.int64
        assert batch["hidden"].shape[:2] == batch["input_ids"].shape
        assert batch["tokens"] == int(batch["lengths"].sum())
        seen += batch["sample_id"]
    assert sorted(seen) == sorted(int(i) for p in parts for i in p.sample_ids)


def test_collate_pads_right_and_counts_tokens_on_the_host(monkeypatch):
    from deepspec.loader import collate as module

    real = module.host_empty  # memory a batch is carved from may hold anything: the padding must be written
    monkeypatch.setattr(module, "host_empty", lambda shape, dtype: real(shape, dtype).fill_(7))
    hid = torch.arange(2 * 3 * 4, dtype=torch.bfloat16).view(2, 3, 4)  # [L=2, T=3, H=4]
    a = {"input_ids": torch.tensor([1, 2, 3], dtype=torch.int32), "loss_mask": torch.tensor([0, 1, 1], dtype=torch.uint8),
         "hidden": hid, "sample_id": 5}
    b = {"input_ids": torch.tensor([4], dtype=torch.int32), "loss_mask": torch.tensor([1], dtype=torch.uint8),
         "hidden": torch.full((2, 1, 4), 2.0, dtype=torch.bfloat16), "sample_id": 6}
    batch = collate([a, b])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]] and batch["input_ids"].dtype == torch.int32
    assert "attention_mask" not in batch  # derivable from lengths; no model reads it
    assert batch["tokens"] == 4 and isinstance(batch["tokens"], int)  # never read back from the device
    assert batch["hidden"].shape == (2, 3, 8)
    assert torch.equal(batch["hidden"][0, 1], torch.cat([hid[0, 1], hid[1, 1]]))  # token-major, layers side by side
    assert batch["hidden"][1, 1:].abs().sum() == 0 and batch["lengths"].tolist() == [3, 1]


def _collate_in_worker(samples):
    batch = collate(samples)
    batch["shared"] = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.is_shared()]
    return batch


def test_collate_writes_each_output_once_and_in_shared_memory_inside_a_worker(tmp_path):
    parts = synthetic_parts(parts=2)
    ds = TargetCacheDataset(write_store(str(tmp_path / "c.zarr"), parts))
    sampler = ResumableBatchSampler(ds.lengths(), batch_size=3, seed=0)
    want = [collate([ds[i] for i in b]) for b in sampler.batches(0)]
    for batch in want:
        for row, n in enumerate(batch["lengths"].tolist()):
            for key in ("input_ids", "loss_mask", "hidden", "last_hidden"):
                assert not batch[key][row, n:].any(), key
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=1, collate_fn=_collate_in_worker)
    got = list(loader)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        # made in shared memory by the worker: torch sends such a tensor as is instead of copying it there
        assert set(g.pop("shared")) >= {"input_ids", "loss_mask", "hidden", "last_hidden"}
        for k, v in w.items():
            assert torch.equal(g[k], v) if isinstance(v, torch.Tensor) else g[k] == v


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefetcher_overlaps_and_matches(tmp_path):
    parts = synthetic_parts(parts=2)
    url = write_store(str(tmp_path / "c.zarr"), parts)
    ds = TargetCacheDataset(url)
    sampler = ResumableBatchSampler(ds.lengths(), batch_size=3, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=collate, pin_memory=True)
    host = [collate([ds[i] for i in b]) for b in sampler.batches(0)]
    for want, got in zip(host, Prefetcher(loader, "cuda")):
        assert got["hidden"].is_cuda and got["input_ids"].dtype == torch.int64
        assert torch.equal(got["hidden"].cpu(), want["hidden"])
