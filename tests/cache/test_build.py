"""The streaming cache build: the part plan (a pure function of input and store), multi-rank resume,
and a bound on the samples a rank holds at once."""
import json
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import deepspec.cache.build.stage as build_mod
import deepspec.cache.build.regen_rows as regen_rows_mod
from deepspec.cache.build.stage import build_cache, plan_store
from deepspec.cache.build.regen_rows import RowIndex
from deepspec.cache.spec.format import part_name
from deepspec.cache.spec.plan import store_order
from deepspec.cache.read.reader import CacheReader
from deepspec.config import CacheConfig
from tests.cache.test_cache import LAYERS, array_hashes, build, workdir
from tests.conftest import SAMPLE_CONVERSATIONS

RANK = threading.local()  # the rank a thread of build_ranks runs


def many_rows(copies: int) -> list[dict]:
    return [{"id": f"{i + 1:016x}", "conversations": c} for i, c in enumerate(SAMPLE_CONVERSATIONS * copies)]


_LOAD_LOCK = threading.Lock()
_load_model = build_mod.load_model


def _load_model_alone(*a, **k):
    with _LOAD_LOCK:
        return _load_model(*a, **k)


def build_ranks(work: Path, world: int, layers=LAYERS, separate_writer: bool | None = None, **cfg) -> list:
    """`world` ranks of one job as threads: a barrier, rank 0's value handed over like torchrun's
    broadcast and every rank's like its all_gather. Returns each rank's report, or the exception it raised."""
    # transformers' lazy imports and from_pretrained (a global init context) are not thread-safe:
    # resolve the imports before the ranks start, and let them load the target one at a time
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    build_mod.load_model = _load_model_alone
    barrier = threading.Barrier(world, timeout=120)
    box, results = {}, [None] * world

    def share(value, rank):
        if rank == 0:
            box["value"] = value
        barrier.wait()
        value = box["value"]
        barrier.wait()  # nobody overwrites the box before every rank has read it
        return value

    slots = [None] * world

    def gather(value, rank):
        slots[rank] = value
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out

    def rank_main(rank):
        RANK.value = rank
        try:
            results[rank] = build_cache(CacheConfig(url=str(work / "data" / "cache.zarr"), **cfg), layers,
                                        work / "data/regen/train.jsonl", work / "data/target", rank, world,
                                        share=lambda v: share(v, rank),
                                        gather=lambda v: gather(v, rank), separate_writer=separate_writer)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            results[rank] = e
            barrier.abort()  # a rank that died frees the others from waiting for it

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    finally:
        build_mod.load_model = _load_model
    return results


def committed(url: str) -> dict[str, int]:
    """part name -> rank, of the parts marked committed"""
    out = {}
    for meta in sorted(Path(url, "parts").glob("*/zarr.json")):
        try:
            attrs = json.loads(meta.read_text())["attributes"]
        except ValueError:  # a part's first record being written while a crashing rank polls: not committed
            continue
        if attrs.get("committed"):
            out[meta.parent.name] = attrs["rank"]
    return out


def test_a_part_stores_its_samples_longest_first_and_is_forwarded_in_that_order():
    """The order the stage's forward batches take (so a part streams to its shards batch by batch):
    longest first, equal lengths in input order; which samples make a part is unchanged."""
    from deepspec.cache.build.stage import length_batches

    lengths = np.array([3, 9, 5, 9, 1, 7, 30])
    assert store_order(np.arange(4), lengths).tolist() == [1, 3, 2, 0]

    class S:  # a Sample's length is all length_batches reads
        def __init__(self, n):
            self.input_ids = [0] * n
    batches = length_batches([S(int(lengths[i])) for i in [1, 3, 2, 0]], 20)
    assert batches == [[0, 1], [2, 3]]  # consecutive: store order = batch order (9+9, then 5+3 padded to 10)


def test_the_plan_is_cut_by_content_and_each_part_named_by_what_it_holds():
    rng = np.random.default_rng(3)
    n = 400
    index = RowIndex("x", n, rng.integers(0, 2**63, n, dtype=np.uint64), rng.integers(5, 60, n), np.zeros(n, np.int64),
                     np.arange(1, n + 1), [], rng.integers(0, 2**63, (n, 2), dtype=np.uint64))
    plan = plan_store(index, 500)
    assert sorted(np.concatenate([rows for _, rows in plan]).tolist()) == list(range(n))
    for name, rows in plan:
        assert name == part_name(index.keys[rows], index.sample_ids[rows])
        assert index.lengths[rows].sum() <= 500
        assert rows.tolist() == store_order(np.sort(rows), index.lengths).tolist()
    # one sample changed: one or two parts get new names, every other part is the same
    changed = RowIndex(**{**index.__dict__, "keys": index.keys.copy()})
    changed.keys[n // 2] = [1, 2]
    names = {name for name, _ in plan}
    assert 1 <= len(names - {name for name, _ in plan_store(changed, 500)}) <= 2


def test_multi_rank_resume_equals_an_uninterrupted_multi_rank_build(tmp_path, trained_target, monkeypatch):
    rows = many_rows(1)
    clean = workdir(tmp_path / "clean", trained_target, rows)
    assert all(not isinstance(r, BaseException) for r in build_ranks(clean, 2, part_tokens=150))
    clean_url = str(clean / "data/cache.zarr")
    assert set(committed(clean_url).values()) == {0, 1} and len(committed(clean_url)) >= 8

    # the same job killed after rank 0 committed two parts and rank 1 one: each rank's next forward
    # pass waits for every rank's commits, then fails. (Not only its own: a rank 0 that failed first
    # would give up the job's lease, and rank 1, which commits under it, could then commit nothing.)
    crash = workdir(tmp_path / "crash", trained_target, rows)
    crash_url = str(crash / "data/cache.zarr")
    compute_part, calls, keep = build_mod.compute_part, {}, {0: 2, 1: 1}

    def crashing(*a, **k):
        rank = RANK.value
        n = calls[rank] = calls.get(rank, 0) + 1
        if n > keep[rank]:
            deadline = time.time() + 600  # a guard against a hang, not a speed check
            while sorted(committed(crash_url).values()) != [0, 0, 1]:
                assert time.time() < deadline, committed(crash_url)
                time.sleep(0.01)
            raise RuntimeError("injected crash")
        return compute_part(*a, **k)

    monkeypatch.setattr(build_mod, "compute_part", crashing)
    results = build_ranks(crash, 2, part_tokens=150)
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert sorted(committed(crash_url).values()) == [0, 0, 1]
    monkeypatch.setattr(build_mod, "compute_part", compute_part)

    assert all(not isinstance(r, BaseException) for r in build_ranks(crash, 2, part_tokens=150))
    assert array_hashes(crash_url) == array_hashes(clean_url)
    assert CacheReader(crash_url).manifest["parts"] == CacheReader(clean_url).manifest["parts"]


def test_the_index_gathered_from_byte_shares_equals_one_pass(tmp_path, trained_target):
    """Any number of ranks, each tokenising an equal byte share of the input (line-aligned), together
    give the one-pass index: same rows, ids, keys, offsets, global line numbers, drops, in order."""
    import pytest
    from transformers import AutoTokenizer

    from deepspec.cache.build.regen_rows import EncodeRules, index_regen, index_share, line_ranges, merge_shares
    from deepspec.io import JsonlError

    tok = AutoTokenizer.from_pretrained(trained_target)
    rules = EncodeRules(max_length=64, overlong="drop")
    path = tmp_path / "regen.jsonl"
    rows = many_rows(1)
    rows.insert(20, {"id": "00000000000000ff", "conversations": [  # over max_length: dropped
        {"role": "user", "content": "Count."}, {"role": "assistant", "content": " ".join(["one two three"] * 40)}]})
    lines = [json.dumps(r) for r in rows]
    lines[5:5] = ["", "   "]  # blank lines count as lines, not rows
    path.write_text("\n".join(lines) + "\n")
    whole = index_regen(tok, path, rules)
    assert whole.rows == len(rows) and whole.dropped  # the long conversation is dropped
    for world in (2, 3, 5, len(lines) + 3):
        ranges = line_ranges(path, world)
        assert ranges[0][0] == 0 and ranges[-1][1] == path.stat().st_size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        merged = merge_shares(path, [index_share(tok, path, rules, a, b) for a, b in ranges])
        for field in ("sample_ids", "lengths", "offsets", "lines", "keys"):
            assert np.array_equal(getattr(merged, field), getattr(whole, field)), (world, field)
        assert (merged.rows, merged.dropped, merged.adjusted) == (whole.rows, whole.dropped, whole.adjusted)
    # an unreadable row is named by its line in the file, whichever rank read it
    lines[40] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(JsonlError) as one:
        index_regen(tok, path, rules)
    with pytest.raises(JsonlError) as many:
        merge_shares(path, [index_share(tok, path, rules, a, b) for a, b in line_ranges(path, 4)])
    assert str(one.value) == str(many.value) and str(one.value).startswith(f"{path}:41: not valid JSON")


def test_each_rank_tokenises_only_its_share_of_the_input(tmp_path, trained_target, monkeypatch):
    """Counted per rank: a rank encodes the rows of its byte share once (the index) and the rows of the
    parts it computes once more (their tokens); no rank encodes the input for the others. The store
    equals a one-rank build."""
    one = workdir(tmp_path / "one", trained_target, many_rows(1))
    build(one, part_tokens=150)
    encode_row, calls = regen_rows_mod.encode_row, {}

    def counting(*a, **k):
        calls[RANK.value] = calls.get(RANK.value, 0) + 1
        return encode_row(*a, **k)

    monkeypatch.setattr(regen_rows_mod, "encode_row", counting)
    two = workdir(tmp_path / "two", trained_target, many_rows(1))
    results = build_ranks(two, 2, part_tokens=150)
    assert all(not isinstance(r, BaseException) for r in results), results
    indexed = results[0]["rows_indexed_by_rank"]
    assert sum(indexed) == len(many_rows(1)) and min(indexed) >= len(many_rows(1)) // 3
    reader = CacheReader(str(two / "data/cache.zarr"))
    ranks = committed(str(two / "data/cache.zarr"))
    for rank in (0, 1):
        mine = sum(p["samples"] for p in reader.manifest["parts"] if ranks[p["name"]] == rank)
        assert calls[rank] == indexed[rank] + mine, (rank, calls, indexed, mine)
    assert array_hashes(str(two / "data/cache.zarr")) == array_hashes(str(one / "data/cache.zarr"))


def test_a_build_beside_a_gpu_writes_on_several_threads_and_equals_a_one_thread_build(tmp_path, trained_target,
                                                                                       monkeypatch):
    """The cache stage's writer takes its thread count from devices.writer_threads (several beside a
    GPU); every file of every part is the one a writer on one thread writes."""
    from deepspec.cache.backends.zarr.write import ZarrStoreWriter

    seen = []
    append_all = ZarrStoreWriter._append_all

    def watched(self, *a):
        seen.append(self.write_threads)
        return append_all(self, *a)

    monkeypatch.setattr(ZarrStoreWriter, "_append_all", watched)
    rows = many_rows(1)
    stores = {}
    for threads in (1, 3):
        monkeypatch.setattr(build_mod, "writer_threads", lambda device, n=threads: n)
        work = workdir(tmp_path / str(threads), trained_target, rows)
        build(work, part_tokens=300)
        root = work / "data" / "cache.zarr"
        stores[threads] = {str(f.relative_to(root)): f.read_bytes() for f in sorted((root / "parts").rglob("*"))
                           if f.is_file()}
    assert sorted(set(seen)) == [1, 3] and len(seen) >= 4
    assert len(stores[1]) > 10 and stores[3] == stores[1]


def test_a_build_with_its_writer_in_a_process_of_its_own_equals_a_build_with_a_writer_thread(tmp_path, trained_target,
                                                                                              monkeypatch):
    """What the cache stage does beside a GPU (devices.separate_writer): the parts are written by a
    CacheWriter in a child process, every file the one a writer thread writes. A derive (a layer
    subset) keeps a writer in the building process, since its parts are copied from the source."""
    from tests.cache.test_derive import store_files

    opened = []

    class Watched(build_mod.ProcessWriter):
        def __init__(self, *a, **k):
            opened.append(self)
            super().__init__(*a, **k)

    monkeypatch.setattr(build_mod, "ProcessWriter", Watched)
    stores, reports = {}, {}
    for separate in (False, True):
        work = workdir(tmp_path / str(separate), trained_target, many_rows(1))
        url = work / "data" / "cache.zarr"
        reports[separate] = build_cache(CacheConfig(url=str(url), part_tokens=300), LAYERS,
                                        work / "data/regen/train.jsonl", work / "data/target", separate_writer=separate)
        stores[separate] = store_files(str(url))
    assert len(opened) == 1 and len(stores[True]) > 10 and stores[True] == stores[False]
    assert reports[True]["manifest"] == reports[False]["manifest"]
    derived = build_cache(CacheConfig(url=str(url), part_tokens=300), LAYERS[:1], work / "data/regen/train.jsonl",
                          work / "data/target", separate_writer=True)
    assert derived["mode"] == "derived" and len(opened) == 1


def test_ranks_each_writing_through_a_process_of_their_own_build_the_store_ranks_with_threads_build(
        tmp_path, trained_target):
    """A multi-GPU cache stage: every rank's parts go through its own writer process, which joins the
    job's lease under rank 0's; rank 0 lists every rank's parts. The store is the one writer threads give."""
    rows = many_rows(1)
    urls = {}
    for separate in (False, True):
        work = workdir(tmp_path / str(separate), trained_target, rows)
        results = build_ranks(work, 2, separate_writer=separate, part_tokens=150)
        assert all(not isinstance(r, BaseException) for r in results), results
        urls[separate] = str(work / "data/cache.zarr")
    assert set(committed(urls[True]).values()) == {0, 1}
    assert array_hashes(urls[True]) == array_hashes(urls[False])
    assert CacheReader(urls[True]).manifest["parts"] == CacheReader(urls[False]).manifest["parts"]
    assert not list(Path(urls[True]).glob("*lease*"))  # the writer processes gave the job's lease up


def test_build_holds_a_bounded_number_of_samples(tmp_path, trained_target, monkeypatch):
    """Every Sample (a row's token lists) is counted while alive: the build never holds more than
    about one part's worth, however many rows the input has."""
    live, peak = weakref.WeakSet(), [0]

    class CountedSample(regen_rows_mod.Sample):
        __hash__ = object.__hash__  # by identity, for the WeakSet

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            live.add(self)
            peak[0] = max(peak[0], len(live))

    monkeypatch.setattr(regen_rows_mod, "Sample", CountedSample)
    rows = many_rows(2)
    work = workdir(tmp_path, trained_target, rows)
    report = build(work, part_tokens=300)
    parts = CacheReader(str(work / "data/cache.zarr")).manifest["parts"]
    assert report["samples"] == len(rows) and len(parts) >= 8
    largest = max(p["samples"] for p in parts)
    assert peak[0] <= 2 * largest, (peak[0], largest, len(rows))


def test_cut_answers_and_long_conversations_follow_the_rules_and_are_counted(tmp_path, trained_target):
    multi = next(c for c in SAMPLE_CONVERSATIONS if len(c) == 4)
    rows = [{"id": f"{i + 1:016x}", "conversations": c, "finish_reasons": ["stop"] * (len(c) // 2)}
            for i, c in enumerate(SAMPLE_CONVERSATIONS[:6])]
    rows[2]["finish_reasons"] = ["length"]             # cut by max_tokens
    rows.append({"id": f"{99:016x}", "conversations": multi, "finish_reasons": ["stop", "stop"]})
    work = workdir(tmp_path, trained_target, rows)
    from transformers import AutoTokenizer

    from deepspec.data.template import encode_conversation

    tok = AutoTokenizer.from_pretrained(trained_target)
    first = len(encode_conversation(tok, multi[:2]).input_ids)
    longest_single = max(len(encode_conversation(tok, r["conversations"]).input_ids) for r in rows[:6])
    max_length = max(first, longest_single) + 2  # the two-turn conversation does not fit whole
    assert len(encode_conversation(tok, multi).input_ids) > max_length

    report = build(work, max_length=max_length)
    assert report["adjusted"] == {"cut_at_turn": 1, "no_end_of_turn_label": 1} and report["samples"] == 7
    reader = CacheReader(str(work / "data/cache.zarr"))
    by_id = {int(i): k for k, i in enumerate(reader.sample_ids())}
    cut = reader.read(by_id[99], layers=[], fields=("input_ids", "loss_mask"))
    assert tok.decode(cut["input_ids"][cut["loss_mask"].astype(bool)]).count("<|im_end|>") == 1
    open_end = reader.read(by_id[3], layers=[], fields=("input_ids", "loss_mask"))
    assert "<|im_end|>" not in tok.decode(open_end["input_ids"][open_end["loss_mask"].astype(bool)])

    strict = workdir(tmp_path / "strict", trained_target, rows)
    report = build(strict, max_length=max_length, overlong="drop", truncated="drop")
    assert report["dropped_by_reason"] == {"answer_cut": 1, "too_long": 1} and report["samples"] == 5
