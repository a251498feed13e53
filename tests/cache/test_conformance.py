"""One conformance suite for every store backend (deepspec.cache.backends.base.CacheStore), run unchanged
against Zarr and HDF5, on local disk and on S3 (moto), the way zarr-python tests its stores.

It states the writer's rules (docs/cache-format.md §7): every array round-trips bit for bit through
the loader; a committed part is never rewritten; an interrupted writer leaves the store reading as
its last consolidation and a rerun is byte-identical to an uninterrupted build; growth changes
nothing but the manifest and the index; a new manifest lists exactly the parts it is given (a local
store then holds only those); ranks of one job write disjoint parts and rank 0 lists them all; a
damaged committed part is dropped and written again; corruption is named by part, array and chunk.
"""
import hashlib
import multiprocessing
import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from deepspec.cache.backends.base import detect
from deepspec.cache.read.checks import ChecksumError
from deepspec.cache.spec.format import CacheFormatError, hidden_name
from deepspec.cache.spec.manifest import Manifest, PartEntry
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.tools.verify import verify
from deepspec.cache.write.part_data import PartData
from deepspec.cache.write.writer import CacheWriter

H = 16
LAYERS = [0, 2]


def manifest(kind: str, dtype: str = "bfloat16", codec: str = "none", **kw) -> dict:
    return dict({"target": {"id": "conformance", "hidden_size": H, "architecture": "test"}, "layers": LAYERS,
                 "dtype": dtype, "codec": codec, "max_length": 64, "chunk_tokens": 4, "hidden_size": H,
                 "storage": kind}, **kw)


def make_part(name: str, seed: int, dtype: str = "bfloat16", samples: int = 3) -> PartData:
    """A deterministic part: lengths 5.., ids from the seed, hidden values with a wide range."""
    from deepspec.cache.spec.format import encode_hidden

    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 11, size=samples).astype(np.int64)
    t = int(lengths.sum())
    hidden = {}
    for layer in [*LAYERS, "last"]:
        x = torch.from_numpy(rng.standard_normal((t, H)).astype(np.float32) * 10 ** rng.uniform(-2, 2))
        hidden[layer] = encode_hidden(x, dtype)
    return PartData(name, (np.arange(samples, dtype=np.uint64) + 1000 * seed + 1), lengths,
                    rng.integers(0, 4096, size=t).astype(np.int32), rng.integers(0, 2, size=t).astype(np.uint8),
                    hidden)


@pytest.fixture(params=["zarr-local", "hdf5-local", "zarr-s3", "hdf5-s3"])
def where(request, tmp_path):
    """(backend kind, store url, storage options)."""
    kind, place = request.param.split("-")
    if place == "local":
        return kind, str(tmp_path / "store"), None
    moto = request.getfixturevalue("moto")
    bucket = f"conf-{uuid.uuid4().hex[:12]}"
    moto.bucket(bucket)
    return kind, f"s3://{bucket}/store", moto.storage_options


def local_only(where):
    if where[1].startswith("s3://"):
        pytest.skip("a local-filesystem rule (S3 PUTs are atomic)")


def files(url: str, options) -> dict[str, str]:
    """Every file/object of a store -> sha256 of its bytes."""
    import fsspec

    from deepspec.cache.storage.urls import storage_options_for

    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, options))
    fs.invalidate_cache()
    return {p[len(root):]: hashlib.sha256(fs.cat_file(p)).hexdigest() for p in sorted(fs.find(root))}


def write(where, parts, **kw) -> None:
    kind, url, options = where
    with CacheWriter(url, manifest(kind, **kw), options) as w:
        for p in parts:
            w.submit(p)


def expect_equal(reader: CacheReader, parts: list[PartData]) -> None:
    k = 0
    for part in parts:
        offsets = np.concatenate([[0], np.cumsum(part.lengths)])
        for s in range(len(part.lengths)):
            a, b = offsets[s], offsets[s + 1]
            got = reader.read(k)
            assert reader.sample_id(k) == int(part.sample_ids[s])
            assert np.array_equal(got["input_ids"], part.input_ids[a:b])
            assert np.array_equal(got["loss_mask"], part.loss_mask[a:b])
            for layer in [*LAYERS, "last"]:
                bits, scale = part.hidden[layer]
                key = layer if layer != "last" else "last"
                assert np.array_equal(got[key][0], bits[a:b]), (k, layer)
                if scale is not None:
                    assert np.array_equal(got[key][1], scale[a:b])
            k += 1
    assert k == len(reader)


@pytest.mark.parametrize("dtype,codec", [("bfloat16", "none"), ("fp8", "blosc-zstd"), ("bfloat16", "blosc-lz4")])
def test_every_array_round_trips_bitwise_on_both_paths(where, dtype, codec):
    if where[1].startswith("s3://") and (dtype, codec) != ("fp8", "blosc-zstd"):
        pytest.skip("values and codecs do not depend on the location: one combination on S3")
    parts = [make_part("p000000", 1, dtype), make_part("p000001", 2, dtype, samples=1)]
    write(where, parts, dtype=dtype, codec=codec)
    kind, url, options = where
    assert detect(url, options) == kind
    for fast in (True, False):
        for checks in (True, False):
            reader = CacheReader(url, options, fast=fast, verify=checks)
            assert isinstance(reader.manifest, Manifest) and reader.manifest.storage == kind
            assert [p.name for p in reader.manifest.parts] == ["p000000", "p000001"]
            assert reader.manifest.num_samples == 4 and reader.manifest["layers"] == LAYERS
            expect_equal(reader, parts)
    assert verify(url, options)["ok"]


def test_a_part_that_exists_is_never_overwritten(where):
    kind, url, options = where
    write(where, [make_part("p000000", 1)])
    before = files(url, options)
    with CacheWriter(url, manifest(kind), options) as w:
        with pytest.raises(CacheFormatError):
            w.write_part(make_part("p000000", 7))
    assert {k: v for k, v in files(url, options).items() if "parts" in k} == \
        {k: v for k, v in before.items() if "parts" in k}
    expect_equal(CacheReader(url, options), [make_part("p000000", 1)])


def stream(w: CacheWriter, part: PartData, cuts: list[int]) -> None:
    """Hand `part` to the writer as the cache stage does (CacheWriter.stream): its hidden states in
    batches of rows cut at `cuts`, which need not fall on chunk boundaries."""
    header = PartData(part.name, part.sample_ids, part.lengths, part.input_ids, part.loss_mask)
    feed = w.stream(header)
    edges = [0, *cuts, part.tokens]
    for a, b in zip(edges, edges[1:]):
        feed.put({k: (bits[a:b], None if scale is None else scale[a:b]) for k, (bits, scale) in part.hidden.items()})
    feed.close()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype,codec", [("bfloat16", "none"), ("fp8", "blosc-zstd")])
def test_a_streamed_part_is_byte_identical_to_the_part_written_whole(where, dtype, codec, threads):
    """The stage writes a part's shards batch by batch, holding a batch, not the part, on one thread
    or several (CacheWriter's `threads`: a part's arrays at once); the files are those of the part
    handed over whole."""
    kind, url, options = where
    parts = [make_part("p000000", 1, dtype, samples=5), make_part("p000001", 2, dtype, samples=1)]
    write((kind, url + "-whole", options), parts, dtype=dtype, codec=codec)
    with CacheWriter(url, manifest(kind, dtype=dtype, codec=codec), options, threads=threads) as w:
        stream(w, parts[0], [1, 2, 9, parts[0].tokens - 3])  # chunk_tokens is 4: cuts inside chunks
        stream(w, parts[1], [])
    assert files(url, options) == files(url + "-whole", options)
    expect_equal(CacheReader(url, options), parts)


def _write_streamed(kind: str, url: str, parts: list[PartData]) -> None:
    with CacheWriter(url, manifest(kind), threads=3) as w:
        for part in parts:
            stream(w, part, [2, 7])


def test_a_process_forked_after_its_parent_wrote_writes_too(where):
    """A process forked after its parent wrote parts on several threads (a DataLoader worker, a
    multiprocessing fork) inherits the writer's thread pools but none of their threads: its own
    writer still finishes, with the parts it was given."""
    local_only(where)
    kind, url, _ = where
    parts = [make_part("p000000", 1), make_part("p000001", 2)]
    _write_streamed(kind, url, parts[:1])
    child = multiprocessing.get_context("fork").Process(target=_write_streamed, args=(kind, url + "-child", parts))
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, "the forked writer did not finish (it waited on its parent's threads)"
    expect_equal(CacheReader(url + "-child"), parts)


def test_a_streamed_part_stopped_midway_is_not_committed(where):
    """The computation fails after a part's first batch: the writer drops that part, the store lists
    the parts before it, and the rerun ends byte-identical to an uninterrupted build."""
    kind, url, options = where
    parts = [make_part(f"p{i:06d}", i + 1, samples=4) for i in range(3)]
    write((kind, url + "-clean", options), parts)
    w = CacheWriter(url, manifest(kind), options)
    stream(w, parts[0], [5])
    deadline = time.time() + 60
    while "p000000" not in w.committed_parts():  # abort drops queued parts: let the first one commit
        assert time.time() < deadline
        time.sleep(0.02)
    feed = w.stream(PartData(parts[1].name, parts[1].sample_ids, parts[1].lengths, parts[1].input_ids,
                             parts[1].loss_mask))
    feed.put({k: (bits[:6], scale) for k, (bits, scale) in parts[1].hidden.items()})
    w.abort()  # what the stage does when a forward pass raises
    w.release()
    assert CacheReader(url, options).manifest.parts == []  # readers see the last consolidation: none yet
    with CacheWriter(url, manifest(kind), options) as w:
        assert sorted(w.committed_parts()) == ["p000000"]
        for p in parts[1:]:
            stream(w, p, [3])
    assert files(url, options) == files(url + "-clean", options)
    expect_equal(CacheReader(url, options), parts)


def test_an_array_that_fails_on_one_of_several_threads_fails_its_part_and_nothing_else(where):
    """Rows of the wrong width for one array, written while the part's other arrays are written on
    other threads: the writer fails naming the fault, the part is not committed, the parts before
    it are, and a rerun ends byte-identical to an uninterrupted build."""
    kind, url, options = where
    parts = [make_part(f"p{i:06d}", i + 1, samples=4) for i in range(2)]
    write((kind, url + "-clean", options), parts)
    w = CacheWriter(url, manifest(kind), options, threads=3)
    stream(w, parts[0], [5])
    feed = w.stream(PartData(parts[1].name, parts[1].sample_ids, parts[1].lengths, parts[1].input_ids,
                             parts[1].loss_mask))
    bad = {k: (bits[:6], scale) for k, (bits, scale) in parts[1].hidden.items()}
    bad[LAYERS[-1]] = (np.zeros((6, H + 1), np.uint16), None)
    with pytest.raises(CacheFormatError, match=rf"{hidden_name(LAYERS[-1])}: rows of shape \({H + 1},\)"):
        feed.put(bad)
        feed.put({k: (bits[6:], scale) for k, (bits, scale) in parts[1].hidden.items()})
        feed.close()
        w.close()
    w.abort()
    w.release()
    with CacheWriter(url, manifest(kind), options) as w:
        assert sorted(w.committed_parts()) == ["p000000"]
        stream(w, parts[1], [3])
    assert files(url, options) == files(url + "-clean", options)
    expect_equal(CacheReader(url, options), parts)


def test_another_process_sees_a_part_committed_only_once_its_commit_is_done(where):
    """What a trainer asks while capture ranks write (fill_ranks.RanksFill): one part at a time, through
    a store object of its own, never true for a part still being written."""
    from deepspec.cache.backends.readers import open_cache

    kind, url, options = where
    first, second = (make_part(f"p{i:06d}", i + 1, samples=4) for i in range(2))
    w = CacheWriter(url, manifest(kind), options)
    reader = open_cache(url, options)
    assert not reader.part_committed(first.name)
    feed = w.stream(PartData(first.name, first.sample_ids, first.lengths, first.input_ids, first.loss_mask))
    feed.put({k: (bits[:5], scale) for k, (bits, scale) in first.hidden.items()})
    time.sleep(0.2)  # the rows handed over so far reach the part's files
    assert not reader.part_committed(first.name)
    feed.put({k: (bits[5:], scale) for k, (bits, scale) in first.hidden.items()})
    feed.close()
    deadline = time.time() + 60
    while not reader.part_committed(first.name):
        assert time.time() < deadline
        time.sleep(0.02)
    assert first.name in w.committed_parts() and not reader.part_committed(second.name)
    w.close()
    w.release()


def test_a_dropped_s3_shard_uploads_nothing_then_or_when_collected(moto):
    """A part that fails drops its open S3 shards: the upload is aborted, and the file object is
    closed with it, so that closing it again (its __del__, wherever the collector runs it) neither
    uploads the discarded buffer nor raises."""
    import fsspec

    from deepspec.cache.backends.zarr.write import ZarrStoreWriter
    from deepspec.cache.storage.urls import storage_options_for

    bucket = f"conf-{uuid.uuid4().hex[:12]}"
    moto.bucket(bucket)
    url = f"s3://{bucket}/store"
    store = ZarrStoreWriter(url, moto.storage_options)
    sink = store.open_shard("parts/p000000/last_hidden/c/0/0")
    sink.write(b"x" * (6 << 20))  # buffered toward its first upload block
    store.drop_shard(sink)
    assert sink.closed
    sink.close()
    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, moto.storage_options))
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/parts/p000000/last_hidden/c/0/0")


@pytest.mark.parametrize("threads", [1, 3])
def test_an_s3_shard_larger_than_an_upload_block_is_a_create_only_multipart_upload(moto, monkeypatch, threads):
    """A streamed shard goes to S3 as it is written, block by block (the reference's 5.4 GB hidden
    shards exceed S3's 5 GB single PUT), a part's shards one after another or at once; completing
    the upload is conditional, so a shard that exists is never replaced."""
    import fsspec

    from deepspec.cache.storage.urls import storage_options_for
    from deepspec.cache.storage.fenced import PartConflict
    from deepspec.cache.backends.zarr.write import ZarrStoreWriter

    monkeypatch.setattr(ZarrStoreWriter, "UPLOAD_BLOCK", 5 << 20)  # S3's smallest part
    bucket = f"conf-{uuid.uuid4().hex[:12]}"
    moto.bucket(bucket)
    url = f"s3://{bucket}/store"
    rng = np.random.default_rng(3)
    lengths = np.array([200_000, 150_001], dtype=np.int64)
    t = int(lengths.sum())  # 11.2 MB per hidden shard at H = 16
    hidden = {k: (rng.integers(0, 1 << 16, (t, H)).astype(np.uint16), None) for k in [*LAYERS, "last"]}
    part = PartData("p000000", np.array([7, 8], dtype=np.uint64), lengths, rng.integers(0, 4096, t).astype(np.int32),
                    rng.integers(0, 2, t).astype(np.uint8), hidden)
    with CacheWriter(url, manifest("zarr"), moto.storage_options, threads=threads) as w:
        stream(w, part, [1, 99_999, 300_000])
    expect_equal(CacheReader(url, moto.storage_options), [part])
    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, moto.storage_options))
    key = f"parts/p000000/{hidden_name(0)}/c/0/0"
    fs.invalidate_cache()
    etag = fs.info(f"{root}/{key}")["ETag"]
    assert etag.strip('"').endswith("-3")  # a multipart upload's ETag: 3 parts of <= 5 MB

    store = ZarrStoreWriter(url, moto.storage_options)
    sink = store.open_shard(key)
    sink.write(b"\0" * (11 << 20))
    with pytest.raises(PartConflict, match="another writer created"):
        store.finish_shard(key, sink)
    store.drop_shard(sink)
    fs.invalidate_cache()
    assert fs.info(f"{root}/{key}")["ETag"] == etag
    expect_equal(CacheReader(url, moto.storage_options), [part])


def test_an_interrupted_writer_resumes_to_a_byte_identical_store(where, tmp_path):
    """A writer that dies right before committing its third part (its arrays all written) leaves
    the store as it was (no part listed); the rerun writes the rest and the store equals an
    uninterrupted build."""
    kind, url, options = where
    parts = [make_part(f"p{i:06d}", i + 1) for i in range(4)]
    clean = (kind, url + "-clean", options)
    write(clean, parts)

    w = CacheWriter(url, manifest(kind), options)
    real, written = w.store.write_part_deferred, []

    def deferred(name, *args, **kw):
        commit = real(name, *args, **kw)
        written.append(name)
        if len(written) == 3:
            def dying():
                raise KeyboardInterrupt("killed")
            return dying
        return commit

    w.store.write_part_deferred = deferred
    for p in parts:
        w.submit(p)
    with pytest.raises(CacheFormatError, match="killed"):
        w.close()
    w.release()
    assert CacheReader(url, options).manifest.parts == []

    with CacheWriter(url, manifest(kind), options) as w:
        assert sorted(w.committed_parts()) == ["p000000", "p000001"]
        assert w.committed_sample_ids() == {int(i) for p in parts[:2] for i in p.sample_ids}
        for p in parts[2:]:
            w.submit(p)
    assert files(url, options) == files(url + "-clean", options)
    expect_equal(CacheReader(url, options), parts)


def test_commits_run_in_order_and_none_after_one_that_failed(where):
    """Parts are committed on their own thread, behind the writes: in submission order, and a
    failed commit (an I/O error) keeps the parts committed before it and commits none after it
    (they leave nothing the next open does not prune)."""
    kind, url, options = where
    parts = [make_part(f"p{i:06d}", i + 1) for i in range(4)]
    w = CacheWriter(url, manifest(kind), options)
    real, order = w.store.write_part_deferred, []

    def deferred(name, *args, **kw):
        commit = real(name, *args, **kw)

        def failing():
            order.append(name)
            if name == "p000001":
                raise OSError(5, "Input/output error")
            return commit()
        failing.discard = getattr(commit, "discard", lambda: None)
        return failing

    w.store.write_part_deferred = deferred
    with pytest.raises(CacheFormatError, match="Input/output error"):
        for p in parts:
            w.submit(p)
        w.close()
    w.abort()
    w.release()
    assert order == ["p000000", "p000001"]
    with CacheWriter(url, manifest(kind), options) as w:
        assert sorted(w.committed_parts()) == ["p000000"]
        for p in parts[1:]:
            w.submit(p)
    expect_equal(CacheReader(url, options), parts)


def test_growth_adds_parts_and_changes_nothing_but_the_manifest_and_index(where):
    kind, url, options = where
    write(where, [make_part("p000000", 1), make_part("p000001", 2)])
    before = files(url, options)
    write(where, [make_part("p000002", 3)])
    after = files(url, options)
    changed = {k for k in before if after.get(k) != before[k]}
    root = {k for k in before if k.endswith(("/zarr.json", "/manifest.json")) and k.count("/") == 1}
    index = {k for k in before if k.startswith("/index/")}
    assert len(root) == 1 and index and root <= changed <= root | index
    assert not any(k.startswith("/parts/") for k in changed)
    assert all(k in after for k in before if k.startswith("/parts/"))
    assert len(CacheReader(url, options)) == 9


def test_a_manifest_lists_exactly_the_parts_it_is_given_and_a_local_store_keeps_only_those(where):
    """What the cache stage does when its input loses rows: the new root lists the planned parts in
    plan order; readers see only them; a local store deletes the others, a store on S3 keeps them as
    a pool (another experiment's manifest may still list them)."""
    kind, url, options = where
    parts = [make_part(f"p{i:06d}", i + 1) for i in range(3)]
    write(where, parts)
    with CacheWriter(url, manifest(kind), options) as w:
        w.close(consolidate=False)
        m = w.write_manifest(["p000002", "p000000"])
    assert [p["name"] for p in m["parts"]] == ["p000002", "p000000"]
    reader = CacheReader(url, options)
    assert [p.name for p in reader.manifest.parts] == ["p000002", "p000000"]
    expect_equal(reader, [parts[2], parts[0]])
    w = CacheWriter(url, manifest(kind), options, prune_stale=False)
    kept = sorted(w.committed_parts())
    w.abort()
    w.release()
    assert kept == (["p000000", "p000002"] if options is None else ["p000000", "p000001", "p000002"])
    with pytest.raises(CacheFormatError, match="should be listed but are not committed"):
        with CacheWriter(url, manifest(kind), options) as w:
            w.write_manifest(["p000009"])


def test_a_reader_pinned_to_a_recorded_manifest_reads_exactly_its_parts(where):
    """What `train` does with data/cache/manifest.json: another run may switch the root of a store
    on S3 (a pool of parts) between the cache stage and training; the pinned reader still reads
    the recorded parts and index. Where the recorded parts are gone (a local store rebuilt for
    other input), it says so instead of reading the wrong samples."""
    kind, url, options = where
    parts = [make_part(f"p{i:06d}", i + 1) for i in range(3)]
    with CacheWriter(url, manifest(kind), options) as w:
        for part in parts[:2]:
            w.submit(part)
        w.close(consolidate=False)
        recorded = dict(w.write_manifest(["p000000", "p000001"]), url=url)
    with CacheWriter(url, manifest(kind), options) as w:  # another experiment's input
        w.submit(parts[2])
        w.close(consolidate=False)
        w.write_manifest(["p000002"])
    expect_equal(CacheReader(url, options), [parts[2]])
    if options is None:
        with pytest.raises(CacheFormatError, match="no longer in the store"):
            CacheReader(url, options, manifest=recorded)
        return
    pinned = CacheReader(url, options, manifest=recorded)
    assert [p.name for p in pinned.manifest.parts] == ["p000000", "p000001"]
    expect_equal(pinned, parts[:2])
    with pytest.raises(CacheFormatError, match="not the recorded manifest's"):
        CacheReader(url, options, manifest=dict(recorded, layers=[0]))


def test_ranks_of_one_job_write_disjoint_parts_and_rank_zero_lists_them(where):
    kind, url, options = where
    rank0 = CacheWriter(url, manifest(kind), options)
    rank1 = CacheWriter(url, manifest(kind), options, rank=1, run_id=rank0.lease.run_id)
    try:
        rank1.write_part(make_part("p000001", 2))
        rank0.write_part(make_part("p000000", 1))
        m = rank0.write_manifest(rescan=True)
    finally:
        rank1.release()
        rank0.release()
    assert [p["name"] for p in m["parts"]] == ["p000000", "p000001"]
    expect_equal(CacheReader(url, options), [make_part("p000000", 1), make_part("p000001", 2)])


def test_changed_content_is_refused_or_pruned(where):
    kind, url, options = where
    write(where, [make_part("p000000", 1)])
    with pytest.raises(CacheFormatError, match="layers: store has"):
        CacheWriter(url, manifest(kind, layers=[0]), options, prune_stale=False)
    other = "hdf5" if kind == "zarr" else "zarr"
    with pytest.raises(CacheFormatError, match=f"storage: store has '{kind}', expected '{other}'"):
        CacheWriter(url, manifest(other), options, prune_stale=False)
    if options is None:  # local: a stale store (or one of the other backend) is rebuilt in place
        CacheWriter(url, manifest(other), options).release()
        assert detect(url, options) == other and len(CacheReader(url, options)) == 0
        assert sorted(os.listdir(url)) in (["zarr.json"], ["manifest.json"])


def _chunk_of(reader: CacheReader, part: int, array: str, chunk: int) -> tuple[str, int]:
    """(store key, byte offset) of the first byte of a chunk, from the backend's own chunk table."""
    layout = reader.array_layout(part, array)
    idx = reader._process_state()[3].index(layout)
    return layout.key, int(idx[chunk, 0])


def test_a_flipped_byte_is_named_by_part_array_and_chunk(where):
    import fsspec

    from deepspec.cache.storage.urls import storage_options_for

    kind, url, options = where
    parts = [make_part("p000000", 1), make_part("p000001", 2, samples=4)]
    write(where, parts)
    key, off = _chunk_of(CacheReader(url, options), 1, "hidden/2", 1)
    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, options))
    data = bytearray(fs.cat_file(f"{root}/{key}"))
    data[off + 3] ^= 0x40
    fs.pipe_file(f"{root}/{key}", bytes(data))
    reader = CacheReader(url, options)
    first = int(reader.part_start[1])
    with pytest.raises(ChecksumError) as e:
        for k in range(first, len(reader)):
            reader.read(k)
    assert "p000001" in str(e.value) and "hidden/2" in str(e.value) and "chunk 1" in str(e.value)
    with pytest.raises(ChecksumError) as e:
        verify(url, options)
    assert "p000001" in str(e.value) and "hidden/2" in str(e.value) and "chunk 1" in str(e.value)
    with pytest.raises(CacheFormatError, match="p000001"):  # the library's own read checks too
        slow = CacheReader(url, options, fast=False)
        for k in range(first, len(slow)):
            slow.read(k)
    assert CacheReader(url, options, verify=False).read(first, layers=[0])  # other arrays read fine


def test_a_damaged_committed_part_is_dropped_and_written_again(where):
    local_only(where)
    kind, url, options = where
    parts = [make_part(f"p{i:06d}", i + 1) for i in range(3)]
    write(where, parts)
    clean = files(url, options)
    key, _ = _chunk_of(CacheReader(url, options), 1, "last_hidden", 0)
    path = Path(url) / key
    os.truncate(path, path.stat().st_size // 2)  # a power loss before the data reached the disk
    with CacheWriter(url, manifest(kind), options) as w:
        assert sorted(w.committed_parts()) == ["p000000", "p000002"]
        w.submit(parts[1])
    assert files(url, options) == clean


def test_debris_of_a_killed_writer_is_pruned(where):
    local_only(where)
    kind, url, options = where
    write(where, [make_part("p000000", 1)])
    clean = files(url, options)
    root = Path(url)
    (root / "junk.txt").write_text("x")
    (root / f"root.{uuid.uuid4().hex}.partial").write_text("")
    (root / "parts" / f"p000001.{uuid.uuid4().hex}.partial").write_bytes(b"\0" * 100)
    (root / "parts" / "notes").mkdir()
    with CacheWriter(url, manifest(kind), options):
        pass  # opened (debris pruned), nothing written, consolidated again on close
    assert files(url, options) == clean


def test_a_directory_that_is_not_a_cache_is_refused_and_left_alone(where, tmp_path):
    kind, _, _ = where
    d = tmp_path / "plain"
    (d / "sub").mkdir(parents=True)
    (d / "notes.txt").write_text("x")
    (d / "manifest.json").write_text('{"name": "someone else"}')
    with pytest.raises(CacheFormatError, match="is not a deepspec cache"):
        CacheWriter(str(d), manifest(kind))
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "notes.txt", "sub"]


def test_the_manifest_is_typed_and_keeps_unknown_keys(where):
    kind, url, options = where
    write(where, [make_part("p000000", 1)], imported_from={"format": "x"})
    m = CacheReader(url, options).manifest
    assert isinstance(m.parts[0], PartEntry) and m.parts[0].tokens == int(make_part("p000000", 1).lengths.sum())
    assert m.extra == {"imported_from": {"format": "x"}} and m["imported_from"] == {"format": "x"}
    assert Manifest.from_dict(m.to_dict()) == m
    with pytest.raises(CacheFormatError, match="format_version 5 is not supported"):
        Manifest.from_dict(dict(m.to_dict(), format_version=5))


def test_reading_a_layer_that_is_not_cached_names_it(where):
    kind, url, options = where
    write(where, [make_part("p000000", 1)])
    with pytest.raises(CacheFormatError, match=r"layers \[5\]"):
        CacheReader(url, options).read(0, layers=[5])
    assert hidden_name(0) == "hidden/0"


def test_a_sample_spanning_more_chunks_than_one_preadv_takes_reads_back(where):
    """One read of 1,500 one-token chunks: more buffers than a single preadv accepts (IOV_MAX, 1024)."""
    local_only(where)
    from deepspec.cache.spec.format import encode_hidden

    rng = np.random.default_rng(5)
    t = 1500
    hidden = {layer: encode_hidden(torch.from_numpy(rng.standard_normal((t, H)).astype(np.float32)), "bfloat16")
              for layer in [*LAYERS, "last"]}
    part = PartData("p000000", np.array([7], dtype=np.uint64), np.array([t], dtype=np.int64),
                    rng.integers(0, 4096, size=t).astype(np.int32), rng.integers(0, 2, size=t).astype(np.uint8), hidden)
    write(where, [part], chunk_tokens=1, max_length=t)
    expect_equal(CacheReader(where[1], where[2], fast=True, verify=True), [part])


# ---- format v2: O(1) commits, consolidation, O(1) opens ----------------------------------------

def moto_requests(moto, bucket: str) -> list[str]:
    """The request lines moto_server logged for one bucket ("PUT /bucket/key", ...): counted at the
    real server, not inside the client."""
    import re
    import time

    time.sleep(0.2)  # the server logs after it answers
    text = Path(moto.log.name).read_text(errors="replace")
    return re.findall(rf'"([A-Z]+ /{bucket}[^ "]*)', text)


def root_writes(where, request) -> callable:
    """A probe of how often the root manifest and the index were written since the last call."""
    kind, url, options = where
    names = ("zarr.json", "index/") if kind == "zarr" else ("manifest.json", "index.h5")
    if url.startswith("s3://"):
        moto = request.getfixturevalue("moto")
        bucket = url[5:].split("/")[0]
        seen = [len(moto_requests(moto, bucket))]

        def probe():
            lines = moto_requests(moto, bucket)
            new, seen[0] = lines[seen[0]:], len(lines)
            return sum(1 for ln in new if ln.startswith(("PUT", "POST", "DELETE"))
                       and any(ln.split("?")[0].endswith(f"/store/{n}") or f"/store/{n}" in ln for n in names))
        return probe

    def stamp():
        out = {}
        for n in names:
            p = Path(url) / n.rstrip("/")
            for f in ([p] if p.is_file() else sorted(p.rglob("*")) if p.exists() else []):
                st = f.stat()
                out[str(f)] = (st.st_ino, st.st_mtime_ns, st.st_size)
        return out

    last = [stamp()]

    def probe():
        now = stamp()
        changed = sum(1 for k in set(now) | set(last[0]) if now.get(k) != last[0].get(k))
        last[0] = now
        return changed
    return probe


def test_a_commit_writes_nothing_at_the_root_and_consolidation_writes_it_once(where, request):
    """Committing a part costs O(1) bytes: the root manifest (O(parts) bytes) and the index are not
    touched by any commit, however many parts exist; closing consolidates them once."""
    import time

    kind, url, options = where
    with CacheWriter(url, manifest(kind), options) as w:
        probe = root_writes(where, request)
        for i in range(6):  # through the writer thread, as the cache stage writes
            w.submit(make_part(f"p{i:06d}", i + 1, samples=2))
        deadline = time.time() + 60
        while len(w.committed_parts()) < 6 and time.time() < deadline:
            time.sleep(0.1)
        assert len(w.committed_parts()) == 6
        assert probe() == 0, "a part commit rewrote the root manifest or the index"
    assert probe() >= 1  # the consolidation on close
    reader = CacheReader(url, options)
    assert reader.manifest.consolidated and reader.manifest.index["samples"] == 12 and len(reader) == 12
    with CacheWriter(url, manifest(kind), options) as w:  # growth: again nothing at the root per commit
        probe()
        for i in (6, 7, 8):
            w.write_part(make_part(f"p{i:06d}", i + 1, samples=2))
            assert probe() == 0 and len(CacheReader(url, options)) == 12  # readers keep the last root
    assert len(CacheReader(url, options)) == 18


def test_a_writer_killed_before_consolidating_leaves_the_last_consolidation_and_resumes(where):
    """A writer killed after committing parts (never consolidated) leaves a store that reads as its
    last consolidation (here: the parts of an earlier run), whose resume finds the new parts; the
    next close lists them."""
    kind, url, options = where
    parts = [make_part(f"p{i:06d}", i + 1) for i in range(3)]
    write(where, parts[:1])
    w = CacheWriter(url, manifest(kind), options)
    w.write_part(parts[1])
    w.release()  # killed: no close, no consolidation
    reader = CacheReader(url, options)
    assert reader.manifest.consolidated and [p.name for p in reader.manifest.parts] == ["p000000"]
    expect_equal(reader, parts[:1])
    assert verify(url, options)["ok"]
    with CacheWriter(url, manifest(kind), options) as w:
        assert sorted(w.committed_parts()) == ["p000000", "p000001"]
        assert w.committed_sample_ids() == {int(i) for p in parts[:2] for i in p.sample_ids}
        w.submit(parts[2])
    reader = CacheReader(url, options)
    assert reader.manifest.consolidated and reader.manifest.index["samples"] == 9
    expect_equal(reader, parts)


def test_opening_a_store_costs_the_same_requests_whatever_its_parts(where, request):
    """On S3 a reader opens a consolidated store with a constant number of requests (root metadata
    and the index), counted at the moto server: the same for 2 parts and for 12."""
    if not where[1].startswith("s3://"):
        pytest.skip("requests are counted at the S3 server")
    kind, url, options = where
    moto = request.getfixturevalue("moto")
    counts = {}
    for n in (2, 12):
        bucket = f"open-{uuid.uuid4().hex[:12]}"
        moto.bucket(bucket)
        store = f"s3://{bucket}/store"
        write((kind, store, options), [make_part(f"p{i:06d}", i + 1, samples=2) for i in range(n)])
        before = len(moto_requests(moto, bucket))
        reader = CacheReader(store, options)
        assert len(reader) == 2 * n and reader.sample_id(2 * n - 1) == 1000 * n + 2
        counts[n] = len(moto_requests(moto, bucket)) - before
    assert counts[2] == counts[12] and counts[2] <= 8, counts
