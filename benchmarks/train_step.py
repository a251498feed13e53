"""How much the loader slows training: tokens/s with the real loader vs the same batches in memory.

    python benchmarks/train_step.py [--steps 150] [--workers 0]

Uses data/cache.zarr, data/target and the `train` params. Both contenders run the identical
optimisation (same batches, same anchors, fresh draft each time); they alternate twice and the
better run of each is kept. Prints tokens/s of both and the ratio (goal >= 0.95).
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from deepspec.cache.storage.naming import built_store_url
from deepspec.params import load_params
from deepspec.loader.collate import collate
from deepspec.loader.dataset import TargetCacheDataset
from deepspec.loader.prefetch import Prefetcher
from deepspec.loader.sampler import ResumableBatchSampler
from deepspec.models.objectives import sample_anchors
from deepspec.train.run import new_draft


def run(model, batches, cfg) -> tuple[float, int]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    tokens, t0 = 0, time.perf_counter()
    for step, batch in enumerate(batches):
        gen = torch.Generator().manual_seed(step)
        anchors = sample_anchors(batch["loss_mask"], batch["lengths"], cfg.anchors_per_sample, gen)
        out = model(batch, anchors, cfg.ce_weight, cfg.l1_weight, cfg.conf_weight, cfg.decay_gamma)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(batch["lengths"].sum())
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--workers", type=int, default=0)
    args = ap.parse_args()
    params = load_params()
    cfg, layers = params.train, params.train_layers
    ds = TargetCacheDataset(built_store_url(params.cache.url), layers=layers,
                            storage_options=params.cache.storage_options)
    sampler = ResumableBatchSampler(ds.lengths(), batch_size=cfg.batch_size, seed=0)
    plan = sampler.batches(0)[: args.steps]
    base = new_draft(cfg, layers, Path("data/target"))

    def loader_batches():
        s = ResumableBatchSampler(ds.lengths(), batch_size=cfg.batch_size, seed=0)
        loader = DataLoader(ds, batch_sampler=s, collate_fn=collate, num_workers=args.workers)
        for i, b in enumerate(Prefetcher(loader, "cpu")):
            if i == args.steps:
                return
            yield b

    memory = [collate([ds[i] for i in b]) for b in plan]
    for b in memory:
        b["input_ids"] = b["input_ids"].long()
    best: dict = {}
    for _ in range(2):
        for name, batches in (("real_loader", loader_batches), ("in_memory", lambda: iter(memory))):
            secs, tokens = run(copy.deepcopy(base), batches(), cfg)
            rate = tokens / secs
            best[name] = max(best.get(name, 0.0), rate)
    print(json.dumps({"steps": args.steps, "batch_size": cfg.batch_size, "workers": args.workers,
                      "tokens_per_s": {k: round(v, 1) for k, v in best.items()},
                      "ratio_loader_vs_memory": round(best["real_loader"] / best["in_memory"], 3)}, indent=2))


if __name__ == "__main__":
    main()
