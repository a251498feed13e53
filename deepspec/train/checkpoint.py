"""Training checkpoints: safetensors for every tensor, JSON for everything else. No pickle.

    <dir>/ckpt-<step>/model.safetensors      all draft weights
    <dir>/ckpt-<step>/optimizer.safetensors  AdamW state per parameter (exp_avg, exp_avg_sq, step)
    <dir>/ckpt-<step>/meta.json              step, epoch, per rank: sampler position/state and RNG
                                             states; lr scheduler state (with the run's `steps`), world
                                             size, params fingerprint, names of parameters without
                                             optimizer state, sha256 of the two tensor files; written
                                             last = the commit mark
A checkpoint whose files are missing, truncated or do not match their recorded hashes is refused
with a message and the next older one is tried (with several ranks: one that every rank reads, see
Trainer.restore). A well-formed checkpoint whose tensors do not match the draft is an error.

Checkpoints made under other params (another fingerprint) are moved to <dir>/stale-<fingerprint>/,
not deleted: switching the params back brings them back. They are deleted once a run under the new
params has saved a checkpoint of its own.

<dir> is a local directory or an fsspec URL (`s3://bucket/prefix`); deepspec/train/state_dir.py says
how a checkpoint is committed and read on each.
"""
from __future__ import annotations

import base64
import json
import logging
import random
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from deepspec.io import sha256_file, write_json
from deepspec.train.state_dir import FILES, StateDir, as_state

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    pass


ADAMW_STATE = ("exp_avg", "exp_avg_sq", "step")


def optimizer_tensors(opt: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    """Flatten AdamW state to {"<param>.<key>": tensor} plus the JSON-able hyperparameters and the
    names of the parameters without state (never had a gradient)."""
    tensors, groups = {}, []
    for group in opt.param_groups:
        groups.append({k: v for k, v in group.items() if k != "params"})
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {id(p): names[i] for i, p in enumerate(params)}
    for p, state in opt.state.items():
        for key, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value, device="cpu")
            tensors[f"{index[id(p)]}.{key}"] = t.detach().contiguous().cpu()
    stateless = [index[id(p)] for p in params if not opt.state.get(p)]
    return tensors, {"param_groups": groups, "stateless": stateless}


def check_optimizer_state(opt: torch.optim.Optimizer, names: list[str], tensors: dict, meta: dict) -> None:
    """Strict: AdamW state for every parameter (but those saved as never having had a gradient), of
    the parameter's shape, and nothing else."""
    if len(meta["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(f"optimizer state has {len(meta['param_groups'])} parameter groups, this run's "
                              f"optimizer {len(opt.param_groups)}")
    shapes = {name: p.shape for name, p in zip(names, (p for g in opt.param_groups for p in g["params"]))}
    saved: dict[str, dict] = {}
    for key, t in tensors.items():
        name, _, part = key.rpartition(".")
        if name not in shapes or part not in ADAMW_STATE:
            raise CheckpointError(f"optimizer state has {key!r}, not AdamW state of a parameter of this draft")
        saved.setdefault(name, {})[part] = t
    stateless = set(meta.get("stateless", []))
    for name, shape in shapes.items():
        got = saved.get(name, {})
        if not got and name in stateless:
            continue
        if not got:
            raise CheckpointError(f"no optimizer state for {name}")
        if set(got) != set(ADAMW_STATE):
            raise CheckpointError(f"optimizer state of {name} has {sorted(got)}, AdamW keeps {sorted(ADAMW_STATE)}")
        for part in ("exp_avg", "exp_avg_sq"):
            if got[part].shape != shape:
                raise CheckpointError(f"optimizer state {name}.{part} has shape {list(got[part].shape)}, the "
                                      f"parameter {list(shape)}")


def load_optimizer_tensors(opt: torch.optim.Optimizer, names: list[str], tensors: dict, meta: dict) -> None:
    """After `check_optimizer_state`. `step` stays on the CPU, as torch keeps it (not capturable)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for p, name in zip(params, names):
        state = {k.split(".")[-1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == name}
        if state:
            opt.state[p] = {k: v if k == "step" else v.to(p.device) for k, v in state.items()}
    for group, saved in zip(opt.param_groups, meta["param_groups"]):
        group.update({k: v for k, v in saved.items() if k in group})


def check_model_state(model: torch.nn.Module, state: dict) -> None:
    """Strict: exactly the draft's persistent tensors, of their shapes (the rotary buffers are
    non-persistent: recomputed, never saved)."""
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    missing = sorted(k for k in expected if k not in state)
    unexpected = sorted(k for k in state if k not in expected)
    shapes = [f"{k} {list(state[k].shape)} (draft {list(v.shape)})" for k, v in expected.items()
              if k in state and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        raise CheckpointError(f"model state does not match this draft: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}, other shapes {shapes[:5]}")


def save_checkpoint(root: StateDir | Path, step: int, model_state: dict, opt_tensors: dict, meta: dict,
                    keep: int) -> str:
    """Returns where the checkpoint is (its path or URL)."""
    state = as_state(root)
    name = f"ckpt-{step:08d}"
    with state.staging(name) as tmp:
        save_file(model_state, str(tmp / "model.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        meta = dict(meta, step=step, files={f: sha256_file(tmp / f) for f in FILES[:2]})
        write_json(tmp / "meta.json", meta)
        state.commit_from(tmp, name)
    prune(state, step, keep)
    return state.where(name)


def prune(root: StateDir | Path, step: int, keep: int) -> None:
    """After saving `step`: keep the newest `keep` checkpoints up to it. Newer ones belong to a run this
    one has replaced (train.steps lowered below them; corrupt ones it could not resume from), and the
    ones set aside under other params are no longer needed."""
    state = as_state(root)
    for old in checkpoints(state):
        if checkpoint_step(old) > step:
            log.warning("removing %s: beyond step %d, from which this run has saved", state.where(old), step)
            state.remove(old)
    for old in checkpoints(state)[:-keep]:
        state.remove(old)
    for stale in state.entries("stale-"):
        log.info("removing %s: checkpoints of other params, superseded by this run's", state.where(stale))
        state.remove(stale)


CHECKPOINT = re.compile(r"ckpt-(\d{8,18})")  # as save() names them


def checkpoint_step(name: str | Path) -> int:
    return int(str(name).rstrip("/").rsplit("/", 1)[-1].removeprefix("ckpt-"))


def checkpoints(state: StateDir, under: str = "") -> list[str]:
    """The checkpoint directories under `under`, by step: `ckpt-<digits>` only. Anything else there
    whose name starts with `ckpt-` is not a checkpoint this code wrote: it is named in a warning and
    never read, moved or deleted."""
    names, foreign = [], []
    for name in state.entries("ckpt-", under=under):
        (names if CHECKPOINT.fullmatch(name.rsplit("/", 1)[-1]) else foreign).append(name)
    for where in sorted({state.where(name) for name in foreign} - _FOREIGN):
        _FOREIGN.add(where)
        log.warning("%s: not a checkpoint (ckpt-<8 or more digits>): left alone", where)
    return sorted(names, key=checkpoint_step)


_FOREIGN: set[str] = set()  # named once per process


def list_checkpoints(root: Path) -> list[Path]:
    """The checkpoints of a local state directory, oldest first."""
    return [root / n for n in checkpoints(StateDir(root))]


def read_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """(model tensors, optimizer tensors, meta) of a local checkpoint directory, or CheckpointError
    saying what is wrong."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not found")
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


def read_stored(state: StateDir, name: str) -> tuple[dict, dict, dict]:
    """`read_checkpoint` of checkpoint `name` of `state`, its errors naming where it is."""
    if not state.exists(name):
        raise CheckpointError(f"{state.where(name)}: not found")
    with state.local_copy(name) as path:
        try:
            return read_checkpoint(path)
        except CheckpointError as e:
            if state.local:
                raise
            raise CheckpointError(str(e).replace(str(path), state.where(name))) from None


def read_meta(state: StateDir, name: str) -> dict | None:
    try:
        return json.loads(state.read_text(name, "meta.json"))
    except (OSError, json.JSONDecodeError):
        return None  # unreadable ones are reported when a resume tries them


def valid_checkpoints(root: StateDir | Path, fingerprint: str, max_step: int):
    """This run's checkpoints at or below `max_step` that read back intact, newest first, as
    (name, model tensors, optimizer tensors, meta); bad ones are reported and skipped."""
    state = as_state(root)
    for name in reversed(checkpoints(state)):
        if checkpoint_step(name) > max_step:
            continue
        try:
            model, opt, meta = read_stored(state, name)
        except CheckpointError as e:
            log.warning("refusing checkpoint: %s; trying an older one", e)
            continue
        if meta.get("fingerprint") == fingerprint:
            yield name, model, opt, meta


def steps_beyond(root: StateDir | Path, fingerprint: str, max_step: int) -> list[int]:
    """Steps of this run's checkpoints past `max_step` (train.steps was lowered below them)."""
    state = as_state(root)
    return [checkpoint_step(n) for n in checkpoints(state)
            if checkpoint_step(n) > max_step and (read_meta(state, n) or {}).get("fingerprint") == fingerprint]


def set_aside_stale(root: StateDir | Path, fingerprint: str) -> None:
    """DVC does not clean resume state. Checkpoints made under other params move to
    stale-<their fingerprint>/ (deleted by `prune` once this run has saved one); this run's own, set
    aside by a run under other params that saved nothing, come back."""
    state = as_state(root)
    for name in checkpoints(state):
        meta = read_meta(state, name)
        if meta is None or meta.get("fingerprint") == fingerprint:
            continue
        aside = f"stale-{meta.get('fingerprint')}"
        state.remove(f"{aside}/{name}")
        state.move(name, f"{aside}/{name}")
        log.warning("checkpoint %s was made under other params: moved to %s (deleted once this run saves "
                    "a checkpoint; switch the params back before that to resume it)", name, state.where(aside))
    mine = f"stale-{fingerprint}"
    for name in checkpoints(state, under=mine):
        own = name.rsplit("/", 1)[-1]
        if not state.exists(own):
            state.move(name, own)
            log.info("checkpoint %s of these params is back from %s", own, state.where(mine))
    state.remove(mine)


# ---- RNG states (meta.json holds each rank's) ------------------------------------------------------

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state(device: torch.device | None = None) -> dict:
    """Every global RNG state (torch CPU, Python, NumPy, this rank's CUDA device), JSON-able."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": _b64(torch.get_rng_state()), "python": [version, list(internal), gauss],
             "numpy": {"keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached)}}
    if device is not None and device.type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npy = state["numpy"]
    np.random.set_state(("MT19937", np.array(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    on_cuda = device is not None and device.type == "cuda"
    if on_cuda and "cuda" in state:
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)
    elif on_cuda or "cuda" in state:
        log.warning("checkpoint saved %s CUDA, resumed %s: the CUDA RNG state is not restored",
                    "with" if "cuda" in state else "without", "with" if on_cuda else "without")
