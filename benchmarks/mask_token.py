"""DSpark τ with the mask slots filled by a learned vector vs by the target's reserved token row.

    python benchmarks/mask_token.py [--work /tmp/mask-bench] [--steps 800] [--seeds 0 1]

A small version of the embedded default, built here in one run (no DVC, no regen server): a
builtin:tiny target of 8 layers on the packaged corpus, a cache of its train conversations at layers
[1, 3, 5], then for each seed two DSpark drafts trained identically except `train.mask_token_id`
(-1 = learned vector, the old behaviour; null = the tokenizer's <|MASK|> row, the new default), and
greedy eval τ of both on the same held-out prompts. Prints τ side by side and their ratio.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from deepspec.cache.build import build_cache
from deepspec.config import CacheConfig, EvalConfig, SamplingConfig, SplitConfig, TargetConfig, TinyTargetConfig, TrainConfig
from deepspec.data.split import split_rows
from deepspec.evaluate.run import evaluate, interleave_tasks
from deepspec.io import write_jsonl
from deepspec.models.target import prepare_target
from deepspec.train.run import run_training

LAYERS = [1, 3, 5]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/mask-bench")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--prompts", type=int, default=30)
    args = ap.parse_args()
    work = Path(args.work)
    split = split_rows(SplitConfig())
    target = work / "target"
    if not (target / "identity.json").exists():
        tiny = TinyTargetConfig(num_layers=8, steps=400)
        prepare_target(TargetConfig(tiny=tiny), LAYERS, lambda: split.train, target)
    cache = work / "cache.zarr"
    if not (cache / "zarr.json").exists():
        write_jsonl(work / "regen.jsonl", ({"id": r["id"], "conversations": r["conversations"]} for r in split.train))
        build_cache(CacheConfig(url=str(cache)), LAYERS, work / "regen.jsonl", target)
    seen, prompts = set(), []
    for r in interleave_tasks([{"id": r["id"], "task": r["task"], "system": r.get("system"), "prompt": r["turns"][0]}
                               for r in split.eval]):
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            prompts.append(r)
    prompts = prompts[:args.prompts]
    rows = []
    for seed in args.seeds:
        tau = {}
        for name, mask in (("learned", -1), ("token_row", None)):
            cfg = replace(TrainConfig(), steps=args.steps, warmup_steps=50, checkpoint_every=args.steps, seed=seed,
                          mask_token_id=mask)
            out = work / f"{name}-{seed}"
            t0 = time.time()
            final = run_training(cfg, LAYERS, str(cache), target, out / "draft", out / "train", out / "state")
            metrics, _ = evaluate(target, out / "draft", prompts, EvalConfig(max_new_tokens=48, sample=False),
                                  SamplingConfig())
            tau[name] = metrics["tau"]
            print(json.dumps({"seed": seed, "mask": name, "tau": metrics["tau"], "train_tau_greedy":
                              final["final_tau_greedy"], "s": round(time.time() - t0)}), flush=True)
        rows.append(tau)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    print(json.dumps({"tau_learned": round(mean["learned"], 3), "tau_token_row": round(mean["token_row"], 3),
                      "ratio": round(mean["token_row"] / mean["learned"], 3), "seeds": args.seeds}))


if __name__ == "__main__":
    main()
