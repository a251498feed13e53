"""The draft trainer: a plain loop with callbacks, exact mid-epoch resume, optional DDP.

One optimizer step = `grad_accum` micro-batches on every rank. The loss of a step is normalised by
the slot weights of the whole global batch (all micro-batches, all ranks), so N processes with
batch b train like one process with batch N*b. Anchors come from a Philox stream keyed by
(seed, step, micro-batch, rank), distinct for every tuple by construction (loss.anchor_key): a
resumed run draws exactly what the uninterrupted one drew. Resume restores weights, AdamW state
(strictly: every tensor, every parameter), the step (the LR schedule is a function of it), each
rank's sampler epoch/position and RNG states (torch, Python, NumPy, CUDA), from the newest
checkpoint that every rank reads back intact: rank 0 chooses, all ranks load the same step or all
stop.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import DataLoader

from deepspec import distributed
from deepspec.config import TrainConfig
from deepspec.devices import loader_workers
from deepspec.loader.batches import Batches
from deepspec.loader.prefetch import Prefetcher
from deepspec.loader.sampler import GROWING, ResumableBatchSampler
from deepspec.train.checkpoint import (CheckpointError, check_model_state, check_optimizer_state, checkpoint_step,
                                       load_optimizer_tensors, optimizer_tensors, read_stored, rng_state,
                                       save_checkpoint, set_aside_stale, set_rng_state, steps_beyond,
                                       valid_checkpoints)
from deepspec.models.attention import kv_multiple
from deepspec.models.objectives import anchor_generator, anchor_key, sample_anchors
from deepspec.train.compiled import compile_draft, compiles
from deepspec.train.state_dir import StateDir, as_state
from deepspec.train.schedule import lr_factor

log = logging.getLogger(__name__)
LOSS_TERMS = ("loss", "ce", "l1", "conf")


def adamw_kernels(device: torch.device) -> dict:
    """AdamW's implementation: a few kernels for all parameters at once instead of a few per parameter.
    Fused on CUDA (one kernel per group of tensors; its own rounding, so its bits differ from the
    foreach path's); foreach elsewhere (on the CPU bit for bit the per-parameter loop, which also read
    each parameter's step count back to the host)."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def window_of(cfg: TrainConfig) -> int | str:
    """train.window_parts resolved: `auto` = growing windows for a read-through run (its first step
    needs two parts, not the whole store; sampler.GROWING), none offline (each epoch a permutation of
    all samples)."""
    if cfg.window_parts != "auto":
        return cfg.window_parts
    return GROWING if cfg.capture == "read-through" else 0


class TrainError(ValueError):
    """A run that cannot start as configured (no batch for some rank, settings past a stated bound)."""


@dataclass
class TrainState:
    step: int = 0        # optimizer steps done
    epoch: int = 0
    position: int = 0    # batches of `epoch` this rank has consumed
    tokens: int = 0      # tokens seen by this rank


class Trainer:
    def __init__(self, model, dataset, cfg: TrainConfig, state_dir: StateDir | Path, fingerprint: str,
                 callbacks=(), rank: int = 0, world_size: int = 1, device: torch.device | None = None,
                 ddp_model=None, group=None):
        self.model = model                      # the DraftModel (saved, checkpointed)
        self.module = ddp_model or model        # what forward/backward run through (DDP wrapper or model)
        self.dataset = dataset
        self.cfg = cfg
        self.state_dir = as_state(state_dir)  # a local directory or an fsspec URL
        self.fingerprint = fingerprint
        self.callbacks = list(callbacks)
        self.rank, self.world_size = rank, world_size
        self.group = group  # the trainers' process group (None: every rank of the launch trains)
        self.device = device or torch.device("cpu")
        self.state = TrainState()
        self.data_wait_s = 0.0     # time this rank spent waiting for its next batch (of `fit`)
        # how an epoch's loading processes start (None: the platform's default, fork on Linux); while
        # other threads of this process are at work (a read-through fill computing parts) they start
        # clean instead, since a fork copies whatever lock another thread holds at that moment
        self.loader_context: Callable[[], str | None] = lambda: None
        self.last_metrics: dict = {}      # of the latest step (restored on resume, so a finished run
        self.final_metrics: dict = {}     # that is resumed reports the same final numbers)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay, **adamw_kernels(self.device))
        window = window_of(cfg)
        self.sampler = ResumableBatchSampler(dataset.lengths(), batch_size=cfg.batch_size, seed=cfg.seed,
                                             rank=rank, world_size=world_size, window_parts=window,
                                             parts=dataset.sample_parts() if window or cfg.capture == "read-through"
                                             else None)
        self._check_batches()
        try:
            anchor_key(cfg.seed, cfg.steps - 1, cfg.grad_accum - 1, world_size - 1)
        except ValueError as e:
            raise TrainError(f"train.seed={cfg.seed}, train.steps={cfg.steps}, train.grad_accum={cfg.grad_accum}, "
                             f"world size {world_size}: {e}") from None
        self.autocast = self.device.type == "cuda"
        self.num_workers = loader_workers(cfg.num_workers, self.device)
        self.compiled = compiles(cfg.compile, self.device)
        if self.compiled:  # in place: a DDP wrapper calls the compiled forward too
            compile_draft(model)

    def _check_batches(self) -> None:
        """Every rank needs a batch in every epoch, or the batch loop below never yields."""
        if len(self.sampler) > 0:
            return
        n, bs, world = len(self.sampler.lengths), self.cfg.batch_size, self.world_size
        where = getattr(self.dataset, "url", "the dataset")
        if n == 0:
            raise TrainError(f"{where}: the cache holds 0 samples: nothing to train on (did the cache stage "
                             "get any rows?)")
        batches = -(-n // bs)  # before the cut to a multiple of the world size
        raise TrainError(f"{where}: {n} samples in the cache make {batches} batch{'es' if batches > 1 else ''} "
                         f"of batch_size {bs}, fewer than the world size {world}, so no rank gets a batch: lower "
                         f"train.batch_size to at most {max(1, n // world)} or run fewer processes")

    # ---- resume --------------------------------------------------------------------------------
    def restore(self) -> bool:
        """Resume from the newest checkpoint of these params at or below `cfg.steps` that every rank
        reads back intact (with `steps` raised, the schedule's horizon moves to the new value from the
        resume step on). Rank 0 proposes, every rank checks the same step, all load it or none does."""
        if self.rank == 0:
            set_aside_stale(self.state_dir, self.fingerprint)
        chosen = self._agree_on_checkpoint()
        if chosen is None:
            return False
        name, model_state, opt_state, meta = chosen
        self.model.load_state_dict(model_state, strict=True)
        load_optimizer_tensors(self.optimizer, self.param_names, opt_state, meta["optimizer"])
        self.sampler.load_state_dict(meta["sampler"][str(self.rank)])
        rank_state = meta["ranks"][str(self.rank)]
        self.state = TrainState(step=meta["step"], epoch=rank_state["epoch"], position=rank_state["position"],
                                tokens=rank_state["tokens"])
        set_rng_state(rank_state["rng"], self.device)
        self.last_metrics = meta.get("metrics", {})
        self._log_horizon_change(meta["scheduler"]["steps"])
        log.info("resumed from %s (step %d, epoch %d, batch %d)", self.state_dir.where(name), self.state.step,
                 self.state.epoch, self.state.position)
        return True

    def _agree_on_checkpoint(self):
        """Rank 0 offers its newest intact checkpoint; every rank reads that step from its own view of
        the state directory and checks it (the same files as rank 0's, strict model and optimizer
        state). If any rank cannot use it, rank 0 offers the next older one. Returns what this rank
        read, or None when rank 0 has nothing to offer (a fresh start on every rank); raises the same
        CheckpointError on every rank when no offer suits all of them."""
        offers = valid_checkpoints(self.state_dir, self.fingerprint, self.cfg.steps) if self.rank == 0 else None
        refused: list[str] = []
        while True:
            mine, offer, error = self._next_offer(offers, refused) if self.rank == 0 else (None, None, None)
            offer, error = self._broadcast((offer, error))
            if error:
                raise CheckpointError(error)
            if offer is None:
                return None
            name = f"ckpt-{offer['step']:08d}"
            mine, problem = self._take_offer(name, offer, mine)
            problems = [p for p in self._gather(problem) if p]
            if not problems:
                if self.rank == 0:
                    self._warn_beyond(name)
                return mine
            if self.rank == 0:
                refused.append(f"step {offer['step']}: {', '.join(problems)}")
                log.warning("checkpoint at step %d refused (%s); trying an older one", offer["step"],
                            ", ".join(problems))

    def _next_offer(self, offers, refused: list[str]):
        """Rank 0: (its checkpoint, the offer, None), or (None, None, the error every rank raises, or
        None for a fresh start)."""
        mine = next(offers, None)
        if mine is not None:
            return mine, {"step": checkpoint_step(mine[0]), "files": mine[3]["files"]}, \
                self._refuse_world_size(mine[0], mine[3])
        if refused and self.world_size > 1:
            return None, None, (f"no checkpoint in {self.state_dir} can be resumed by every rank: "
                                f"{'; '.join(refused)}. Every rank must see the same {self.state_dir} (on several "
                                "nodes: a shared filesystem, or an s3:// train.state_url), or move it aside to train "
                                "from scratch")
        if refused:
            return None, None, (f"no checkpoint in {self.state_dir} can be resumed: {'; '.join(refused)}. Move "
                                f"{self.state_dir} aside to train from scratch")
        return None, None, self._refuse_beyond()

    def _take_offer(self, name: str, offer: dict, mine):
        """(this rank's copy of the offered checkpoint, None) once it reads back with rank 0's file
        hashes and strictly matches the draft and optimizer; else (None, the reason)."""
        path = self.state_dir.where(name)
        try:
            if mine is None:  # rank 0 has read it already
                mine = (name, *read_stored(self.state_dir, name))
                if mine[3].get("files") != offer["files"]:
                    raise CheckpointError(f"{path}: differs from rank 0's copy")
            try:
                check_model_state(self.model, mine[1])
                check_optimizer_state(self.optimizer, self.param_names, mine[2], mine[3]["optimizer"])
            except CheckpointError as e:
                raise CheckpointError(f"{path}: {e}") from None
        except CheckpointError as e:
            return None, (f"rank {self.rank}: {e}" if self.world_size > 1 else str(e))
        return mine, None

    def _refuse_world_size(self, name: str, meta: dict) -> str | None:
        """The data's rank slices and the global batch depend on the world size: a run under another
        one cannot continue that trajectory (kept as a refusal, with what to do)."""
        if meta["world_size"] == self.world_size:
            return None
        return (f"{self.state_dir.where(name)}: saved by a run with world size {meta['world_size']}, this run has "
                f"{self.world_size}; the data's rank slices and the global batch differ, so it cannot continue: "
                f"rerun with {meta['world_size']} processes, or move {self.state_dir} aside to train from scratch")

    def _refuse_beyond(self) -> str | None:
        beyond = steps_beyond(self.state_dir, self.fingerprint, self.cfg.steps)
        if not beyond:
            return None
        return (f"{self.state_dir}: checkpoints at steps {beyond} are all beyond train.steps={self.cfg.steps} and "
                f"none is at or below it: raise train.steps to continue from one, or move {self.state_dir} aside "
                f"to train from scratch")

    def _warn_beyond(self, name: str) -> None:
        beyond = steps_beyond(self.state_dir, self.fingerprint, self.cfg.steps)
        if beyond:
            log.warning("checkpoints at steps %s are beyond train.steps=%d: resuming from %s; they are removed "
                        "once this run saves a checkpoint", beyond, self.cfg.steps, name)

    def _broadcast(self, obj):
        return obj if self.world_size == 1 else distributed.share(obj, self.device, self.group)

    def _log_horizon_change(self, old_steps: int) -> None:
        if old_steps == self.cfg.steps:
            return
        step = self.state.step
        old = self.cfg.lr * lr_factor(step, replace(self.cfg, steps=old_steps))
        new = self.cfg.lr * lr_factor(step, self.cfg)
        log.warning("train.steps changed from %d to %d since the checkpoint at step %d: LR at step %d %.3e under "
                    "the old horizon, %.3e now (the schedule's horizon is the new steps from here on)",
                    old_steps, self.cfg.steps, step, step, old, new)

    def save(self) -> str | None:
        ranks = self._gather({"epoch": self.state.epoch, "position": self.state.position,
                              "tokens": self.state.tokens, "rng": rng_state(self.device),
                              "sampler": self.sampler.state_dict(self.state.epoch, self.state.position)})
        if self.rank != 0:
            return None
        opt_tensors, opt_meta = optimizer_tensors(self.optimizer, self.param_names)
        meta = {"fingerprint": self.fingerprint, "world_size": self.world_size, "epoch": self.state.epoch,
                "ranks": {str(r): {k: v for k, v in s.items() if k != "sampler"} for r, s in enumerate(ranks)},
                "sampler": {str(r): s["sampler"] for r, s in enumerate(ranks)},
                "scheduler": {"name": self.cfg.schedule, "step": self.state.step, "steps": self.cfg.steps},
                "optimizer": opt_meta, "metrics": self.last_metrics}
        state = {k: v for k, v in self.model.state_dict().items() if not k.startswith("rotary.")}
        path = save_checkpoint(self.state_dir, self.state.step, state, opt_tensors, meta, self.cfg.keep_checkpoints)
        for cb in self.callbacks:
            cb.on_checkpoint(self, path)
        return path

    def _gather(self, obj):
        return [obj] if self.world_size == 1 else distributed.gather(obj, self.device, self.group)

    # ---- the loop ------------------------------------------------------------------------------
    def batches(self):
        """Batches from the current (epoch, position) on, across epochs, forever: the DataLoader's
        (`num_workers` loading processes) through the Prefetcher, on the trainer's device. `step` takes
        its micro-batches from this (or from any iterator of such batches)."""
        while True:
            self.sampler.set_epoch(self.state.epoch)
            self.sampler.position = self.state.position
            self._check_batches()  # an epoch with no batch would loop here forever
            # each batch read straight into its collated layout (loader/batches.py): one copy a byte. On
            # CUDA its token axis is padded to the attention's key multiple: every new shape costs host
            # time there (cuBLAS's and cuDNN's per-shape set-up, new allocator blocks), and padded the
            # shapes repeat after a few batches; padded positions lie past each row's length, where
            # nothing attends to them or is supervised
            loader = DataLoader(Batches(self.dataset, kv_multiple(self.device)), sampler=self.sampler, batch_size=None,
                                num_workers=self.num_workers, pin_memory=self.device.type == "cuda",
                                persistent_workers=False,
                                multiprocessing_context=self.loader_context() if self.num_workers else None)
            for batch in Prefetcher(loader, self.device):
                self.state.position += 1
                yield batch
            self.state.epoch += 1
            self.state.position = 0

    def _global_weight(self, local: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's loss weight of this step (a tensor on the device: no read-back)."""
        if self.world_size > 1:
            local = local.clone()
            torch.distributed.all_reduce(local, group=self.group)
        return local

    def fit(self) -> dict:
        cfg = self.cfg
        self.restore()
        for cb in self.callbacks:
            cb.on_train_begin(self)
        batches = self.batches()
        self.module.train()
        t0 = time.time()
        self.data_wait_s = 0.0
        while self.state.step < cfg.steps:
            metrics = self.step(batches)
            self.last_metrics = metrics
            for cb in self.callbacks:
                cb.on_step_end(self, metrics)
            if self.state.step % cfg.checkpoint_every == 0 or self.state.step == cfg.steps:
                self.save()
        wall = time.time() - t0
        last = self.last_metrics
        self.final_metrics = {"final_loss": round(last.get("loss", float("nan")), 5),
                              "final_tau_greedy": round(last.get("tau_greedy", float("nan")), 4),
                              "steps": self.state.step, "tokens": self.state.tokens * self.world_size,
                              "wall_s": round(wall, 1),
                              # the share of the run's time this rank waited for its next batch
                              "data_wait_fraction": round(self.data_wait_s / max(wall, 1e-9), 4)}
        for cb in self.callbacks:
            cb.on_train_end(self)
        return self.final_metrics

    def step(self, batches) -> dict:
        """One optimizer step over `grad_accum` micro-batches drawn from `batches`; returns its metrics.
        Everything a micro-batch measures stays on the device; the step's metrics are read back once,
        at its end (`_read_metrics`), so no read-back of a metric makes the host wait inside the step
        and the prefetcher's next copy overlaps the compute (the selections of supervised rows still
        wait for their counts: those decide the shapes that follow)."""
        cfg = self.cfg
        step = self.state.step
        lr = cfg.lr * lr_factor(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Micro-batches stream: each is loaded, run backward and freed before the next, so a step holds
        # one micro-batch whatever grad_accum is. The loss of a step is normalised by the global batch's
        # weight, known only after the last one: each backward runs on the unnormalised sum and the
        # accumulated gradients are divided once at the end (the gradient is linear in that factor).
        terms = rates = seen = None  # [k] float64 on the device: loss terms add up, rates average
        local_weight = torch.zeros((), dtype=torch.float64, device=self.device)
        for m in range(cfg.grad_accum):
            t = time.perf_counter()
            batch = next(batches)
            self.data_wait_s += time.perf_counter() - t
            anchors = sample_anchors(batch["loss_mask"], batch["lengths"].to(batch["loss_mask"].device),
                                     cfg.anchors_per_sample, anchor_generator(cfg.seed, step, m, self.rank))
            sync = m == cfg.grad_accum - 1 or self.world_size == 1
            ctx = self.module.no_sync() if not sync and hasattr(self.module, "no_sync") else nullcontext()
            with ctx, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                out = self.module(batch, anchors, cfg.ce_weight, cfg.l1_weight, cfg.conf_weight,
                                  cfg.decay_gamma, norm=1.0)
                out.loss.backward()
            local_weight = local_weight + out.metrics["weight"].double()  # this micro-batch's sum of loss weights
            # each kind in one vector (stack promotes every value to float64), so a micro-batch's
            # bookkeeping is a few ops whatever the number of metrics
            order = list(out.metrics)
            term_names = [k for k in order if k in LOSS_TERMS]
            rate_names = [k for k in order if k not in LOSS_TERMS]
            vt = torch.stack([out.metrics[k] for k in term_names]).double()
            vr = torch.stack([out.metrics[k] for k in rate_names]).double()
            measured = ~torch.isnan(vr)  # a rate over nothing (NaN) does not count
            vr = torch.where(measured, vr, 0.0)
            terms, rates, seen = (vt, vr, measured.double()) if terms is None else \
                (terms + vt, rates + vr, seen + measured)
            self.state.tokens += int(batch["tokens"])  # counted on the host by the collator
            del batch, anchors, out
        # DDP averaged the gradients over ranks: the global sum over the global weight is that mean
        # times world / weight
        scale = self.world_size / self._global_weight(local_weight).clamp_min(1e-6)
        grads = [p.grad for p in self.params if p.grad is not None]
        torch._foreach_mul_(grads, scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip, foreach=True) if cfg.grad_clip > 0 \
            else torch.zeros((), device=self.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        # a rate is the mean over the micro-batches that measured it
        values = torch.cat([terms * scale, rates / seen.clamp_min(1), grad_norm.double()[None]])
        metrics = self._read_metrics([*term_names, *rate_names, "grad_norm"], values, seen, rate_names)
        metrics = {k: metrics[k] for k in [*order, "grad_norm"] if k in metrics}  # in the loss's order
        return dict(metrics, lr=lr, step=self.state.step)

    # logged as the mean over ranks (each rank's loss terms are normalised by the global weight divided by
    # the world size, so their rank mean is exactly the global batch's value); the rest are this rank's
    REDUCED = ("loss", "ce", "l1", "conf", "tau_greedy", "tau_prob")

    def _read_metrics(self, names: list[str], values: torch.Tensor, seen: torch.Tensor, rates: list[str]) -> dict:
        """{name: float} of a step's metrics (`values`, one per name, on the device), in one
        device-to-host copy (with one all_reduce first under DDP). A rate (`rates`, counted in `seen`)
        that no micro-batch of this rank measured is left out."""
        local = torch.cat([values, seen])
        rows = local[None]
        if self.world_size > 1:
            total = local.clone()
            torch.distributed.all_reduce(total, group=self.group)
            rows = torch.stack([local, total / self.world_size])
        read = rows.tolist()  # the step's one read-back
        mine, mean = read[0], read[-1]
        counts = dict(zip(rates, mine[len(names):]))
        return {k: (mean if k in self.REDUCED else mine)[i] for i, k in enumerate(names) if counts.get(k, 1) > 0}
