"""Assemble a training run: dataset, draft initialised from the target, trainer, callbacks."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from deepspec.config import ConfigError, TrainConfig, to_dict
from deepspec.io import fingerprint
from deepspec.loader.dataset import TargetCacheDataset
from deepspec.models.draft import DraftConfig, DraftModel
from deepspec.models.target import load_identity
from deepspec.train.callbacks import DvcLiveMetrics, JsonMetrics, ProgressBar
from deepspec.train.trainer import Trainer


log = logging.getLogger(__name__)

# the token name speculators and sglang give a mask token they add to a tokenizer that lacks one
DEFAULT_MASK_TOKEN = "<|MASK|>"


def resolve_mask_token(cfg: TrainConfig, tokenizer, vocab_size: int) -> tuple[int, str]:
    """(id, text) of the reserved token whose embedding row fills the mask slots; (-1, "") = learned.
    null resolves like speculators: the tokenizer's mask token, else the first embedding row past
    the tokenizer (Qwen3: 151669, an unused row), else an error asking for an explicit id."""
    mid = cfg.mask_token_id
    if mid is None:
        if tokenizer.mask_token_id is not None:
            mid = int(tokenizer.mask_token_id)
        elif len(tokenizer) < vocab_size:
            mid = len(tokenizer)
        else:
            raise ConfigError("train.mask_token_id: the target's tokenizer has no mask token and its embedding "
                              "has no unused row; set a reserved token id (or -1 for a learned mask vector, "
                              "which no serving engine loads)")
    if mid >= vocab_size:
        raise ConfigError(f"train.mask_token_id: {mid} is not a token of the target (vocab size {vocab_size})")
    if mid < 0:
        return -1, ""
    text = tokenizer.convert_ids_to_tokens(mid) if mid < len(tokenizer) else None
    return mid, text or DEFAULT_MASK_TOKEN


def sample_from_anchor(cfg: TrainConfig) -> bool:
    """null = the algorithm's convention (speculators' defaults): DSpark drafts from the anchor slot,
    DFlash uses the dflash layout."""
    return cfg.algorithm == "dspark" if cfg.sample_from_anchor is None else cfg.sample_from_anchor


def new_draft(cfg: TrainConfig, layers: list[int], target_dir: Path, vocab_counts=None) -> DraftModel:
    """A fresh draft initialised from the target. EAGLE-3 also needs the loss-token frequencies of the
    cache (`vocab_counts`, see eagle3.loss_token_counts) for its reduced vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    identity = load_identity(target_dir)
    target_cfg = AutoConfig.from_pretrained(target_dir)
    text_cfg = getattr(target_cfg, "text_config", target_cfg)
    eagle = cfg.algorithm == "eagle3"
    mask_id, mask_text = (-1, "") if eagle else \
        resolve_mask_token(cfg, AutoTokenizer.from_pretrained(target_dir), text_cfg.vocab_size)
    draft_cfg = DraftConfig.for_target(cfg.algorithm, text_cfg, layers, cfg.block_size, cfg.draft_layers,
                                       cfg.markov_rank, identity, mask_token_id=mask_id, mask_token=mask_text,
                                       sample_from_anchor=sample_from_anchor(cfg), ttt_steps=cfg.ttt_steps,
                                       draft_vocab_size=cfg.draft_vocab_size)
    torch.manual_seed(cfg.seed)
    if eagle:
        from deepspec.models.eagle3 import Eagle3Model, vocab_map

        try:
            model = Eagle3Model(draft_cfg)
        except ValueError as e:
            raise ConfigError(f"train: {e}") from None
        if vocab_counts is None:
            raise ValueError("an EAGLE-3 draft needs the cache's loss-token counts for its draft vocabulary")
        model.set_vocab(*vocab_map(vocab_counts, draft_cfg.draft_vocab_size, draft_cfg.vocab_size))
    else:
        model = DraftModel(draft_cfg)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.copy_target_embeddings(target)
    return model


# Train settings that decide how a run executes or how far it goes, not the trajectory it follows, so
# they may change between a checkpoint and its resume: `steps` only moves the schedule's horizon (the
# trainer logs the LR jump), `layers` counts through the resolved layer list. Every other field, present
# or added later, is in the fingerprint. The world size is checked on its own (a resume under another
# one is refused, see Trainer.restore).
RESUME_NEUTRAL = ("steps", "checkpoint_every", "keep_checkpoints", "num_workers", "read_ahead", "threads", "launcher",
                  "layers")


def resume_fingerprint(cfg: TrainConfig, layers: list[int], target_id: str, manifest: dict) -> str:
    """Checkpoints resume only into a run with the same fingerprint: same trajectory settings, draft
    input layers, target and cache content."""
    trajectory = {k: v for k, v in to_dict(cfg).items() if k not in RESUME_NEUTRAL}
    return fingerprint({"train": trajectory, "layers": layers, "target": target_id,
                        "cache": [manifest["parts"], manifest["dtype"]]})


def build_trainer(cfg: TrainConfig, layers: list[int], cache_url: str, target_dir: Path, out_dir: Path,
                  state_dir: Path, storage_options: dict | None = None, rank: int = 0, world: int = 1,
                  device: torch.device | None = None, manifest: dict | None = None) -> Trainer:
    """`manifest`: the cache stage's recorded manifest; the trainer reads exactly the parts it lists."""
    device = device or torch.device("cpu")
    identity = load_identity(target_dir)
    dataset = TargetCacheDataset(cache_url, layers=layers, storage_options=storage_options,
                                 expect={"target": identity}, read_ahead=cfg.read_ahead, manifest=manifest)
    counts = None
    if cfg.algorithm == "eagle3":
        from deepspec.models.eagle3 import loss_token_counts

        tokens = TargetCacheDataset(cache_url, layers=[], fields=("input_ids", "loss_mask"),
                                    storage_options=storage_options, manifest=manifest)
        counts = loss_token_counts(tokens)
    model = new_draft(cfg, layers, target_dir, counts).to(device)
    if counts is not None:
        log.info("eagle3: target layers %s, draft vocabulary of %d of the target's %d tokens (%d distinct loss "
                 "tokens in the cache)", layers, model.config.draft_vocab_size, model.config.vocab_size, len(counts))
    ddp = None
    if world > 1:
        # every buffer is constant (rotary tables, EAGLE-3's vocabulary maps and the target's head it keeps for
        # the loss): nothing to broadcast at each step
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=True,
            broadcast_buffers=False)
    fp = resume_fingerprint(cfg, layers, identity["id"], dataset.manifest)
    # dvclive starts a fresh curve unless the trainer resumes (then it keeps the steps up to the checkpoint)
    callbacks = [ProgressBar(), DvcLiveMetrics(out_dir / "live"), JsonMetrics(out_dir / "metrics.json")]
    return Trainer(model, dataset, cfg, state_dir, fp, callbacks, rank, world, device, ddp)


def run_training(cfg: TrainConfig, layers: list[int], cache_url: str, target_dir: Path, draft_dir: Path,
                 out_dir: Path, state_dir: Path, storage_options: dict | None = None, rank: int = 0,
                 world: int = 1, device: torch.device | None = None, manifest: dict | None = None) -> dict:
    trainer = build_trainer(cfg, layers, cache_url, target_dir, out_dir, state_dir, storage_options, rank, world,
                            device, manifest)
    final = trainer.fit()
    if rank == 0:
        if draft_dir.exists():
            shutil.rmtree(draft_dir)
        trainer.model.save(draft_dir)
    return final
