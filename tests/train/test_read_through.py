"""train.capture: read-through: training from the first window while the store fills.

The promises checked: the draft equals an offline run's with the same order on the finished store,
bit for bit; the store equals a from-scratch cache build; a second experiment runs no target
forward; a kill -9 anywhere loses no committed part and no sample of the epoch."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from deepspec.cache.build.fill import FillError, StoreFill, check_plan, stored
from deepspec.cache.build.stage import build_cache, plan_cache
from deepspec.cache.read.reader import CacheReader
from deepspec.config import CacheConfig, TrainConfig
from deepspec.train.run import run_training
from tests.cache.test_cache import LAYERS, workdir
from tests.cache.test_derive import store_files, store_files_any_rank
from tests.conftest import REPO, project_env
from tests.train.test_train import FAST

# small parts, so that the first windows need a few of them and the rest come later
CACHE = dict(part_tokens=400)
TRAIN = dict(FAST, steps=20, checkpoint_every=5, window_parts=2)


def weights(draft: Path) -> dict:
    return load_file(draft / "model.safetensors")


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def offline(work: Path, cache: dict = CACHE, **train) -> dict:
    """The cache stage's build, then training on it: the reference."""
    regen, target = work / "data" / "regen" / "train.jsonl", work / "data" / "target"
    url = str(work / "data" / "cache.zarr")
    build_cache(CacheConfig(url=url, **cache), LAYERS, regen, target)
    return run_training(TrainConfig(**{**TRAIN, **train}), LAYERS, url, target, work / "draft", work / "train",
                        work / "state", manifest=dict(CacheReader(url).manifest))


def read_through(work: Path, cache: dict = CACHE, separate_writer: bool | None = None, **train) -> dict:
    regen, target = work / "data" / "regen" / "train.jsonl", work / "data" / "target"
    fill = StoreFill(CacheConfig(url=str(work / "data" / "cache.zarr"), **cache), LAYERS, regen, target,
                     separate_writer=separate_writer)
    return run_training(TrainConfig(**{**TRAIN, "capture": "read-through", **train}), LAYERS, None, target,
                        work / "draft", work / "train", work / "state", fill=fill)


def plan(work: Path, cache: dict = CACHE) -> dict:
    """The cache stage's plan (data/cache/manifest.json) under train.capture: read-through."""
    return plan_cache(CacheConfig(url=str(work / "data" / "cache.zarr"), **cache), LAYERS,
                      work / "data" / "regen" / "train.jsonl", work / "data" / "target")["manifest"]


# each backend once, with the writer on a thread and in a process of its own (as beside a GPU)
@pytest.mark.parametrize("storage,separate_writer", [("zarr", False), ("hdf5", True)])
def test_read_through_trains_the_offline_draft_leaves_the_scratch_store_and_never_captures_twice(tmp_path,
                                                                                                trained_target,
                                                                                                storage,
                                                                                                separate_writer):
    cache = dict(CACHE, format=storage)
    ref = workdir(tmp_path / "offline", trained_target)
    rt = workdir(tmp_path / "read_through", trained_target)
    base = offline(ref, cache)
    # a loading process, started while the fill's threads run
    first = read_through(rt, cache, separate_writer, num_workers=1)
    parts = len(CacheReader(str(ref / "data" / "cache.zarr")).manifest.parts)
    assert parts >= 4  # several windows of 2 parts: the order matters
    assert same_weights(ref / "draft", rt / "draft")
    assert store_files(str(ref / "data" / "cache.zarr")) == store_files(str(rt / "data" / "cache.zarr"))
    assert dict(CacheReader(str(ref / "data" / "cache.zarr")).manifest) == \
        dict(CacheReader(str(rt / "data" / "cache.zarr")).manifest)
    assert (base["capture"], base["target_forwards"], base["parts_kept"]) == ("offline", 0, parts)
    assert first["capture"] == "read-through"
    assert (first["parts_computed"], first["parts_kept"]) == (parts, 0) and first["target_forwards"] >= parts
    assert first["tokens_computed"] == CacheReader(str(ref / "data" / "cache.zarr")).manifest.num_tokens
    assert first["final_loss"] == base["final_loss"]
    # a second experiment on the same data, target and layers: another learning rate, no forward
    shutil.rmtree(rt / "state")
    second = read_through(rt, cache, lr=1e-3)
    assert (second["target_forwards"], second["parts_computed"], second["parts_kept"]) == (0, 0, parts)
    assert second["final_loss"] != first["final_loss"]
    metrics = json.loads((rt / "train" / "metrics.json").read_text())
    assert metrics["target_forwards"] == 0 and metrics["capture"] == "read-through"
    # what the train stage sees next time: the planned store is full, so it is read as offline
    full = stored(plan(rt, cache))
    assert full is not None and full["index"] == dict(CacheReader(str(rt / "data" / "cache.zarr")).manifest)["index"]


def test_with_default_params_the_fill_follows_the_first_touch_order_and_the_first_step_needs_two_parts(
        tmp_path, trained_target, monkeypatch):
    """train.window_parts: auto (the default) gives a read-through run growing windows: the fill is handed
    the parts in the order the first epoch first touches them, and the first step waits for two."""
    from deepspec.loader.dataset import TargetCacheDataset
    from deepspec.loader.sampler import ResumableBatchSampler
    from tests.conftest import SAMPLE_CONVERSATIONS

    rows = [{"id": f"{i + 1:016x}", "conversations": SAMPLE_CONVERSATIONS[i % 60]} for i in range(480)]
    rt = workdir(tmp_path / "rt", trained_target, rows)
    given, plans = [], []
    real = StoreFill.compute
    monkeypatch.setattr(StoreFill, "compute", lambda self, order: given.append(list(order)) or
                        plans.append(self.plan()) or real(self, order))
    cache = dict(part_tokens=250)
    final = read_through(rt, cache, window_parts="auto", steps=4)
    planned = plans[0]  # the samples in the plan's order, as the trainer indexes them
    store = TargetCacheDataset(planned.url, planned=(planned.manifest, planned.rows))
    names = [p["name"] for p in store.manifest["parts"]]
    assert len(names) >= 40 and final["parts_before_first_step"] <= 2
    assert json.loads((rt / "train" / "metrics.json").read_text())["parts_before_first_step"] <= 2
    # the first epoch's batches, as the trainer draws them, touch the parts in exactly the order given
    part_of = store.sample_parts()
    sampler = ResumableBatchSampler(store.lengths(), batch_size=TRAIN["batch_size"], seed=TRAIN["seed"],
                                    window_parts="growing", parts=part_of)
    touched = []
    for batch in sampler.global_batches(0):
        for p in part_of[batch]:
            if names[p] not in touched:
                touched.append(names[p])
    assert given == [touched]
    # offline, the default is an order over all samples: no windows
    assert TrainConfig().window_parts == "auto"


def test_eagle3_read_through_takes_the_corpus_tokens_from_the_plan_and_trains_the_offline_draft(
        tmp_path, trained_target, monkeypatch):
    """EAGLE-3's vocabulary needs every sample's loss tokens before the first step: a read-through run
    encodes them again from its plan while the capture is held back (it would never finish if the
    run waited for the store), and trains the offline run's draft."""
    import threading

    from deepspec.cache.build import stage
    from deepspec.models import eagle3

    eagle = dict(algorithm="eagle3", ttt_steps=2, draft_vocab_size=64)
    ref = workdir(tmp_path / "offline", trained_target)
    rt = workdir(tmp_path / "read_through", trained_target)
    offline(ref, **eagle)
    counted, computed = threading.Event(), []
    real_compute, real_counts = stage.compute_part, eagle3.loss_token_counts

    def held_back(*args, **kw):  # the second part waits until the vocabulary is counted
        computed.append(args[1])
        if len(computed) == 2:
            assert counted.wait(60), "the run waited for the store before counting its tokens"
        return real_compute(*args, **kw)

    def counting(dataset):
        counts = real_counts(dataset)
        counted.set()
        return counts

    monkeypatch.setattr(stage, "compute_part", held_back)
    monkeypatch.setattr(eagle3, "loss_token_counts", counting)
    read_through(rt, **eagle)
    assert counted.is_set() and len(computed) >= 2
    assert same_weights(ref / "draft", rt / "draft")
    assert store_files(str(ref / "data" / "cache.zarr")) == store_files(str(rt / "data" / "cache.zarr"))


def test_a_stopped_read_through_run_leaves_its_committed_parts_and_the_next_computes_only_the_rest(
        tmp_path, trained_target, monkeypatch):
    from deepspec.cache.build import stage
    from deepspec.train import trainer as trainer_mod

    ref = workdir(tmp_path / "offline", trained_target)
    rt = workdir(tmp_path / "read_through", trained_target)
    offline(ref)
    real_step, real_part = trainer_mod.Trainer.step, stage.compute_part

    def slow_part(*args, **kw):  # the tiny target captures far faster than a real one trains
        time.sleep(0.4)
        return real_part(*args, **kw)

    monkeypatch.setattr(stage, "compute_part", slow_part)

    def failing_step(self, batches):  # a fault the trainer cannot be made to raise on demand otherwise
        if self.state.step == 7:
            raise RuntimeError("the trainer died")
        return real_step(self, batches)

    monkeypatch.setattr(trainer_mod.Trainer, "step", failing_step)
    with pytest.raises(RuntimeError, match="the trainer died"):
        read_through(rt)
    monkeypatch.setattr(trainer_mod.Trainer, "step", real_step)
    monkeypatch.setattr(stage, "compute_part", real_part)
    from deepspec.cache.backends.readers import open_cache

    kept = set(open_cache(str(rt / "data" / "cache.zarr")).committed_parts())
    parts = len(CacheReader(str(ref / "data" / "cache.zarr")).manifest.parts)
    assert 0 < len(kept) < parts  # the first windows, not the whole store
    assert stored(plan(rt)) is None  # a partial store is filled, not read as it is
    final = read_through(rt)
    assert (final["parts_kept"], final["parts_computed"]) == (len(kept), parts - len(kept))
    assert same_weights(ref / "draft", rt / "draft")  # resumed from step 5's checkpoint
    assert store_files(str(ref / "data" / "cache.zarr")) == store_files(str(rt / "data" / "cache.zarr"))


def test_a_failed_capture_stops_the_run_naming_the_part_and_the_reason(tmp_path, trained_target, monkeypatch):
    from deepspec.cache.build import stage

    rt = workdir(tmp_path, trained_target)
    real = stage.compute_part
    calls = []

    def oom_on_the_third(*args, **kw):  # a device out of memory: no real component does it on demand
        calls.append(args[1])
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kw)

    monkeypatch.setattr(stage, "compute_part", oom_on_the_third)
    with pytest.raises(FillError) as failed:
        read_through(rt)
    assert len(calls) == 3
    assert f"while writing part {calls[2]}: OutOfMemoryError: CUDA out of memory" in str(failed.value)
    from deepspec.cache.backends.readers import open_cache

    # the parts before it are committed, also those still queued for the writer; never the failed one
    assert set(open_cache(str(rt / "data" / "cache.zarr")).committed_parts()) == set(calls[:2])


def test_once_every_part_is_committed_the_fill_lets_go_of_the_target(tmp_path, trained_target, monkeypatch):
    """On one GPU the fill waits for the trainer after its last part: the target's memory must be the
    trainer's then, not held until training ends."""
    import gc
    import weakref

    from deepspec.cache.build import stage

    rt = workdir(tmp_path, trained_target)
    loaded, real = [], stage.load_model
    monkeypatch.setattr(stage, "load_model", lambda *a, **kw: loaded.append(weakref.ref(m := real(*a, **kw))) or m)
    fill = StoreFill(CacheConfig(url=str(rt / "data" / "cache.zarr"), **CACHE), LAYERS,
                     rt / "data" / "regen" / "train.jsonl", rt / "data" / "target")
    try:
        fill.compute(fill.plan().names)
        deadline = time.monotonic() + 120
        while not fill.idle() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert fill.idle() and len(loaded) == 1
        for _ in range(50):  # the fill thread lets go after its writer's close
            gc.collect()
            if loaded[0]() is None:
                break
            time.sleep(0.1)
        assert loaded[0]() is None
    finally:
        fill.finish()


def test_the_plan_is_the_cache_stages_and_another_one_is_refused(tmp_path, trained_target):
    rt = workdir(tmp_path, trained_target)
    regen, target = rt / "data" / "regen" / "train.jsonl", rt / "data" / "target"
    cfg = CacheConfig(url=str(rt / "data" / "cache.zarr"), **CACHE)
    recorded = plan_cache(cfg, LAYERS, regen, target)["manifest"]
    fill = StoreFill(cfg, LAYERS, regen, target)
    try:
        planned = fill.plan()
        check_plan(planned, recorded, "data/cache/manifest.json")
        assert planned.names == [p["name"] for p in recorded["parts"]]
        other = plan_cache(CacheConfig(url=cfg.url, part_tokens=300), LAYERS, regen, target)["manifest"]
        with pytest.raises(FillError, match="data/cache/manifest.json: the cache stage planned another store.*parts"):
            check_plan(planned, other, "data/cache/manifest.json")
        fewer = plan_cache(cfg, [-1, 0], regen, target)["manifest"]
        with pytest.raises(FillError, match="layers"):
            check_plan(planned, fewer, "data/cache/manifest.json")
    finally:
        fill.abort()
    assert not list((rt / "data" / "cache.zarr").glob("parts/p*"))  # nothing was computed before an order came


def test_the_fill_plans_from_the_index_the_cache_stage_kept_when_it_is_of_this_very_input(tmp_path, trained_target,
                                                                                         monkeypatch):
    from deepspec.cache.build import stage
    from deepspec.cache.build.regen_rows import EncodeRules, index_key, load_index

    rt = workdir(tmp_path, trained_target)
    regen, target = rt / "data" / "regen" / "train.jsonl", rt / "data" / "target"
    cfg = CacheConfig(url=str(rt / "data" / "cache.zarr"), **CACHE)
    kept = rt / "data" / "cache" / "index.npz"
    recorded = plan_cache(cfg, LAYERS, regen, target, keep_index=kept)["manifest"]
    indexed = []
    real = stage.index_input
    monkeypatch.setattr(stage, "index_input", lambda *a, **kw: indexed.append(1) or real(*a, **kw))

    def planned_names(**kw) -> list[str]:
        fill = StoreFill(cfg, LAYERS, regen, target, **kw)
        try:
            planned = fill.plan()
            check_plan(planned, recorded, "data/cache/manifest.json")
            return planned.names
        finally:
            fill.abort()

    assert planned_names(index_from=kept) == [p["name"] for p in recorded["parts"]] and indexed == []
    # another input (a row more), other encode rules, or an unreadable file: the fill indexes the input itself
    from deepspec.models.target import load_identity

    ident = load_identity(target)
    assert load_index(kept, regen, index_key(regen, EncodeRules(max_length=cfg.max_length - 1), ident)) is None
    kept.write_bytes(b"not an index")
    assert planned_names(index_from=kept) == [p["name"] for p in recorded["parts"]] and len(indexed) == 1
    plan_cache(cfg, LAYERS, regen, target, keep_index=kept)
    with open(regen, "a") as f:
        f.write(json.dumps({"id": f"{999:016x}", "conversations": [{"role": "user", "content": "What is 1 plus 1?"},
                                                                   {"role": "assistant", "content": "2."}]}) + "\n")
    assert load_index(kept, regen, index_key(regen, EncodeRules.of(cfg), ident)) is None


# ---- the stages, killed -----------------------------------------------------------------------------

def stage_dir(root: Path, target: Path, rows=None, **train) -> Path:
    work = workdir(root, target, rows)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["layers"] = LAYERS
    params["cache"].update(CACHE)
    params["train"] = {**TRAIN, "capture": "read-through", **train}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    return work


def run_stage(work: Path, name: str, env: dict) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "stages" / f"{name}.py")], cwd=work, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_sigkill_of_a_read_through_run_at_random_moments_loses_nothing_and_trains_the_same_draft(tmp_path,
                                                                                                 trained_target):
    env = project_env(REPO, DEEPSPEC_LOG="WARNING")
    clean = stage_dir(tmp_path / "clean", trained_target, steps=60)
    run_stage(clean, "cache", env)
    assert json.loads((clean / "data" / "cache" / "report.json").read_text())["mode"] == "planned"
    run_stage(clean, "train", env)
    crash = stage_dir(tmp_path / "crash", trained_target, steps=60)
    run_stage(crash, "cache", env)
    store = crash / "data" / "cache-read-through.zarr"  # the train stage's store (naming.read_through_url)
    # the plan computes nothing
    assert not list((crash / "data" / "cache.zarr").glob("parts/p*")) and not store.exists()
    state = crash / "data" / "train_state"
    rng = random.Random(int(os.environ.get("DEEPSPEC_TEST_SEED", "0")))
    from deepspec.cache.backends.readers import open_cache

    def committed() -> int:
        return len(open_cache(str(store)).committed_parts()) if (store / "zarr.json").exists() else 0

    # first while the first parts are written, then in the middle of training (after a checkpoint)
    moments = [lambda: committed() >= 1, lambda: state.exists() and any(state.glob("ckpt-*/meta.json"))]
    kept = []
    for ready in moments:
        proc = subprocess.Popen([sys.executable, str(REPO / "stages" / "train.py")], cwd=crash, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline and not ready():
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kept.append(committed())
    assert 0 < kept[0] <= kept[1]
    run_stage(crash, "train", env)
    final = json.loads((crash / "data" / "train" / "metrics.json").read_text())
    parts = json.loads((clean / "data" / "train" / "metrics.json").read_text())["parts_computed"]
    # the rerun kept every part committed before the last kill and computed the others once
    assert final["parts_kept"] == kept[-1] and final["parts_kept"] + final["parts_computed"] == parts
    assert same_weights(clean / "data" / "draft", crash / "data" / "draft")
    assert store_files(str(clean / "data" / "cache-read-through.zarr")) == store_files(str(store))


# ---- capture ranks under torchrun ---------------------------------------------------------------------

def _rank_of(pid: int) -> int | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RANK=")), None)


@pytest.mark.slow
def test_capture_ranks_train_the_in_process_draft_and_a_kill_9_of_either_role_loses_nothing(tmp_path,
                                                                                            trained_target):
    """torchrun with 2 processes and train.capture_ranks: 1: rank 1 captures, rank 0 trains. kill -9 of
    the trainer after a checkpoint, then of the capture rank while it writes parts, then a rerun with
    two capture ranks: no committed part is computed again, and the draft and the store equal the
    one-process read-through run's (which equals offline)."""
    from tests.conftest import SAMPLE_CONVERSATIONS
    from tests.train.test_resume import _torchrun
    from deepspec.cache.backends.readers import open_cache
    from deepspec.data.servers import free_port

    env = project_env(REPO, DEEPSPEC_LOG="WARNING")

    def one_thread(work: Path) -> Path:  # as torchrun sets it (a CPU's threads are in the store's name)
        params = yaml.safe_load((work / "params.yaml").read_text())
        params["cache"].update(threads=1, part_tokens=200)
        (work / "params.yaml").write_text(yaml.safe_dump(params))
        return work

    # 244 conversations of two exchanges: the first epoch is the whole run, so the trainer waits for
    # parts throughout and the kills land while the capture rank still has parts to write
    rows = [{"id": f"{k:016x}", "conversations": SAMPLE_CONVERSATIONS[i] + SAMPLE_CONVERSATIONS[(i + j) % 61]}
            for k, (i, j) in enumerate((i, j) for j in range(1, 5) for i in range(61))]
    clean = one_thread(stage_dir(tmp_path / "clean", trained_target, rows, steps=60, threads=1))
    run_stage(clean, "cache", env)
    run_stage(clean, "train", env)
    parts = json.loads((clean / "data" / "train" / "metrics.json").read_text())["parts_computed"]
    ranks = one_thread(stage_dir(tmp_path / "ranks", trained_target, rows, steps=60, threads=1, capture_ranks=1))
    run_stage(ranks, "cache", env)
    store, state = ranks / "data" / "cache-read-through.zarr", ranks / "data" / "train_state"

    def committed() -> int:
        return len(open_cache(str(store)).committed_parts()) if (store / "zarr.json").exists() else 0

    rng = random.Random(int(os.environ.get("DEEPSPEC_TEST_SEED", "0")))
    # the trainer once it has saved a checkpoint, then the capture rank while it writes parts
    kept = [0]
    moments = [(0, lambda: state.exists() and any(state.glob("ckpt-*/meta.json"))),
               (1, lambda: committed() >= kept[-1] + 2)]
    for rank, ready in moments:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(REPO / "stages" / "train.py")]
        proc = subprocess.Popen(cmd, cwd=ranks, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 300
        while time.time() < deadline and not ready() and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.05))
        assert proc.poll() is None, f"the run ended before it could be killed ({kept}):\n" + proc.stdout.read()[-4000:]
        workers = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        victim = next(p for p in workers if _rank_of(p) == rank)
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)  # torchrun ends the other rank and fails
        assert proc.returncode != 0, out[-3000:]
        kept.append(committed())
    assert 0 < kept[1] < kept[2] < parts  # the rerun still has parts to capture
    params = yaml.safe_load((ranks / "params.yaml").read_text())
    params["train"]["capture_ranks"] = 2  # the rest on two capture ranks: the same one trainer resumes
    (ranks / "params.yaml").write_text(yaml.safe_dump(params))
    proc = _torchrun(ranks, env, timeout=600, nproc=3)
    assert proc.returncode == 0, proc.stdout[-4000:]
    final = json.loads((ranks / "data" / "train" / "metrics.json").read_text())
    assert final["parts_kept"] == kept[-1] and final["parts_kept"] + final["parts_computed"] == parts
    assert same_weights(clean / "data" / "draft", ranks / "data" / "draft")
    # a part's commit record names the rank that wrote it: here capture rank 0 or 1
    filled = str(clean / "data" / "cache-read-through.zarr")
    assert store_files_any_rank(filled) == store_files_any_rank(str(store))
    assert dict(CacheReader(filled).manifest) == dict(CacheReader(str(store)).manifest)


def _capture_rank_fails_on_its_third_part(rank: int, port: int, work: Path, recorded: dict, threads: int) -> None:
    """One process of a 2-rank world (rank 1 captures, rank 0 trains) whose capture runs out of device
    memory in its third part: the capture rank writes the error it raised next to the store."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(threads)  # the plan's: a CPU's thread count is in the store's name
    from deepspec.cache.build import stage
    from deepspec.cache.build.fill_ranks import RanksFill, capture
    from deepspec.distributed import launch, split

    real, calls = stage.compute_part, []

    def oom_on_the_third(*args, **kw):  # a device out of memory: no real component does it on demand
        calls.append(args[1])
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kw)

    stage.compute_part = oom_on_the_third
    regen, target = work / "data" / "regen" / "train.jsonl", work / "data" / "target"
    with launch(120) as d:
        roles = split(d, 1, 120)
        if not roles.capturing:  # the trainer takes the plan and gives the order, then leaves
            fill = RanksFill(roles, target)
            fill.compute(fill.plan().names)
            return
        try:
            capture(CacheConfig(url=str(work / "data" / "cache.zarr"), **CACHE), LAYERS, regen, target, roles,
                    recorded, "the plan")
        except FillError as e:
            (work / "error.json").write_text(json.dumps({"error": str(e), "calls": calls}))


def test_a_failed_capture_rank_stops_naming_the_part_and_the_reason(tmp_path, trained_target):
    from deepspec.cache.backends.readers import open_cache
    from deepspec.data.servers import free_port

    work = workdir(tmp_path, trained_target)
    recorded = plan(work)
    torch.multiprocessing.spawn(_capture_rank_fails_on_its_third_part, nprocs=2,
                                args=(free_port(), work, recorded, torch.get_num_threads()))
    got = json.loads((work / "error.json").read_text())
    assert len(got["calls"]) == 3
    assert got["error"].startswith("capture rank 0: the read-through capture of ")
    assert f"while writing part {got['calls'][2]}: OutOfMemoryError: CUDA out of memory" in got["error"]
    # the parts before it are committed; never the failed one
    assert set(open_cache(str(work / "data" / "cache.zarr")).committed_parts()) == set(got["calls"][:2])
