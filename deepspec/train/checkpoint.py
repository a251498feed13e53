"""Training checkpoints: safetensors for every tensor, JSON for everything else. No pickle.

    <dir>/ckpt-<step>/model.safetensors      all draft weights
    <dir>/ckpt-<step>/optimizer.safetensors  AdamW state per parameter (exp_avg, exp_avg_sq, step)
    <dir>/ckpt-<step>/meta.json              step, epoch, sampler position/state, lr scheduler state,
                                             RNG states, world size, params fingerprint, sha256 of the
                                             two tensor files; written last = the commit mark
A checkpoint whose files are missing, truncated or do not match their recorded hashes is refused
with a message and the next older one is tried.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deepspec.io import sha256_file, write_json

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    pass


def optimizer_tensors(opt: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    """Flatten AdamW state to {"<param>.<key>": tensor} plus the JSON-able hyperparameters."""
    tensors, groups = {}, []
    for group in opt.param_groups:
        groups.append({k: v for k, v in group.items() if k != "params"})
    index = {id(p): names[i] for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    for p, state in opt.state.items():
        for key, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"{index[id(p)]}.{key}"] = t.detach().contiguous().cpu()
    return tensors, {"param_groups": groups}


def load_optimizer_tensors(opt: torch.optim.Optimizer, names: list[str], tensors: dict, meta: dict) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]
    if len(params) != len(names):
        raise CheckpointError("optimizer parameter count differs from the checkpoint")
    for p, name in zip(params, names):
        state = {k.split(".")[-1]: v.to(p.device) for k, v in tensors.items() if k.rsplit(".", 1)[0] == name}
        if state:
            opt.state[p] = state
    for group, saved in zip(opt.param_groups, meta["param_groups"]):
        group.update({k: v for k, v in saved.items() if k in group})


def save_checkpoint(root: Path, step: int, model_state: dict, opt_tensors: dict, meta: dict, keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt-{step:08d}"
    tmp = root / f".tmp-ckpt-{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(model_state, str(tmp / "model.safetensors"))
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    meta = dict(meta, step=step, files={f: sha256_file(tmp / f) for f in ("model.safetensors", "optimizer.safetensors")})
    write_json(tmp / "meta.json", meta)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("ckpt-"))


def read_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """(model tensors, optimizer tensors, meta) or CheckpointError saying what is wrong."""
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(f"{path}: no meta.json (interrupted while saving)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path}: not valid JSON ({e})") from None
    for name, digest in meta.get("files", {}).items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f}: missing")
        if sha256_file(f) != digest:
            raise CheckpointError(f"{f}: content does not match the hash in meta.json (truncated or corrupt)")
    try:
        return load_file(str(path / "model.safetensors")), load_file(str(path / "optimizer.safetensors")), meta
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{path}: cannot read tensors: {e}") from None


def latest_valid(root: Path, fingerprint: str) -> tuple[Path, dict, dict, dict] | None:
    """Newest checkpoint that reads back and belongs to this run's params; bad ones are reported."""
    for path in reversed(list_checkpoints(root)):
        try:
            model, opt, meta = read_checkpoint(path)
        except CheckpointError as e:
            log.warning("refusing checkpoint: %s; trying an older one", e)
            continue
        if meta.get("fingerprint") != fingerprint:
            continue
        return path, model, opt, meta
    return None


def prune_stale(root: Path, fingerprint: str) -> None:
    """DVC does not clean resume state: drop checkpoints made under other params."""
    for path in list_checkpoints(root):
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue  # unreadable ones are handled (reported) by latest_valid
        if meta.get("fingerprint") != fingerprint:
            log.info("pruning checkpoint %s made under other params", path)
            shutil.rmtree(path, ignore_errors=True)
