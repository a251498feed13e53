"""train.num_workers on this machine: tokens/s and the data-wait fraction of the trainer's own loop
(DataLoader + Prefetcher, a new loader each epoch) with 0, 1 and 2 loading processes, side by side.

    python benchmarks/loader_workers.py [--cpu] [--rows 600] [--steps 100] [--workers 0,1,2]

builtin:tiny (from the repo's DVC remote, as gpu_check does) caches `rows` conversations; then, for each
worker count in turn, twice (the better run kept: the machine is noisy), a fresh trainer with the
embedded default's train params (params.yaml) runs `steps` steps through `Trainer.batches()`. What
`num_workers: auto` chooses on this device is printed beside the fastest count.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import gpu_check  # noqa: E402

LAYERS = [1, 9, 17, 25, 33]


def run(work: Path, target: Path, train: dict, workers: int, steps: int, device, tag: str) -> dict:
    from deepspec.config import TrainConfig
    from deepspec.train.run import build_trainer

    clock = gpu_check.Clock(device)
    cfg = TrainConfig(**dict(train, num_workers=workers, steps=10 ** 6, checkpoint_every=10 ** 6))
    trainer = build_trainer(cfg, LAYERS, str(work / "cache.zarr"), target, work / f"train-{tag}", work / f"state-{tag}",
                            device=device)
    trainer.module.train()
    batches = trainer.batches()
    trainer.step(batches)  # warm-up: kernels chosen, the first loader's workers started
    tokens0, wait0 = trainer.state.tokens, trainer.data_wait_s
    t0 = clock.now()
    for _ in range(steps):
        trainer.step(batches)
    wall = clock.now() - t0
    return {"tokens_per_s": (trainer.state.tokens - tokens0) / wall,
            "data_wait_fraction": (trainer.data_wait_s - wait0) / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--workers", default="0,1,2")
    args = ap.parse_args()
    from deepspec.devices import local_device, loader_workers

    device = torch.device("cpu") if args.cpu else local_device()
    train = gpu_check.default_train()
    counts = [int(w) for w in args.workers.split(",")]
    best: dict = {}
    with tempfile.TemporaryDirectory(prefix="loader-workers-") as tmp:
        tmp = Path(tmp)
        tiny = gpu_check.tiny_store(tmp, args.rows, 5, device, LAYERS, batch_tokens=8192)
        for round_ in range(2):
            for w in counts:
                r = run(tmp, tiny, train, w, args.steps, device, f"{w}-{round_}")
                print(f"round {round_}, {w} workers: {r['tokens_per_s']:.0f} tokens/s, data wait "
                      f"{r['data_wait_fraction']:.4f}", flush=True)
                if r["tokens_per_s"] > best.get(w, {}).get("tokens_per_s", 0):
                    best[w] = r
    fastest = max(best, key=lambda w: best[w]["tokens_per_s"])
    auto = loader_workers("auto", device)
    print(f"\ntrain.num_workers on {device} ({train['batch_size']} rows a batch, {args.steps} steps, "
          "the better of 2 runs):")
    print(f"{'workers':>8}{'tokens/s':>11}{'vs fastest':>12}{'data wait':>11}")
    for w in counts:
        r = best[w]
        print(f"{w:>8}{r['tokens_per_s']:>11.0f}{r['tokens_per_s'] / best[fastest]['tokens_per_s']:>12.3f}"
              f"{r['data_wait_fraction']:>11.4f}")
        print(f"FIGURE loader_workers.{device.type}.w{w}.data_wait_fraction = {r['data_wait_fraction']:.4f}")
        ratio = r["tokens_per_s"] / best[fastest]["tokens_per_s"]
        print(f"FIGURE loader_workers.{device.type}.w{w}.vs_fastest = {ratio:.3f}")
    print(f"fastest: {fastest} workers; num_workers: auto gives {auto} on {device.type}")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"loader_workers: {time.perf_counter() - t0:.0f} s")
    sys.exit(rc)
