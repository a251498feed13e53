"""Where a training step's time goes when batches come from the real loader, against the same batches
already on the device: the GPU check showed the loader path far slower than resident batches while
the trainer waited for data under 1 % of the time, so the cost is inside the step.

    python benchmarks/train_overlap.py [--cpu] [--steps 12] [--workers 4]

builtin:tiny (from the repo's DVC remote, as gpu_check does) caches 512 conversations on the device,
then one trainer runs, in this order, each after a warm-up step:
- loader: the trainer's own DataLoader (`workers` processes, pinned memory) through the Prefetcher;
- loader, next steps: the same iterator again (every batch shape new again; allocator and kernels warm);
- resident: the batches the loader produced, already on the device;
- host list: the same batches on the host (pinned), through the Prefetcher with no DataLoader;
- no pinning: a DataLoader with `pin_memory=False` through the Prefetcher (which pins);
and a torch.profiler table of a few loader steps (self CPU time, then device time); then greedy
speculative decoding with the trained draft against plain decoding, twice.
Prints tokens/s and data wait of each; per-step seconds; the profiler tables; decoding's speed-up.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import gpu_check  # noqa: E402


def timed(trainer, batches, steps: int, clock) -> dict:
    tokens0, wait0 = trainer.state.tokens, trainer.data_wait_s
    per_step = []
    t0 = clock.now()
    for _ in range(steps):
        t = clock.now()
        trainer.step(batches)
        per_step.append(round(clock.now() - t, 4))
    wall = clock.now() - t0
    tokens = trainer.state.tokens - tokens0
    return {"tokens_per_s": round(tokens / wall), "data_wait_fraction": round((trainer.data_wait_s - wait0) / wall, 4),
            "step_s": per_step}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=512)
    args = ap.parse_args()
    from torch.utils.data import DataLoader

    from deepspec.cache.build.stage import build_cache
    from deepspec.config import CacheConfig
    from deepspec.devices import local_device
    from deepspec.loader.collate import collate
    from deepspec.loader.prefetch import Prefetcher

    device = torch.device("cpu") if args.cpu else local_device()
    size = gpu_check.SIZES[device.type]
    clock = gpu_check.Clock(device)
    layers = [1, 9, 17, 25, 33]
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="train-overlap-") as tmp:
        tmp = Path(tmp)
        tiny = gpu_check.shipped_target(tmp / "tiny")
        regen = tmp / "regen.jsonl"
        regen.write_text("".join(json.dumps(r) + "\n" for r in gpu_check.conversations(args.rows, seed=4)))
        build_cache(CacheConfig(url=str(tmp / "cache.zarr"), batch_tokens=size["batch_tokens"], max_length=1024),
                    layers, regen, tiny, device=device)
        trainer, batches, kept = gpu_check.warm_trainer(tmp, tiny, layers, size, args.workers, device)
        out["loader"] = timed(trainer, batches, args.steps, clock)
        first = list(kept)
        out["loader, next steps"] = timed(trainer, batches, args.steps, clock)
        out["resident"] = timed(trainer, iter(first * 2), args.steps, clock)
        host = [{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in first]
        out["host list"] = timed(trainer, iter(Prefetcher(host * 2, device)), args.steps, clock)
        trainer.sampler.position = 0  # from the epoch's start: enough batches whatever the loader passes took
        loader = DataLoader(trainer.dataset, batch_sampler=trainer.sampler, collate_fn=collate,
                            num_workers=args.workers, pin_memory=False)
        unpinned = iter(Prefetcher(loader, device))
        trainer.step(unpinned)
        out["no pinning"] = timed(trainer, unpinned, args.steps, clock)
        for name, r in out.items():
            print(f"{name:<20} {r['tokens_per_s']:>9} tokens/s  wait {r['data_wait_fraction']:.4f}  steps {r['step_s']}",
                  flush=True)

        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(4):
                trainer.step(batches)
            clock.now()
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        if device.type == "cuda":
            print(table.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
        # decoding meets a new context length every round: greedy speculative against plain decoding
        draft = tmp / "draft"
        trainer.model.save(draft)
        del trainer, batches, kept, first
        for round_ in ("first", "again"):  # the second pass meets lengths the first one met
            e = gpu_check.check_eval(tiny, draft, dict(size, prompts=4, new_tokens=48), device, must_match=True)
            print(f"eval ({round_}): greedy match {e['greedy_match']} (float32: {e.get('greedy_match_fp32', '-')})  "
                  f"speedup {e['speedup_greedy']}  tau {e['tau_greedy']}", flush=True)
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"train_overlap: {time.perf_counter() - t0:.0f} s")
    sys.exit(rc)
