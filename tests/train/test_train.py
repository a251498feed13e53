"""Draft training: learning, frozen embeddings, exact resume, layer subsets, DDP, bad checkpoints."""
import json
import os
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

from deepspec.config import TrainConfig
from deepspec.models.draft import DraftModel
from deepspec.train.checkpoint import list_checkpoints
from deepspec.train.run import run_training
from deepspec.train.schedule import lr_factor
from tests.conftest import REPO, project_env

FAST = dict(block_size=3, draft_layers=1, markov_rank=16, anchors_per_sample=6, batch_size=4, steps=40,
            lr=5e-3, warmup_steps=4, checkpoint_every=10, seed=0)


def train(tmp_path, small_cache, trained_target, layers=(-1, 0, 2), **kw):
    cfg = TrainConfig(**{**FAST, **kw})
    final = run_training(cfg, list(layers), str(small_cache), trained_target, tmp_path / "draft",
                         tmp_path / "train", tmp_path / "state")
    return cfg, final


def losses(tmp_path):
    tsv = tmp_path / "train" / "live" / "plots" / "metrics" / "train" / "loss.tsv"
    rows = [line.split("\t") for line in tsv.read_text().splitlines()]
    col = rows[0].index("loss")
    return [float(r[col]) for r in rows[1:]]


def test_loss_falls_and_frozen_parameters_stay_identical(tmp_path, small_cache, trained_target):
    from transformers import AutoModelForCausalLM

    cfg, final = train(tmp_path, small_cache, trained_target, steps=80)
    curve = losses(tmp_path)
    assert len(curve) == 80
    assert sum(curve[-10:]) / 10 < 0.6 * sum(curve[:5]) / 5
    assert json.loads((tmp_path / "train" / "metrics.json").read_text())["steps"] == 80
    draft = DraftModel.load(tmp_path / "draft")
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(draft.lm_head.weight, target.get_output_embeddings().weight)
    assert not draft.embed_tokens.weight.requires_grad and not draft.lm_head.weight.requires_grad


def test_dflash_has_no_heads_and_trains(tmp_path, small_cache, trained_target):
    train(tmp_path, small_cache, trained_target, algorithm="dflash", steps=20)
    draft = DraftModel.load(tmp_path / "draft")
    assert draft.markov_in is None and draft.confidence_head is None
    assert not any(k.startswith(("markov", "confidence")) for k in load_file(tmp_path / "draft" / "model.safetensors"))


def test_layer_subset_trains_without_recomputing_the_cache(tmp_path, small_cache, trained_target):
    train(tmp_path, small_cache, trained_target, layers=(2,), steps=10)
    draft = DraftModel.load(tmp_path / "draft")
    assert draft.config.target_layers == [2]
    assert draft.fc.weight.shape[1] == draft.config.target_hidden_size


def test_resume_restores_every_state_and_bad_checkpoints_are_skipped(tmp_path, small_cache, trained_target, caplog):
    train(tmp_path / "full", small_cache, trained_target)
    full = load_file(tmp_path / "full" / "draft" / "model.safetensors")
    part = tmp_path / "part"
    train(part, small_cache, trained_target, steps=40)  # runs to the end: checkpoints 10, 20, 30, 40 (2 kept)
    ckpts = list_checkpoints(part / "state")
    assert [c.name for c in ckpts] == ["ckpt-00000030", "ckpt-00000040"]
    # pretend the run died just after saving step 30: drop the newer one, truncate a file of step 40 instead
    shutil.rmtree(ckpts[1])
    train(part, small_cache, trained_target, steps=40)  # resumes from step 30
    assert load_file(part / "draft" / "model.safetensors").keys() == full.keys()
    for k, v in load_file(part / "draft" / "model.safetensors").items():
        assert torch.equal(v, full[k]), k
    assert len(losses(part)) == 40  # the curve holds each step once
    bad = list_checkpoints(part / "state")[-1] / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    train(part, small_cache, trained_target, steps=40)
    assert "refusing checkpoint" in caplog.text and "content does not match" in caplog.text
    for k, v in load_file(part / "draft" / "model.safetensors").items():
        assert torch.equal(v, full[k]), k


def test_schedules():
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(99, cfg) == pytest.approx(0.1, abs=0.01)
    sgdr = TrainConfig(steps=100, warmup_steps=0, schedule="sgdr", sgdr_period=10, sgdr_mult=2.0, min_lr_ratio=0.0)
    assert lr_factor(0, sgdr) == 1.0 and lr_factor(10, sgdr) == 1.0 and lr_factor(30, sgdr) == 1.0
    assert lr_factor(9, sgdr) < 0.05 and lr_factor(20, sgdr) == pytest.approx(0.5)


def _stage_dir(tmp_path, small_cache, trained_target, **train_kw):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    shutil.copytree(trained_target, work / "data" / "target")
    shutil.copytree(small_cache, work / "data" / "cache.zarr")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["layers"] = [-1, 0, 2]
    params["train"] = {**FAST, **train_kw}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    return work


@pytest.mark.slow
def test_sigkill_then_rerun_gives_bitwise_the_same_weights(tmp_path, small_cache, trained_target):
    clean = _stage_dir(tmp_path / "clean", small_cache, trained_target, steps=60, checkpoint_every=5)
    crash = _stage_dir(tmp_path / "crash", small_cache, trained_target, steps=60, checkpoint_every=5)
    cmd = [sys.executable, str(REPO / "stages" / "train.py")]
    env = project_env(REPO, DEEPSPEC_LOG="WARNING")
    subprocess.run(cmd, cwd=clean, env=env, check=True, capture_output=True)
    proc = subprocess.Popen(cmd, cwd=crash, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = crash / "data" / "train_state"
    deadline = time.time() + 300
    while time.time() < deadline and not (state.exists() and any(p.name >= "ckpt-00000025" for p in state.iterdir())):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (crash / "data" / "draft").exists()
    subprocess.run(cmd, cwd=crash, env=env, check=True, capture_output=True)
    a = load_file(clean / "data" / "draft" / "model.safetensors")
    b = load_file(crash / "data" / "draft" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_torchrun_two_processes_follow_the_one_process_loss_curve(tmp_path, small_cache, trained_target):
    from deepspec.data.servers import free_port

    one = _stage_dir(tmp_path / "one", small_cache, trained_target, steps=60, batch_size=8, anchors_per_sample=12)
    two = _stage_dir(tmp_path / "two", small_cache, trained_target, steps=60, batch_size=4, anchors_per_sample=12)
    env = project_env(REPO, DEEPSPEC_LOG="WARNING")
    subprocess.run([sys.executable, str(REPO / "stages" / "train.py")], cwd=one, env=env, check=True,
                   capture_output=True)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(REPO / "stages" / "train.py")],
                          cwd=two, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    curve_one = _curve(one)
    curve_two = _curve(two)
    assert len(curve_one) == len(curve_two) == 60
    smooth = lambda c: [sum(c[i:i + 10]) / 10 for i in range(0, 60, 10)]  # noqa: E731
    s1, s2 = smooth(curve_one), smooth(curve_two)
    assert s1[-1] < 0.7 * s1[0] and s2[-1] < 0.7 * s2[0]
    for x, y in zip(s1, s2):
        assert abs(x - y) <= 0.15 * max(x, y), (s1, s2)


def _curve(work: Path):
    tsv = work / "data" / "train" / "live" / "plots" / "metrics" / "train" / "loss.tsv"
    rows = [line.split("\t") for line in tsv.read_text().splitlines()]
    col = rows[0].index("loss")
    return [float(r[col]) for r in rows[1:]]
