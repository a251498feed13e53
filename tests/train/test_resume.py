"""Resume: what the fingerprint covers, training longer or shorter, stale checkpoints set aside."""
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import typing
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from deepspec.config import TrainConfig
from deepspec.train.checkpoint import CheckpointError, list_checkpoints
from deepspec.train.run import build_trainer, resume_fingerprint
from deepspec.train.schedule import lr_factor
from tests.conftest import REPO, project_env
from tests.train.test_train import FAST, _stage_dir, losses, train

# settings that change how a run is executed or how far it goes, not the trajectory it follows
# (`layers` counts through the resolved layer list, passed on its own; `compile` through whether it
# compiles on the run's device, passed on its own)
RESUME_NEUTRAL = {"steps", "checkpoint_every", "keep_checkpoints", "num_workers", "read_ahead", "mirror", "mirror_gb",
                  "state_url", "state_storage_options", "threads", "launcher",
                  "layers", "collective_timeout_s", "capture", "capture_ranks", "compile"}


def _other(name: str, value, tp):
    """A different valid-looking value of a TrainConfig field, from its type."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Literal:
        return next(a for a in args if a != value)
    if value is None:
        inner = next(a for a in args if a is not type(None))
        return [5] if typing.get_origin(inner) is list else inner(1)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.25
    if isinstance(value, list):
        return value + [5]
    if isinstance(value, str):
        return value + " --other"
    if isinstance(value, dict):
        return {**value, "other": 1}
    raise AssertionError(f"no perturbation for train.{name} ({tp})")


def test_resume_fingerprint_covers_exactly_what_changes_the_trajectory():
    manifest = {"parts": [{"name": "p0", "samples": 10, "tokens": 400}], "dtype": "bfloat16"}
    base = TrainConfig()
    fp = resume_fingerprint(base, [0, 2], "target-a", manifest)
    hints = typing.get_type_hints(TrainConfig)
    for f in fields(TrainConfig):
        changed = replace(base, **{f.name: _other(f.name, getattr(base, f.name), hints[f.name])})
        same = resume_fingerprint(changed, [0, 2], "target-a", manifest) == fp
        # the capture mode picks the order when window_parts is auto (the default): then it counts
        neutral = f.name in RESUME_NEUTRAL and not (f.name == "capture" and base.window_parts == "auto")
        assert same == neutral, f"train.{f.name}: fingerprint {'un' if same else ''}changed"
    fixed = replace(base, window_parts=0)
    assert resume_fingerprint(fixed, [0, 2], "target-a", manifest) == fp  # auto offline is 0
    assert resume_fingerprint(replace(fixed, capture="read-through"), [0, 2], "target-a", manifest) == fp
    assert resume_fingerprint(base, [0, 1], "target-a", manifest) != fp
    assert resume_fingerprint(base, [0, 2], "target-a", manifest, compiled=True) != fp
    assert resume_fingerprint(base, [0, 2], "target-b", manifest) != fp
    assert resume_fingerprint(base, [0, 2], "target-a", dict(manifest, parts=[{"name": "p0", "samples": 11, "tokens": 400}])) != fp
    # a planned part (read-through) and the same part committed in an HDF5 store resume into each other
    hdf5 = dict(manifest, parts=[dict(manifest["parts"][0], chunk_index=[0, 10, 7])])
    assert resume_fingerprint(base, [0, 2], "target-a", hdf5) == fp
    assert resume_fingerprint(base, [0, 2], "target-a", dict(manifest, dtype="float8_e4m3fn")) != fp


# resume_fingerprint(TrainConfig(), [0, 2], "target-a", MANIFEST) as deepspec computed it before the
# optimizer's betas and eps were settings: checkpoints saved then must still resume
MANIFEST = {"parts": [{"name": "p0", "samples": 10, "tokens": 400}], "dtype": "bfloat16"}
EARLIER_DEFAULT_FINGERPRINT = "a53ce4a1547c6e62eac2de11a22bf26855d895ecaf9da5f202e06a59780ab997"


def test_adamws_settings_reach_the_optimizer_and_earlier_checkpoints_still_resume(tmp_path, small_cache,
                                                                                  trained_target):
    assert resume_fingerprint(TrainConfig(), [0, 2], "target-a", MANIFEST) == EARLIER_DEFAULT_FINGERPRINT
    cfg = TrainConfig(**dict(FAST, adam_betas=[0.8, 0.99], adam_eps=1e-6, weight_decay=0.01))
    trainer = build_trainer(cfg, [-1, 0, 2], str(small_cache), trained_target, tmp_path / "out", tmp_path / "state")
    group = trainer.optimizer.param_groups[0]
    assert group["betas"] == (0.8, 0.99) and group["eps"] == 1e-6 and group["weight_decay"] == 0.01
    default = build_trainer(TrainConfig(**FAST), [-1, 0, 2], str(small_cache), trained_target, tmp_path / "o2",
                            tmp_path / "s2").optimizer.param_groups[0]
    assert default["betas"] == (0.9, 0.95) and default["eps"] == 1e-8 and default["weight_decay"] == 0.0


def _lr_curve(tmp_path):
    tsv = tmp_path / "train" / "live" / "plots" / "metrics" / "train" / "lr.tsv"
    rows = [line.split("\t") for line in tsv.read_text().splitlines()]
    step, lr = rows[0].index("step"), rows[0].index("lr")
    return {int(r[step]): float(r[lr]) for r in rows[1:]}


def test_raising_steps_continues_from_the_last_checkpoint_with_the_new_horizon(tmp_path, small_cache,
                                                                               trained_target, caplog):
    train(tmp_path, small_cache, trained_target, steps=20)  # checkpoints 10, 20
    first = losses(tmp_path)
    caplog.set_level(logging.INFO)
    # also change every other setting that does not touch the trajectory
    cfg, final = train(tmp_path, small_cache, trained_target, steps=40, checkpoint_every=20, keep_checkpoints=3,
                       threads=1)
    assert "resumed from" in caplog.text and "ckpt-00000020" in caplog.text
    old_lr = cfg.lr * lr_factor(20, replace(cfg, steps=20))
    new_lr = cfg.lr * lr_factor(20, cfg)
    assert f"train.steps changed from 20 to 40 since the checkpoint at step 20: LR at step 20 {old_lr:.3e} " \
           f"under the old horizon, {new_lr:.3e} now" in caplog.text
    assert [p.name for p in list_checkpoints(tmp_path / "state")] == ["ckpt-00000010", "ckpt-00000020",
                                                                      "ckpt-00000040"]
    curve = losses(tmp_path)
    assert len(curve) == 40 and curve[:20] == first
    lr = _lr_curve(tmp_path)
    assert lr[20] == pytest.approx(cfg.lr * lr_factor(19, replace(cfg, steps=20)))  # the last step before
    assert lr[21] == pytest.approx(new_lr)
    assert final["steps"] == 40


def test_a_run_killed_while_dvclive_wrote_its_files_resumes(tmp_path, small_cache, trained_target, caplog):
    """kill -9 in the middle of dvclive's per-step writes leaves its summary torn (it is rewritten in
    place, and dvclive reads it back on resume) and the last row of a curve half written."""
    train(tmp_path, small_cache, trained_target, steps=20)
    first = losses(tmp_path)
    live = tmp_path / "train" / "live"
    summary = (live / "metrics.json").read_text()
    (live / "metrics.json").write_text(summary[:len(summary) // 2])
    tsv = live / "plots" / "metrics" / "train" / "loss.tsv"
    tsv.write_text(tsv.read_text() + "21\t2.")  # the row after the checkpoint's, cut off
    caplog.set_level(logging.WARNING)
    train(tmp_path, small_cache, trained_target, steps=30)
    assert f"{live / 'metrics.json'} was cut off" in caplog.text
    curve = losses(tmp_path)
    assert len(curve) == 30 and curve[:20] == first
    assert json.loads((live / "metrics.json").read_text())["train"]["loss"] == curve[-1]  # written again


def test_a_directory_named_like_a_checkpoint_that_is_not_one_is_named_and_left_alone(tmp_path, small_cache,
                                                                                      trained_target, caplog):
    """The state directory is shared with people: `ckpt-best/` (a copy someone kept) or `ckpt-5/` is
    not a checkpoint this code wrote, so a run neither resumes from it nor prunes it; the steps of
    real ones order numerically."""
    state = tmp_path / "state"
    for name in ("ckpt-best", "ckpt-5"):
        (state / name).mkdir(parents=True)
        (state / name / "notes.txt").write_text("mine")
    caplog.set_level(logging.WARNING)
    train(tmp_path, small_cache, trained_target, steps=30, keep_checkpoints=1)
    assert [p.name for p in list_checkpoints(state)] == ["ckpt-00000030"]
    for name in ("ckpt-best", "ckpt-5"):
        assert (state / name / "notes.txt").read_text() == "mine"
        assert f"{state / name}: not a checkpoint" in caplog.text
    (state / "ckpt-100000000").mkdir()  # past 8 digits, still after step 30
    assert [p.name for p in list_checkpoints(state)] == ["ckpt-00000030", "ckpt-100000000"]


def test_lowering_steps_resumes_from_a_checkpoint_at_or_below_it_or_stops(tmp_path, small_cache, trained_target,
                                                                          caplog):
    state = tmp_path / "state"
    train(tmp_path, small_cache, trained_target, steps=40)  # checkpoints 30, 40 kept
    at30 = load_file(state / "ckpt-00000030" / "model.safetensors")
    # exactly at a checkpoint: that checkpoint is the final model, nothing is trained or removed
    _, final = train(tmp_path, small_cache, trained_target, steps=30)
    assert final["steps"] == 30
    draft = load_file(tmp_path / "draft" / "model.safetensors")
    assert draft.keys() == at30.keys() and all(torch.equal(draft[k], at30[k]) for k in at30)
    assert [p.name for p in list_checkpoints(state)] == ["ckpt-00000030", "ckpt-00000040"]
    assert len(losses(tmp_path)) == 30
    # between two: continue from the one below; the longer run's checkpoint goes once this run has saved
    caplog.set_level(logging.INFO)
    _, final = train(tmp_path, small_cache, trained_target, steps=35)
    assert "beyond train.steps=35" in caplog.text and "ckpt-00000030" in caplog.text
    assert final["steps"] == 35 and len(losses(tmp_path)) == 35
    assert [p.name for p in list_checkpoints(state)] == ["ckpt-00000030", "ckpt-00000035"]
    # below every checkpoint: stop, keep them all
    with pytest.raises(CheckpointError, match=r"steps \[30, 35\].*beyond train.steps=20"):
        train(tmp_path, small_cache, trained_target, steps=20)
    assert [p.name for p in list_checkpoints(state)] == ["ckpt-00000030", "ckpt-00000035"]


def _fingerprint(path):
    return json.loads((path / "meta.json").read_text())["fingerprint"]


def test_params_change_sets_old_checkpoints_aside_until_the_new_run_saves(tmp_path, small_cache, trained_target,
                                                                          caplog):
    state = tmp_path / "state"
    train(tmp_path, small_cache, trained_target, steps=10)
    old = _fingerprint(list_checkpoints(state)[-1])
    # a run under other params starts (and, say, dies before its first checkpoint)
    other = TrainConfig(**{**FAST, "steps": 10, "lr": 1e-3})
    trainer = build_trainer(other, [-1, 0, 2], str(small_cache), trained_target, tmp_path / "train", state)
    assert trainer.restore() is False
    assert list_checkpoints(state) == []
    aside = state / f"stale-{old}"
    assert [p.name for p in list_checkpoints(aside)] == ["ckpt-00000010"]
    # switching back finds them again
    caplog.set_level(logging.INFO)
    train(tmp_path, small_cache, trained_target, steps=10)
    assert "resumed from" in caplog.text
    assert [p.name for p in list_checkpoints(state)] == ["ckpt-00000010"] and not aside.exists()
    # the other params run to a checkpoint: only then are the old ones gone
    train(tmp_path, small_cache, trained_target, steps=10, lr=1e-3)
    assert [p.name for p in list_checkpoints(state)] == ["ckpt-00000010"]
    assert _fingerprint(list_checkpoints(state)[-1]) != old
    assert not any(p.name.startswith("stale-") for p in state.iterdir())


# ---- too little data -----------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_an_empty_regen_output_stops_before_a_store_train_could_read(tmp_path, trained_target):
    # the cache stage refuses 0 rows (it never leaves an empty or a previous store for train to read)
    from deepspec.cache.build.stage import EmptyInput, build_cache
    from deepspec.config import CacheConfig

    (tmp_path / "regen.jsonl").write_text("")
    with pytest.raises(EmptyInput, match=r"regen\.jsonl: nothing to cache: it has no rows"):
        build_cache(CacheConfig(url=str(tmp_path / "cache.zarr"), part_tokens=400), [-1, 0, 2],
                    tmp_path / "regen.jsonl", trained_target)
    assert not any((tmp_path / "cache.zarr").glob("parts/*"))
    assert list_checkpoints(tmp_path / "state") == []


def _torchrun(work, env, timeout: float, nproc: int = 2, script=None, args=()) -> subprocess.CompletedProcess:
    """torchrun, stopped with its workers if it overruns (a hang must not outlive the test)."""
    from deepspec.data.servers import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), str(script or REPO / "stages" / "train.py"), *args]
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        workers = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        proc.terminate()  # torchrun stops its workers (they run in sessions of their own) on SIGTERM
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *workers]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not finish in {timeout} s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


@pytest.mark.slow
def test_torchrun_with_fewer_batches_than_ranks_stops_with_an_error(tmp_path, small_cache, trained_target):
    from deepspec.loader.dataset import TargetCacheDataset

    n = len(TargetCacheDataset(str(small_cache)))
    work = _stage_dir(tmp_path, small_cache, trained_target, batch_size=n)  # one batch, two ranks
    proc = _torchrun(work, project_env(REPO, DEEPSPEC_LOG="WARNING"), timeout=180)
    assert proc.returncode != 0
    assert (f"error: data/cache.zarr: {n} samples in the cache make 1 batch of batch_size {n}, fewer than the "
            "world size 2") in proc.stdout, proc.stdout[-4000:]
    assert "trainer.py" not in proc.stdout, proc.stdout[-4000:]  # a message, not a worker's traceback
    assert not (work / "data" / "train_state").exists()


# ---- what a checkpoint restores, and on which ranks ------------------------------------------------

def test_rng_states_survive_a_checkpoint_round_trip():
    from deepspec.train.checkpoint import rng_state, set_rng_state

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # leave a cached Gaussian in both
    draws = lambda: (random.random(), random.gauss(0, 1), np.random.random(3).tolist(),  # noqa: E731
                     np.random.standard_normal(), torch.rand(3).tolist())
    state = json.loads(json.dumps(rng_state()))  # through meta.json
    expected = draws()
    random.random(), np.random.random(5), np.random.standard_normal(), torch.rand(7)
    set_rng_state(state)
    assert draws() == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_state_survives_a_checkpoint_round_trip():
    from deepspec.train.checkpoint import rng_state, set_rng_state

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.manual_seed(4)
    state = json.loads(json.dumps(rng_state(device)))
    expected = torch.rand(5, device=device).tolist()
    torch.rand(9, device=device)
    set_rng_state(state, device)
    assert torch.rand(5, device=device).tolist() == expected


def test_anchor_streams_are_distinct_for_every_step_micro_batch_and_rank():
    from deepspec.models.objectives import anchor_generator, anchor_key

    for steps, micro, ranks in ((64, 1024, 4), (1024, 16, 16), (16, 16, 1024)):
        keys = {anchor_key(7, s, m, r) for s in range(steps) for m in range(micro) for r in range(ranks)}
        assert len(keys) == steps * micro * ranks
    top = (2**38 - 1, 1023, 2**16 - 1)
    assert anchor_key(7, *top) not in {anchor_key(7, 0, 0, 0), anchor_key(7, 2**38 - 2, 1023, 2**16 - 1)}
    for bad in ((2**38, 0, 0), (0, 1024, 0), (0, 0, 2**16), (-1, 0, 0)):
        with pytest.raises(ValueError, match="anchor"):
            anchor_key(7, *bad)
    # the streams differ too (the CPU torch generator would keep only 32 bits of a 64-bit seed)
    tuples = [(0, 10, 0), (1, 0, 1), (0, 0, 101), (0, 1, 0), (2**32, 0, 0), (0, 0, 0), (2**32 + 1, 3, 5), (1, 3, 5)]
    firsts = {tuple(anchor_generator(7, *t).random(4).tolist()) for t in tuples}
    assert len(firsts) == len(tuples)
    assert anchor_generator(7, 1, 3, 5).random(4).tolist() == anchor_generator(7, 1, 3, 5).random(4).tolist()
    assert anchor_generator(8, 1, 3, 5).random(4).tolist() != anchor_generator(7, 1, 3, 5).random(4).tolist()


def test_grad_accum_past_the_anchor_bound_is_refused(tmp_path, small_cache, trained_target):
    from deepspec.train.trainer import TrainError

    with pytest.raises(TrainError, match="grad_accum"):
        train(tmp_path, small_cache, trained_target, grad_accum=1025)


def _rewrite(ckpt, name, tensors):
    """Replace a checkpoint's tensor file and its recorded hash (a well-formed checkpoint of other content)."""
    from safetensors.torch import save_file

    from deepspec.io import sha256_file

    save_file(tensors, str(ckpt / name))
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][name] = sha256_file(ckpt / name)
    (ckpt / "meta.json").write_text(json.dumps(meta))


def test_model_and_optimizer_state_load_strictly(tmp_path, small_cache, trained_target):
    state = tmp_path / "state"
    train(tmp_path, small_cache, trained_target, steps=10)
    ckpt = list_checkpoints(state)[-1]
    model = load_file(ckpt / "model.safetensors")
    _rewrite(ckpt, "model.safetensors", dict(model, extra=torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"model state.*unexpected \['extra'\]"):
        train(tmp_path, small_cache, trained_target, steps=10)
    _rewrite(ckpt, "model.safetensors", {k: v for k, v in model.items() if k != "fc.weight"})
    with pytest.raises(CheckpointError, match=r"model state.*missing \['fc.weight'\]"):
        train(tmp_path, small_cache, trained_target, steps=10)
    _rewrite(ckpt, "model.safetensors", model)
    opt = load_file(ckpt / "optimizer.safetensors")
    _rewrite(ckpt, "optimizer.safetensors", {k: v for k, v in opt.items() if not k.startswith("fc.weight.")})
    with pytest.raises(CheckpointError, match="no optimizer state for fc.weight"):
        train(tmp_path, small_cache, trained_target, steps=10)
    assert [p.name for p in list_checkpoints(state)] == ["ckpt-00000010"]  # refused, not removed


def test_a_resume_under_another_world_size_is_refused_with_what_to_do(tmp_path, small_cache, trained_target):
    train(tmp_path, small_cache, trained_target, steps=10)
    meta_path = list_checkpoints(tmp_path / "state")[-1] / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(dict(meta, world_size=2)))  # as if saved by a 2-process run
    with pytest.raises(CheckpointError, match="saved by a run with world size 2, this run has 1.*rerun with 2 "
                                              "processes, or move .* aside"):
        train(tmp_path, small_cache, trained_target, steps=10)


# a rank of a multi-node run sees its own node's disk: this driver gives each rank its own directory
NODE_DRIVER = """
import gc, os, runpy, sys
os.chdir(sys.argv[1 + int(os.environ["RANK"])])
sys.argv = [sys.argv[-1]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:  # a DDP module left to interpreter shutdown destroys its gloo group there (a hang seen in CI)
    ddp = sum(type(o).__name__ == "DistributedDataParallel" for o in gc.get_objects())
    print(f"DDP modules alive at exit: {ddp}", flush=True)
"""


@pytest.mark.slow
def test_torchrun_ranks_resume_from_the_same_checkpoint_or_all_stop(tmp_path, small_cache, trained_target):
    node0 = _stage_dir(tmp_path / "node0", small_cache, trained_target, steps=40, keep_checkpoints=3)
    env = project_env(REPO, DEEPSPEC_LOG="INFO")
    first = _torchrun(node0, env, timeout=240)
    assert first.returncode == 0, first.stdout[-4000:]
    full = load_file(node0 / "data" / "draft" / "model.safetensors")
    state0 = node0 / "data" / "train_state"
    meta = json.loads((state0 / "ckpt-00000040" / "meta.json").read_text())
    assert set(meta["ranks"]) == {"0", "1"} and all("numpy" in meta["ranks"][r]["rng"] for r in "01")
    shutil.rmtree(state0 / "ckpt-00000040")  # the run died after saving step 30
    shutil.rmtree(node0 / "data" / "draft")
    # rank 1 runs on a node whose copy of the state has a corrupt step 30
    node1 = tmp_path / "node1" / "work"
    shutil.copytree(node0, node1)
    bad = node1 / "data" / "train_state" / "ckpt-00000030" / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    driver = tmp_path / "driver.py"
    driver.write_text(NODE_DRIVER)
    args = [str(node0), str(node1), str(REPO / "stages" / "train.py")]
    proc = _torchrun(tmp_path, env, timeout=240, script=driver, args=args)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("resumed from") == 2 and proc.stdout.count("ckpt-00000020 (step 20") == 2, \
        proc.stdout[-4000:]
    resumed = load_file(node0 / "data" / "draft" / "model.safetensors")
    assert all(torch.equal(resumed[k], full[k]) for k in full)
    # rank 1's node has no state at all (no shared filesystem): every rank stops, nothing is removed
    shutil.rmtree(node1 / "data" / "train_state")
    before = [p.name for p in list_checkpoints(state0)]
    proc = _torchrun(tmp_path, env, timeout=240, script=driver, args=args)
    assert proc.returncode != 0
    assert proc.stdout.count("error: no checkpoint in data/train_state can be resumed by every rank") == 2, \
        proc.stdout[-4000:]
    assert "rank 1: data/train_state/ckpt-00000040: not found" in proc.stdout
    assert "trainer.py" not in proc.stdout, proc.stdout[-4000:]  # a message, not a worker's traceback
    assert proc.stdout.count("DDP modules alive at exit: 0") == 2, proc.stdout[-4000:]
    assert [p.name for p in list_checkpoints(state0)] == before


# ---- resume state on S3 --------------------------------------------------------------------------

def test_checkpoints_at_an_s3_url_save_list_read_set_aside_and_name_what_is_wrong(moto):
    from deepspec.train.checkpoint import read_stored, save_checkpoint, set_aside_stale, steps_beyond, valid_checkpoints
    from deepspec.train.state_dir import StateDir

    state = StateDir(f"s3://{moto.bucket('state-unit')}/run/state", moto.storage_options)
    model = {"w": torch.arange(6, dtype=torch.float32, device="cpu").view(2, 3)}
    opt = {"w.exp_avg": torch.ones(2, 3, device="cpu")}
    for step in (10, 20, 30):
        where = save_checkpoint(state, step, {"w": model["w"] * step}, opt, {"fingerprint": "A"}, keep=2)
        assert where == f"{state.url}/ckpt-{step:08d}"
    assert state.entries("ckpt-") == ["ckpt-00000020", "ckpt-00000030"]  # pruned to 2, as locally
    got = [(n, m["w"][0, 1].item()) for n, m, _, _ in valid_checkpoints(state, "A", max_step=100)]
    assert got == [("ckpt-00000030", 30.0), ("ckpt-00000020", 20.0)]
    assert steps_beyond(state, "A", 20) == [30]
    # damage as an interrupted upload leaves it: a tensor file cut short, then a checkpoint with no commit mark
    fs = state.fs
    key = f"{state.root}/ckpt-00000030/model.safetensors"
    fs.pipe_file(key, fs.cat_file(key)[:50])
    with pytest.raises(CheckpointError, match=rf"{state.url}/ckpt-00000030/model.safetensors: content does not "
                                              r"match the hash"):
        read_stored(state, "ckpt-00000030")
    fs.rm(f"{state.root}/ckpt-00000030/meta.json")
    with pytest.raises(CheckpointError, match=rf"{state.url}/ckpt-00000030: no meta.json"):
        read_stored(state, "ckpt-00000030")
    assert [n for n, *_ in valid_checkpoints(state, "A", max_step=100)] == ["ckpt-00000020"]
    # other params set the checkpoints aside, and switching back brings them back
    set_aside_stale(state, "B")
    assert state.entries("ckpt-") == ["ckpt-00000030"]  # no commit mark: not judged, left
    assert state.entries("ckpt-", under="stale-A") == ["stale-A/ckpt-00000020"]
    set_aside_stale(state, "A")
    assert state.entries("ckpt-") == ["ckpt-00000020", "ckpt-00000030"] and state.entries("stale-") == []
    assert read_stored(state, "ckpt-00000020")[0]["w"][0, 1].item() == 20.0


@pytest.mark.slow
def test_torchrun_ranks_sharing_only_an_s3_bucket_resume_exactly(tmp_path, moto, small_cache, trained_target):
    """Two ranks, each in a directory of its own (no shared filesystem), resume state on S3."""
    bucket = moto.bucket("state-torchrun")
    kw = dict(steps=40, keep_checkpoints=3, state_url=f"s3://{bucket}/team/state",
              state_storage_options={"endpoint_url": moto.endpoint})
    node0 = _stage_dir(tmp_path / "node0", small_cache, trained_target, **kw)
    node1 = _stage_dir(tmp_path / "node1", small_cache, trained_target, **kw)
    driver = tmp_path / "driver.py"
    driver.write_text(NODE_DRIVER)
    args = [str(node0), str(node1), str(REPO / "stages" / "train.py")]
    env = project_env(REPO, DEEPSPEC_LOG="INFO")
    first = _torchrun(tmp_path, env, timeout=240, script=driver, args=args)
    assert first.returncode == 0, first.stdout[-4000:]
    assert not (node0 / "data" / "train_state").exists() and not (node1 / "data" / "train_state").exists()
    full = load_file(node0 / "data" / "draft" / "model.safetensors")
    fs = moto.client()
    keys = [o["Key"] for o in fs.list_objects_v2(Bucket=bucket, Prefix="team/state/")["Contents"]]
    assert {k.split("/")[2] for k in keys} == {"ckpt-00000020", "ckpt-00000030", "ckpt-00000040"}
    for k in keys:  # the run died after saving step 30
        if "/ckpt-00000040/" in k:
            fs.delete_object(Bucket=bucket, Key=k)
    shutil.rmtree(node0 / "data" / "draft")
    proc = _torchrun(tmp_path, env, timeout=240, script=driver, args=args)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count(f"resumed from s3://{bucket}/team/state/ckpt-00000030 (step 30") == 2, \
        proc.stdout[-4000:]
    resumed = load_file(node0 / "data" / "draft" / "model.safetensors")
    assert all(torch.equal(resumed[k], full[k]) for k in full)
