"""Resume: what the fingerprint covers, training longer or shorter, stale checkpoints set aside."""
import json
import logging
import typing
from dataclasses import fields, replace

import pytest
import torch
from safetensors.torch import load_file

from deepspec.config import TrainConfig
from deepspec.train.checkpoint import CheckpointError, list_checkpoints
from deepspec.train.run import build_trainer, resume_fingerprint
from deepspec.train.schedule import lr_factor
from tests.train.test_train import FAST, losses, train

# settings that change how a run is executed or how far it goes, not the trajectory it follows
# (`layers` counts through the resolved layer list, passed on its own)
RESUME_NEUTRAL = {"steps", "checkpoint_every", "keep_checkpoints", "num_workers", "threads", "launcher", "layers"}


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
    raise AssertionError(f"no perturbation for train.{name} ({tp})")


def test_resume_fingerprint_covers_exactly_what_changes_the_trajectory():
    manifest = {"parts": [{"name": "p0", "samples": 10}], "dtype": "bfloat16"}
    base = TrainConfig()
    fp = resume_fingerprint(base, [0, 2], "target-a", manifest)
    hints = typing.get_type_hints(TrainConfig)
    for f in fields(TrainConfig):
        changed = replace(base, **{f.name: _other(f.name, getattr(base, f.name), hints[f.name])})
        same = resume_fingerprint(changed, [0, 2], "target-a", manifest) == fp
        assert same == (f.name in RESUME_NEUTRAL), f"train.{f.name}: fingerprint {'un' if same else ''}changed"
    assert resume_fingerprint(base, [0, 1], "target-a", manifest) != fp
    assert resume_fingerprint(base, [0, 2], "target-b", manifest) != fp
    assert resume_fingerprint(base, [0, 2], "target-a", dict(manifest, parts=[{"name": "p0", "samples": 11}])) != fp
    assert resume_fingerprint(base, [0, 2], "target-a", dict(manifest, dtype="float8_e4m3fn")) != fp


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
