"""DSpark τ with the mask slots filled by a learned vector vs by the target's reserved token row.

    python benchmarks/mask_token.py [--scale small|corpus] [--work DIR] [--steps N] [--seeds 0 1]

Builds its own setup in one run (no DVC, no regen server), then for each seed trains two DSpark
drafts identically except `train.mask_token_id` (-1 = learned vector, the old behaviour; null = the
tokenizer's <|MASK|> row, the new default) and prints the greedy eval τ of both on the same prompts,
side by side, and their ratio.
  small   the test fixtures' scale: a 4-layer width-32 builtin:tiny target trained on the tests'
          sample conversations, cache layers [-1, 0, 2], τ on those conversations' prompts (minutes)
  corpus  an 8-layer width-128 builtin:tiny target on the packaged corpus, cache layers [1, 3, 5],
          τ on held-out prompts (about an hour on 2 idle cores)
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from deepspec.cache.build.stage import build_cache
from deepspec.config import CacheConfig, EvalConfig, SamplingConfig, SplitConfig, TargetConfig, TinyTargetConfig, TrainConfig
from deepspec.data.split import split_rows
from deepspec.evaluate.run import evaluate
from deepspec.evaluate.suites import interleave_tasks
from deepspec.io import write_jsonl
from deepspec.embedded.tiny import trainer_on
from deepspec.models.prepare import prepare_target
from deepspec.train.run import run_training

def small_setup(work: Path, n_prompts: int):
    from tests.conftest import SAMPLE_CONVERSATIONS, SMALL_TINY

    rows = [{"id": f"{i + 1:016x}", "conversations": c} for i, c in enumerate(SAMPLE_CONVERSATIONS)]
    prompts = [{"id": r["id"], "task": "unit", "turns": [r["conversations"][0]["content"]]} for r in rows[::3]]
    return TinyTargetConfig(**SMALL_TINY), rows, prompts[:n_prompts], [-1, 0, 2]


def corpus_setup(work: Path, n_prompts: int):
    split = split_rows(SplitConfig())
    seen, prompts = set(), []
    for r in interleave_tasks([{"id": r["id"], "task": r["task"], "system": r.get("system"), "turns": r["turns"][:1]}
                               for r in split.eval]):
        if r["turns"][0] not in seen:
            seen.add(r["turns"][0])
            prompts.append(r)
    return TinyTargetConfig(num_layers=8, steps=400), split.train, prompts[:n_prompts], [1, 3, 5]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", choices=["small", "corpus"], default="small")
    ap.add_argument("--work", default="/tmp/mask-bench")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--prompts", type=int, default=30)
    args = ap.parse_args()
    work = Path(args.work) / args.scale
    tiny, rows, prompts, layers = (small_setup if args.scale == "small" else corpus_setup)(work, args.prompts)
    target = work / "target"
    if not (target / "identity.json").exists():
        prepare_target(TargetConfig(tiny=tiny), layers, trainer_on(rows), target)
    cache = work / "cache.zarr"
    if not (cache / "zarr.json").exists():
        write_jsonl(work / "regen.jsonl", ({"id": r["id"], "conversations": r["conversations"]} for r in rows))
        build_cache(CacheConfig(url=str(cache), part_tokens=4096), layers, work / "regen.jsonl", target)
    results = []
    for seed in args.seeds:
        tau = {}
        for name, mask in (("learned", -1), ("token_row", None)):
            cfg = replace(TrainConfig(), steps=args.steps, warmup_steps=min(50, args.steps // 10),
                          checkpoint_every=args.steps, seed=seed, mask_token_id=mask)
            out = work / f"{name}-{seed}"
            t0 = time.time()
            final = run_training(cfg, layers, str(cache), target, out / "draft", out / "train", out / "state")
            report, _ = evaluate(target, out / "draft", {"bench": prompts},
                                 EvalConfig(max_new_tokens=48, sample=False), SamplingConfig())
            tau[name] = report["suites"]["bench"]["tau"]
            print(json.dumps({"seed": seed, "mask": name, "tau": tau[name], "train_tau_greedy":
                              final["final_tau_greedy"], "s": round(time.time() - t0)}), flush=True)
        results.append(tau)
    mean = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
    print(json.dumps({"scale": args.scale, "steps": args.steps, "seeds": args.seeds, "prompts": len(prompts),
                      "tau_learned": round(mean["learned"], 3), "tau_token_row": round(mean["token_row"], 3),
                      "ratio": round(mean["token_row"] / mean["learned"], 3)}))


if __name__ == "__main__":
    main()
