"""Assemble a training run: dataset, draft initialised from the target, trainer, callbacks."""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from deepspec import distributed
from deepspec.config import ConfigError, TrainConfig, to_dict
from deepspec.cache.build.fill import StoreFill
from deepspec.cache.build.fill_ranks import RanksFill
from deepspec.io import fingerprint, write_json
from deepspec.loader.dataset import TargetCacheDataset
from deepspec.models.draft import DraftConfig, DraftModel
from deepspec.models.registry import ALGORITHMS
from deepspec.models.target import embedding_weights, load_identity, target_embeddings
from deepspec.train.callbacks import Callback, DvcLiveMetrics, JsonMetrics, ProgressBar
from deepspec.train.compiled import compiles
from deepspec.train.state_dir import StateDir
from deepspec.train.trainer import Trainer, window_of


log = logging.getLogger(__name__)

# the token name speculators and sglang give a mask token they add to a tokenizer that lacks one
DEFAULT_MASK_TOKEN = "<|MASK|>"


# special tokens a tokenizer reserves for later use, by the names Llama 3 and Gemma give them
RESERVED_NAME = re.compile(r"reserved|unused", re.IGNORECASE)


def resolve_mask_token(cfg: TrainConfig, tokenizer, vocab_size: int,
                       cache_ids: Callable[[], np.ndarray] | None = None) -> tuple[int, str]:
    """(id, text) of the reserved token whose embedding row fills the mask slots; (-1, "") = learned.
    null picks, in this order: the tokenizer's mask token; the first embedding row past the tokenizer
    (Qwen3: 151669, a row no text encodes to); a special token the tokenizer reserves (`reserved`,
    `unused` in its name); a special token that is none of bos/eos/pad/unk and never occurs in the
    cache's token ids (`cache_ids()`: the distinct ids of every cached sample). The choice and the
    reason are logged; an explicit `train.mask_token_id` overrides."""
    mid, why = cfg.mask_token_id, "train.mask_token_id"
    if mid is None:
        mid, why = pick_mask_token(tokenizer, vocab_size, cache_ids)
    if mid >= vocab_size:
        raise ConfigError(f"train.mask_token_id: {mid} is not a token of the target (vocab size {vocab_size})")
    if mid < 0:
        return -1, ""
    text = tokenizer.convert_ids_to_tokens(mid) if mid < len(tokenizer) else None
    text = text or DEFAULT_MASK_TOKEN
    log.info("train: mask token %s (id %d): %s", text, mid, why)
    return mid, text


def pick_mask_token(tokenizer, vocab_size: int, cache_ids: Callable[[], np.ndarray] | None) -> tuple[int, str]:
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id), "the tokenizer's mask token"
    if len(tokenizer) < vocab_size:
        return len(tokenizer), "the first embedding row past the tokenizer (no text encodes to it)"
    special = sorted((i, t.content) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                     if getattr(t, "special", False) and i < vocab_size)
    roles = {getattr(tokenizer, f"{r}_token_id", None) for r in ("bos", "eos", "pad", "unk")}
    candidates = [(i, text) for i, text in special if i not in roles]
    if candidates and cache_ids is not None:
        seen = set(np.asarray(cache_ids()).tolist())
        unseen = [(i, text) for i, text in candidates if i not in seen]
        reserved = [(i, text) for i, text in unseen if RESERVED_NAME.search(text)]
        if reserved:
            return reserved[0][0], f"a special token the tokenizer reserves ({reserved[0][1]}), not in the cache"
        if unseen:
            return unseen[0][0], (f"a special token ({unseen[0][1]}) that occurs nowhere in the cache's "
                                  f"{len(seen)} distinct token ids")
    raise ConfigError("train.mask_token_id: the target's tokenizer has no mask token, its embedding has no "
                      "unused row, and every special token occurs in the cache; set a reserved token id (or -1 "
                      "for a learned mask vector, which no serving engine loads)")


def sample_from_anchor(cfg: TrainConfig) -> bool:
    """null = the algorithm's convention (speculators' defaults): DSpark drafts from the anchor slot,
    DFlash uses the dflash layout."""
    return cfg.algorithm == "dspark" if cfg.sample_from_anchor is None else cfg.sample_from_anchor


def new_draft(cfg: TrainConfig, layers: list[int], target_dir: Path, vocab_counts=None,
              cache_ids: Callable[[], np.ndarray] | None = None) -> DraftModel:
    """A fresh draft initialised from the target. EAGLE-3 also needs the loss-token frequencies of the
    cache (`vocab_counts`, see eagle3.loss_token_counts) for its reduced vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    identity = load_identity(target_dir)
    eagle = cfg.algorithm == "eagle3"
    # the two matrices the draft takes, read by name from the checkpoint, never the whole target;
    # EAGLE-3 keeps the target's whole head for its loss, so it takes them as tensors
    where = target_embeddings(target_dir)
    embed = head = None
    if where is None or eagle:
        embed, head, embed_scale = embedding_weights(target_dir, where)
    else:
        embed_scale = where.scale
    target_cfg = AutoConfig.from_pretrained(target_dir)
    text_cfg = getattr(target_cfg, "text_config", target_cfg)
    mask_id, mask_text = (-1, "") if eagle else \
        resolve_mask_token(cfg, AutoTokenizer.from_pretrained(target_dir), text_cfg.vocab_size, cache_ids)
    draft_cfg = DraftConfig.for_target(cfg.algorithm, text_cfg, layers, cfg.block_size, cfg.draft_layers,
                                       cfg.markov_rank, identity, mask_token_id=mask_id, mask_token=mask_text,
                                       sample_from_anchor=sample_from_anchor(cfg), ttt_steps=cfg.ttt_steps,
                                       draft_vocab_size=cfg.draft_vocab_size, embed_scale=embed_scale)
    torch.manual_seed(cfg.seed)
    try:
        model = ALGORITHMS[cfg.algorithm](draft_cfg)
    except ValueError as e:
        raise ConfigError(f"train: {e}") from None
    if eagle:
        from deepspec.models.eagle3 import vocab_map

        if vocab_counts is None:
            raise ValueError("an EAGLE-3 draft needs the cache's loss-token counts for its draft vocabulary")
        model.set_vocab(*vocab_map(vocab_counts, draft_cfg.draft_vocab_size, draft_cfg.vocab_size))
    if embed is None:  # copied slice by slice into the draft's own frozen rows
        where.read_into(model.embed_tokens.weight, model.lm_head.weight)
        model.freeze_embeddings()
    else:
        model.set_target_embeddings(embed, head)
    return model


# Train settings that decide how a run executes or how far it goes, not the trajectory it follows, so
# they may change between a checkpoint and its resume: `steps` only moves the schedule's horizon (the
# trainer logs the LR jump), `layers` counts through the resolved layer list. Every other field, present
# or added later, is in the fingerprint. The world size is checked on its own (a resume under another
# one is refused, see Trainer.restore).
RESUME_NEUTRAL = ("steps", "checkpoint_every", "keep_checkpoints", "num_workers", "read_ahead", "mirror", "mirror_gb",
                  "state_url", "state_storage_options", "threads", "launcher", "layers", "collective_timeout_s",
                  "capture", "capture_ranks", "compile")


# Trajectory settings added after runs with checkpoints existed: at their default (what those runs
# used) they are left out of the fingerprint, so such a checkpoint still resumes; any other value counts.
ADDED_LATER = ("adam_betas", "adam_eps")


def distinct_token_ids(dataset) -> np.ndarray:
    """The sorted distinct token ids of every sample of a TargetCacheDataset of input ids (or of any
    iterable of such samples)."""
    from deepspec.models.eagle3 import samples_of

    seen = np.zeros(0, dtype=bool)  # a bitmap over ids: one pass, O(tokens + vocabulary)
    for item in samples_of(dataset):
        ids = item["input_ids"].numpy()
        if len(ids) and ids.max() >= len(seen):
            seen = np.concatenate([seen, np.zeros(int(ids.max()) + 1 - len(seen), dtype=bool)])
        seen[ids] = True
    return np.flatnonzero(seen)


def resume_fingerprint(cfg: TrainConfig, layers: list[int], target_id: str, manifest: dict,
                       compiled: bool = False) -> str:
    """Checkpoints resume only into a run with the same fingerprint: same trajectory settings, draft
    input layers, target and cache content. `compiled`: train.compile as resolved for the device; a
    compiled step rounds differently from an eager one, so it counts (and only when on, so that an eager
    run's fingerprint is what it was before the setting existed)."""
    defaults = to_dict(TrainConfig())
    trajectory = {k: v for k, v in to_dict(cfg).items()
                  if k not in RESUME_NEUTRAL and not (k in ADDED_LATER and v == defaults[k])}
    if "window_parts" in trajectory:  # as resolved: `auto` offline is the 0 it was before `auto` existed
        trajectory["window_parts"] = window_of(cfg)
    if compiled:
        trajectory["compiled"] = True
    # a part as the plan names it (a read-through run's planned manifest has no HDF5 chunk-table position)
    parts = [[p["name"], p["samples"], p["tokens"]] for p in manifest["parts"]]
    return fingerprint({"train": trajectory, "layers": layers, "target": target_id,
                        "cache": [parts, manifest["dtype"]]})


def build_trainer(cfg: TrainConfig, layers: list[int], cache_url: str, target_dir: Path, out_dir: Path,
                  state_dir: StateDir | Path, storage_options: dict | None = None, rank: int = 0, world: int = 1,
                  device: torch.device | None = None, manifest: dict | None = None,
                  fill: StoreFill | RanksFill | None = None, group=None) -> Trainer:
    """`manifest`: the cache stage's recorded manifest; the trainer reads exactly the parts it lists.
    `state_dir`: where resume state lives (a local path, or a StateDir of any fsspec URL). `fill`: a
    read-through run's store fill (cache/build/fill.py, or fill_ranks.py with capture ranks): the store
    is read as it plans it, each batch once its parts are committed, and `cache_url`/`manifest` are not
    used. `group`: the trainers' process group of `world` ranks (None: the default group)."""
    device = device or torch.device("cpu")
    identity = load_identity(target_dir)
    where: dict = {"manifest": manifest}
    if fill is not None:
        planned = fill.plan()
        cache_url, where = planned.url, {"planned": (planned.manifest, planned.rows)}
    dataset = TargetCacheDataset(cache_url, layers=layers, storage_options=storage_options, cache_dir=cfg.mirror or None,
                                 expect={"target": identity}, read_ahead=cfg.read_ahead, **where)
    dataset.reader.mirror_bytes = int(cfg.mirror_gb * 2**30)

    def corpus(fields: tuple[str, ...]):
        """Every cached sample's tokens; while a read-through fill runs, the same tokens encoded again
        from its plan (fill.samples), so the first step does not wait for the whole store."""
        if fill is not None:
            return fill.samples()
        return TargetCacheDataset(cache_url, layers=[], fields=fields, storage_options=storage_options, **where)

    counts = None
    if cfg.algorithm == "eagle3":
        from deepspec.models.eagle3 import loss_token_counts

        if rank == 0:  # one pass over the corpus's tokens, on one rank; the others get its result
            counts = loss_token_counts(corpus(("input_ids", "loss_mask")))
        if world > 1:
            counts = distributed.share(counts, device, group)

    def cache_ids() -> np.ndarray:  # only read when no cheaper rule finds a mask token
        return distinct_token_ids(corpus(("input_ids",)))

    model = new_draft(cfg, layers, target_dir, counts, cache_ids).to(device)
    if counts is not None:
        log.info("eagle3: target layers %s, draft vocabulary of %d of the target's %d tokens (%d distinct loss "
                 "tokens in the cache)", layers, model.config.draft_vocab_size, model.config.vocab_size, len(counts))
    ddp = None
    if world > 1:
        # every buffer is constant (rotary tables, EAGLE-3's vocabulary maps and the target's head it keeps for
        # the loss): nothing to broadcast at each step. Every trainable parameter of every algorithm takes
        # part in each step's loss (tests/train/test_train.py checks it), so DDP need not search the graph
        # for unused ones after each backward
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=False,
            broadcast_buffers=False, process_group=group)
    fp = resume_fingerprint(cfg, layers, identity["id"], dataset.manifest, compiles(cfg.compile, device))
    # dvclive starts a fresh curve unless the trainer resumes (then it keeps the steps up to the checkpoint)
    callbacks = [ProgressBar(), DvcLiveMetrics(out_dir / "live"), JsonMetrics(out_dir / "metrics.json")]
    trainer = Trainer(model, dataset, cfg, state_dir, fp, callbacks, rank, world, device, ddp, group)
    if fill is not None:
        read_through(trainer, fill)
    return trainer


class FirstStepParts(Callback):
    """How many parts the batches drawn before the end of the first optimizer step needed committed
    (a read-through run's wait before it trains; the loader draws a few batches ahead)."""

    def __init__(self):
        self.needed: set[int] = set()
        self.count: int | None = None

    def on_step_end(self, trainer, metrics) -> None:
        if self.count is None:
            self.count = len(self.needed)


def read_through(trainer: Trainer, fill: StoreFill | RanksFill) -> None:
    """Have `fill` write the parts the store lacks in the order the first epoch first reads them
    (sampler.part_order: with the default growing windows, two parts before the first step), and the
    trainer's sampler hand out a batch only once its parts are committed. The order is the sampler's,
    a function of the plan and the seed, so the draft is the one an offline run with the same
    settings (the same train.window_parts) trains on the finished store, whatever the timing."""
    names = fill.plan().names
    part_of = trainer.sampler.parts  # the trainer gives a read-through run's sampler every sample's part
    fill.compute([names[p] for p in trainer.sampler.part_order(0)])
    first = FirstStepParts()
    trainer.callbacks.append(first)

    def gate(batch):
        parts = {int(p) for p in part_of[batch]}
        if first.count is None:
            first.needed |= parts
        fill.wait({names[p] for p in parts})
    trainer.sampler.gate = gate
    trainer.loader_context = lambda: None if fill.idle() else "forkserver"


def capture_counts(cfg: TrainConfig, trainer: Trainer, fill: StoreFill | RanksFill | None) -> dict:
    """The train stage's metrics of what it captured beside what it read (without a fill the run
    reads every part of the store and captures nothing)."""
    if fill is not None:
        first = next((cb.count for cb in trainer.callbacks if isinstance(cb, FirstStepParts)), None)
        return {"capture": cfg.capture, **fill.counts(), "parts_before_first_step": first}
    return {"capture": cfg.capture, "target_forwards": 0, "parts_computed": 0, "parts_derived": 0,
            "parts_kept": len(trainer.dataset.manifest["parts"]), "tokens_computed": 0, "wait_for_parts_s": 0.0,
            "parts_before_first_step": 0}


def run_training(cfg: TrainConfig, layers: list[int], cache_url: str, target_dir: Path, draft_dir: Path,
                 out_dir: Path, state_dir: StateDir | Path, storage_options: dict | None = None, rank: int = 0,
                 world: int = 1, device: torch.device | None = None, manifest: dict | None = None,
                 fill: StoreFill | RanksFill | None = None, group=None) -> dict:
    """`fill` (train.capture: read-through) and `group`: see build_trainer; the store is finished (every
    planned part, the root switched to the plan) after the last step, before the draft is saved."""
    try:
        trainer = build_trainer(cfg, layers, cache_url, target_dir, out_dir, state_dir, storage_options, rank, world,
                                device, manifest, fill, group)
        final = trainer.fit()
        if fill is not None:
            fill.finish()
    except BaseException:
        if fill is not None:
            fill.abort()
        raise
    final = dict(final, **capture_counts(cfg, trainer, fill))
    if rank == 0:
        write_json(out_dir / "metrics.json", final)
        if draft_dir.exists():
            shutil.rmtree(draft_dir)
        trainer.model.save(draft_dir)
    return final
