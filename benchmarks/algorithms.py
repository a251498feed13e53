"""Greedy τ of DSpark, DFlash and EAGLE-3 drafts trained for the same steps on the same cache, and of an
untrained (random) EAGLE-3 draft.

    python benchmarks/algorithms.py [--work DIR] [--steps N] [--prompts N]

Builds its own setup in one run (no DVC, no regen server), at the test fixtures' scale: a 4-layer
width-32 builtin:tiny target trained on the tests' sample conversations, one cache of layers
[-1, 0, 2] (EAGLE-3 fuses all three), every draft trained with the train defaults but `steps`
(EAGLE-3: ttt_steps 4 drafts per round, draft vocabulary capped at 256 of the target's tokens so the
d2t map is exercised; DSpark/DFlash: block size 4, i.e. 4 and 3 drafts per round), then the eval
stage's own `evaluate` (greedy, the same prompts: the sample conversations' first user turns) prints τ
side by side. Minutes on 2 cores; not the embedded default's numbers (that needs `make repro` and
`dvc exp run -S train.algorithm=...`).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from deepspec.cache.build.stage import build_cache
from deepspec.config import CacheConfig, EvalConfig, SamplingConfig, TargetConfig, TinyTargetConfig, TrainConfig
from deepspec.evaluate.run import evaluate
from deepspec.io import write_jsonl
from deepspec.embedded.tiny import trainer_on
from deepspec.models.prepare import prepare_target
from deepspec.train.run import new_draft, run_training

LAYERS = [-1, 0, 2]


def main() -> None:
    from tests.conftest import SAMPLE_CONVERSATIONS, SMALL_TINY

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/algorithms-bench")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=22)
    args = ap.parse_args()
    work = Path(args.work)
    rows = [{"id": f"{i + 1:016x}", "conversations": c} for i, c in enumerate(SAMPLE_CONVERSATIONS)]
    target = work / "target"
    if not (target / "identity.json").exists():
        prepare_target(TargetConfig(tiny=TinyTargetConfig(**SMALL_TINY)), LAYERS, trainer_on(rows), target)
    cache = work / "cache.zarr"
    if not (cache / "zarr.json").exists():
        write_jsonl(work / "regen.jsonl", ({"id": r["id"], "conversations": r["conversations"]} for r in rows))
        build_cache(CacheConfig(url=str(cache), part_tokens=4096), LAYERS, work / "regen.jsonl", target)
    prompts = [{"id": r["id"], "task": "unit", "turns": [r["conversations"][0]["content"]]}
               for r in rows[::3]][:args.prompts]
    eval_cfg = EvalConfig(max_new_tokens=48, sample=False)
    base = replace(TrainConfig(), steps=args.steps, warmup_steps=min(50, args.steps // 10), checkpoint_every=args.steps,
                   draft_vocab_size=256)
    out = {}
    for name in ("dspark", "dflash", "eagle3", "eagle3-random"):
        cfg = replace(base, algorithm=name.removesuffix("-random"))
        run = work / name
        t0 = time.time()
        if name.endswith("random"):
            from deepspec.loader.dataset import TargetCacheDataset
            from deepspec.models.eagle3 import loss_token_counts

            counts = loss_token_counts(TargetCacheDataset(str(cache), layers=[], fields=("input_ids", "loss_mask")))
            new_draft(cfg, LAYERS, target, counts).save(run / "draft")
            final = {}
        else:
            final = run_training(cfg, LAYERS, str(cache), target, run / "draft", run / "train", run / "state")
        report, _ = evaluate(target, run / "draft", {"bench": prompts}, eval_cfg, SamplingConfig())
        m = report["suites"]["bench"]
        out[name] = m["tau"]
        print(json.dumps({"algorithm": name, "steps": 0 if name.endswith("random") else args.steps, "tau": m["tau"],
                          "drafts_per_round": m["greedy"]["mean_proposal"], "greedy_match": m["greedy_match"],
                          "train_tau_greedy": final.get("final_tau_greedy"), "s": round(time.time() - t0)}), flush=True)
    print(json.dumps({"steps": args.steps, "prompts": len(prompts), **{f"tau_{k}": v for k, v in out.items()}}))


if __name__ == "__main__":
    main()
