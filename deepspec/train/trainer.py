"""The draft trainer: a plain loop with callbacks, exact mid-epoch resume, optional DDP.

One optimizer step = `grad_accum` micro-batches on every rank. The loss of a step is normalised by
the slot weights of the whole global batch (all micro-batches, all ranks), so N processes with
batch b train like one process with batch N*b. Anchors come from a generator seeded by
(seed, step, micro-batch, rank): a resumed run draws exactly what the uninterrupted one drew.
Resume restores weights, AdamW state, the step (the LR schedule is a function of it), the
sampler's epoch/position and the RNG states, from the newest checkpoint that reads back intact.
"""
from __future__ import annotations

import logging
import random
from contextlib import nullcontext
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from deepspec.config import TrainConfig
from deepspec.loader.collate import collate
from deepspec.loader.prefetch import Prefetcher
from deepspec.loader.sampler import ResumableBatchSampler
from deepspec.train.checkpoint import (latest_valid, load_optimizer_tensors, optimizer_tensors, prune_stale,
                                       save_checkpoint)
from deepspec.train.loss import sample_anchors, slot_weights
from deepspec.train.schedule import lr_factor

log = logging.getLogger(__name__)
LOSS_TERMS = ("loss", "ce", "l1", "conf")


@dataclass
class TrainState:
    step: int = 0        # optimizer steps done
    epoch: int = 0
    position: int = 0    # batches of `epoch` this rank has consumed
    tokens: int = 0      # tokens seen by this rank


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state().tolist(), "python": list(random.getstate()[1]),
            "numpy_seed_pos": int(np.random.get_state()[2])}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    py = random.getstate()
    random.setstate((py[0], tuple(state["python"]), py[2]))


class Trainer:
    def __init__(self, model, dataset, cfg: TrainConfig, state_dir: Path, fingerprint: str,
                 callbacks=(), rank: int = 0, world_size: int = 1, device: torch.device | None = None,
                 ddp_model=None):
        self.model = model                      # the DraftModel (saved, checkpointed)
        self.module = ddp_model or model        # what forward/backward run through (DDP wrapper or model)
        self.dataset = dataset
        self.cfg = cfg
        self.state_dir = Path(state_dir)
        self.fingerprint = fingerprint
        self.callbacks = list(callbacks)
        self.rank, self.world_size = rank, world_size
        self.device = device or torch.device("cpu")
        self.state = TrainState()
        self.last_metrics: dict = {}      # of the latest step (restored on resume, so a finished run
        self.final_metrics: dict = {}     # that is resumed reports the same final numbers)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.sampler = ResumableBatchSampler(dataset.lengths(), batch_size=cfg.batch_size, seed=cfg.seed,
                                             rank=rank, world_size=world_size)
        self.autocast = self.device.type == "cuda"

    # ---- resume --------------------------------------------------------------------------------
    def restore(self) -> bool:
        if self.rank == 0:
            prune_stale(self.state_dir, self.fingerprint)
        if self.world_size > 1:
            torch.distributed.barrier()
        found = latest_valid(self.state_dir, self.fingerprint)
        if found is None:
            return False
        path, model_state, opt_state, meta = found
        if meta["world_size"] != self.world_size:
            raise ValueError(f"{path}: saved with world_size {meta['world_size']}, this run has {self.world_size}")
        self.model.load_state_dict(model_state, strict=False)
        load_optimizer_tensors(self.optimizer, self.param_names, opt_state, meta["optimizer"])
        self.sampler.load_state_dict(meta["sampler"][str(self.rank)])
        rank_state = meta["ranks"][str(self.rank)]
        self.state = TrainState(step=meta["step"], epoch=rank_state["epoch"], position=rank_state["position"],
                                tokens=rank_state["tokens"])
        _set_rng_state(meta["rng"])
        self.last_metrics = meta.get("metrics", {})
        log.info("resumed from %s (step %d, epoch %d, batch %d)", path, self.state.step, self.state.epoch,
                 self.state.position)
        return True

    def save(self) -> Path | None:
        ranks = self._gather({"epoch": self.state.epoch, "position": self.state.position,
                              "tokens": self.state.tokens,
                              "sampler": self.sampler.state_dict(self.state.epoch, self.state.position)})
        if self.rank != 0:
            return None
        opt_tensors, opt_meta = optimizer_tensors(self.optimizer, self.param_names)
        meta = {"fingerprint": self.fingerprint, "world_size": self.world_size, "epoch": self.state.epoch,
                "ranks": {str(r): {k: v for k, v in s.items() if k != "sampler"} for r, s in enumerate(ranks)},
                "sampler": {str(r): s["sampler"] for r, s in enumerate(ranks)},
                "scheduler": {"name": self.cfg.schedule, "step": self.state.step},
                "optimizer": opt_meta, "rng": _rng_state(), "metrics": self.last_metrics}
        state = {k: v for k, v in self.model.state_dict().items() if not k.startswith("rotary.")}
        path = save_checkpoint(self.state_dir, self.state.step, state, opt_tensors, meta, self.cfg.keep_checkpoints)
        for cb in self.callbacks:
            cb.on_checkpoint(self, path)
        return path

    def _gather(self, obj):
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    # ---- the loop ------------------------------------------------------------------------------
    def _batches(self):
        """Batches from the current (epoch, position) on, across epochs, forever."""
        while True:
            self.sampler.set_epoch(self.state.epoch)
            self.sampler.position = self.state.position
            loader = DataLoader(self.dataset, batch_sampler=self.sampler, collate_fn=collate,
                                num_workers=self.cfg.num_workers, pin_memory=self.device.type == "cuda",
                                persistent_workers=False)
            for batch in Prefetcher(loader, self.device):
                self.state.position += 1
                yield batch
            self.state.epoch += 1
            self.state.position = 0

    def _global_weight(self, anchors_and_batches) -> float:
        local = sum(float(slot_weights(b, a, self.model.config.num_drafts, self.cfg.decay_gamma).sum())
                    for b, a in anchors_and_batches)
        if self.world_size > 1:
            t = torch.tensor([local], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(t)
            local = float(t.item())
        return local

    def fit(self) -> dict:
        cfg = self.cfg
        self.restore()
        for cb in self.callbacks:
            cb.on_train_begin(self)
        batches = self._batches()
        self.module.train()
        t0 = time.time()
        while self.state.step < cfg.steps:
            step = self.state.step
            lr = cfg.lr * lr_factor(step, cfg)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            micro = []
            for m in range(cfg.grad_accum):
                batch = next(batches)
                gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1_009 + m * 101 + self.rank)
                anchors = sample_anchors(batch["loss_mask"], batch["lengths"].to(batch["loss_mask"].device),
                                         cfg.anchors_per_sample, gen)
                micro.append((batch, anchors))
            total = self._global_weight(micro)
            norm = max(total, 1e-6) / self.world_size  # DDP averages gradients over ranks
            agg: dict = {}
            for m, (batch, anchors) in enumerate(micro):
                sync = m == len(micro) - 1 or self.world_size == 1
                ctx = self.module.no_sync() if not sync and hasattr(self.module, "no_sync") else nullcontext()
                with ctx, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    out = self.module(batch, anchors, cfg.ce_weight, cfg.l1_weight, cfg.conf_weight,
                                      cfg.decay_gamma, norm=norm)
                    out.loss.backward()
                for k, v in out.metrics.items():  # loss terms add up over micro-batches, rates average
                    agg[k] = agg.get(k, 0.0) + (v if k in LOSS_TERMS else v / len(micro))
                self.state.tokens += int(batch["lengths"].sum())
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)) if cfg.grad_clip > 0 \
                else 0.0
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.state.step += 1
            if self.world_size > 1:
                agg = self._mean_over_ranks(agg)
            metrics = dict(agg, lr=lr, grad_norm=grad_norm, step=self.state.step)
            self.last_metrics = metrics
            for cb in self.callbacks:
                cb.on_step_end(self, metrics)
            if self.state.step % cfg.checkpoint_every == 0 or self.state.step == cfg.steps:
                self.save()
        last = self.last_metrics
        self.final_metrics = {"final_loss": round(last.get("loss", float("nan")), 5),
                              "final_tau_greedy": round(last.get("tau_greedy", float("nan")), 4),
                              "steps": self.state.step, "tokens": self.state.tokens * self.world_size,
                              "wall_s": round(time.time() - t0, 1)}
        for cb in self.callbacks:
            cb.on_train_end(self)
        return self.final_metrics

    REDUCED = ("loss", "ce", "l1", "conf", "tau_greedy", "tau_prob")

    def _mean_over_ranks(self, metrics: dict) -> dict:
        """Rank-mean of the logged metrics. Each rank's loss terms are normalised by the global weight
        divided by the world size, so their mean over ranks is exactly the global batch's value."""
        keys = [k for k in self.REDUCED if k in metrics]
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        out = dict(metrics)
        for k, v in zip(keys, t.tolist()):
            out[k] = v / self.world_size
        return out
