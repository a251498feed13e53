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
from deepspec.io import fingerprint
from deepspec.loader.dataset import TargetCacheDataset
from deepspec.models.draft import DraftConfig, DraftModel
from deepspec.models.registry import ALGORITHMS
from deepspec.models.target import embedding_weights, load_identity, target_embeddings
from deepspec.train.callbacks import DvcLiveMetrics, JsonMetrics, ProgressBar
from deepspec.train.state_dir import StateDir
from deepspec.train.trainer import Trainer


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
                  "state_url", "state_storage_options", "threads", "launcher", "layers", "collective_timeout_s")


def distinct_token_ids(dataset) -> np.ndarray:
    """The sorted distinct token ids of every sample of a TargetCacheDataset of input ids."""
    seen = np.zeros(0, dtype=bool)  # a bitmap over ids: one pass, O(tokens + vocabulary)
    for i in range(len(dataset)):
        ids = dataset[i]["input_ids"].numpy()
        if len(ids) and ids.max() >= len(seen):
            seen = np.concatenate([seen, np.zeros(int(ids.max()) + 1 - len(seen), dtype=bool)])
        seen[ids] = True
    return np.flatnonzero(seen)


def resume_fingerprint(cfg: TrainConfig, layers: list[int], target_id: str, manifest: dict) -> str:
    """Checkpoints resume only into a run with the same fingerprint: same trajectory settings, draft
    input layers, target and cache content."""
    trajectory = {k: v for k, v in to_dict(cfg).items() if k not in RESUME_NEUTRAL}
    return fingerprint({"train": trajectory, "layers": layers, "target": target_id,
                        "cache": [manifest["parts"], manifest["dtype"]]})


def build_trainer(cfg: TrainConfig, layers: list[int], cache_url: str, target_dir: Path, out_dir: Path,
                  state_dir: StateDir | Path, storage_options: dict | None = None, rank: int = 0, world: int = 1,
                  device: torch.device | None = None, manifest: dict | None = None) -> Trainer:
    """`manifest`: the cache stage's recorded manifest; the trainer reads exactly the parts it lists.
    `state_dir`: where resume state lives (a local path, or a StateDir of any fsspec URL)."""
    device = device or torch.device("cpu")
    identity = load_identity(target_dir)
    dataset = TargetCacheDataset(cache_url, layers=layers, storage_options=storage_options, cache_dir=cfg.mirror or None,
                                 expect={"target": identity}, read_ahead=cfg.read_ahead, manifest=manifest)
    dataset.reader.mirror_bytes = int(cfg.mirror_gb * 2**30)
    counts = None
    if cfg.algorithm == "eagle3":
        from deepspec.models.eagle3 import loss_token_counts

        if rank == 0:  # one pass over the corpus's tokens, on one rank; the others get its result
            tokens = TargetCacheDataset(cache_url, layers=[], fields=("input_ids", "loss_mask"),
                                        storage_options=storage_options, manifest=manifest)
            counts = loss_token_counts(tokens)
        if world > 1:
            counts = distributed.share(counts, device)
    def cache_ids() -> np.ndarray:  # only read when no cheaper rule finds a mask token
        tokens = TargetCacheDataset(cache_url, layers=[], fields=("input_ids",),
                                    storage_options=storage_options, manifest=manifest)
        return distinct_token_ids(tokens)

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
            broadcast_buffers=False)
    fp = resume_fingerprint(cfg, layers, identity["id"], dataset.manifest)
    # dvclive starts a fresh curve unless the trainer resumes (then it keeps the steps up to the checkpoint)
    callbacks = [ProgressBar(), DvcLiveMetrics(out_dir / "live"), JsonMetrics(out_dir / "metrics.json")]
    return Trainer(model, dataset, cfg, state_dir, fp, callbacks, rank, world, device, ddp)


def run_training(cfg: TrainConfig, layers: list[int], cache_url: str, target_dir: Path, draft_dir: Path,
                 out_dir: Path, state_dir: StateDir | Path, storage_options: dict | None = None, rank: int = 0,
                 world: int = 1, device: torch.device | None = None, manifest: dict | None = None) -> dict:
    trainer = build_trainer(cfg, layers, cache_url, target_dir, out_dir, state_dir, storage_options, rank, world,
                            device, manifest)
    final = trainer.fit()
    if rank == 0:
        if draft_dir.exists():
            shutil.rmtree(draft_dir)
        trainer.model.save(draft_dir)
    return final
