"""train.compile: the draft's training step compiled against eager, side by side on the same batches.

    python benchmarks/compile_step.py [--cpu] [--steps 40] [--algorithms dspark,eagle3]

builtin:tiny (from the repo's DVC remote, as gpu_check does) caches a few hundred conversations; then,
per algorithm, an eager and a compiled trainer (the same fresh draft, seed and settings) step through
the same batches, already on the device: two passes each (the faster kept: the machine is noisy), with
the compiler's on-disk caches empty at the start, as on a fresh machine (a second run on the same
machine compiles several times faster). Sizes: params.yaml's train section (the embedded default)
on the CPU, gpu_check's on CUDA. Prints for each: steady tokens/s of both and their ratio (goal > 1 where
`auto` turns compiling on), the compile time (the first pass's excess over its steady steps), the
steps a run needs to earn the compile back, the graphs compiled, and the largest relative difference
between the two loss curves.
"""
from __future__ import annotations

import argparse
import json
import os
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


def passes(work: Path, target: Path, train: dict, algorithm: str, compiled: bool, steps: int, device,
           layers: list[int] = LAYERS) -> list[dict]:
    """Two passes of `steps` steps of one trainer on work/cache.zarr over the same resident batches."""
    from deepspec.config import TrainConfig
    from deepspec.train.run import build_trainer

    clock = gpu_check.Clock(device)
    cfg = TrainConfig(**dict(train, num_workers=0, algorithm=algorithm, compile=compiled, steps=10 ** 6,
                             checkpoint_every=10 ** 6))
    layers = gpu_check.eagle3_layers(layers) if algorithm == "eagle3" else layers
    trainer = build_trainer(cfg, layers, str(work / "cache.zarr"), target, work / f"train-{algorithm}",
                            work / f"state-{algorithm}-{compiled}", device=device)
    trainer.module.train()
    resident = gpu_check.resident(trainer, steps * cfg.grad_accum)
    out = []
    for _ in range(2):
        batches, tokens0, times, losses = iter(resident), trainer.state.tokens, [], []
        for _ in range(steps):
            t = clock.now()
            losses.append(trainer.step(batches)["loss"])
            times.append(clock.now() - t)
        out.append({"times": times, "losses": losses, "tokens": trainer.state.tokens - tokens0})
    return out


def cold_caches(root: Path) -> None:
    """Compile from nothing, as on a fresh machine: TorchInductor's and Triton's on-disk caches (which
    make a second run's compile several times faster) under `root` instead of their shared place."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")


def compare(eager: list[dict], compiled: list[dict], steps: int) -> dict:
    """Steady tokens/s of both (the median step of the faster pass), the compile time (the first compiled
    pass's excess over its steady steps), break-even steps, and the loss curves' largest relative gap."""
    steady = {name: min(sorted(p["times"])[len(p["times"]) // 2] for p in runs)
              for name, runs in (("eager", eager), ("compiled", compiled))}
    rate = {k: eager[1]["tokens"] / (v * steps) for k, v in steady.items()}
    compile_s = sum(compiled[0]["times"]) - steady["compiled"] * steps
    gain = steady["eager"] - steady["compiled"]
    diff = max(abs(a - b) / abs(a) for a, b in zip(eager[0]["losses"], compiled[0]["losses"]))
    return {"eager_tokens_per_s": round(rate["eager"]), "compiled_tokens_per_s": round(rate["compiled"]),
            "compiled_vs_eager": round(rate["compiled"] / rate["eager"], 3),
            "eager_step_ms": round(1000 * steady["eager"], 2), "compiled_step_ms": round(1000 * steady["compiled"], 2),
            "compile_s": round(compile_s, 1), "break_even_steps": round(compile_s / gain) if gain > 0 else None,
            "loss_max_rel_diff": float(f"{diff:.2e}")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--algorithms", default="dspark,eagle3")
    args = ap.parse_args()
    from torch._dynamo.utils import counters

    from deepspec.devices import local_device

    device = torch.device("cpu") if args.cpu else local_device()
    size = gpu_check.SIZES[device.type]
    # on the CPU the embedded default's draft and batches: the run `auto` decides for
    train = dict(size["train"], draft_layers=1, lr=1e-3, warmup_steps=1) if device.type == "cuda" else \
        gpu_check.default_train("ttt_steps", "draft_vocab_size")
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile-step-") as tmp:
        tmp = Path(tmp)
        cold_caches(tmp)
        tiny = gpu_check.tiny_store(tmp, args.rows, 4, device, LAYERS, max_length=1024)
        for algorithm in args.algorithms.split(","):
            graphs0 = counters["stats"]["unique_graphs"]
            eager = passes(tmp, tiny, train, algorithm, False, args.steps, device)
            compiled = passes(tmp, tiny, train, algorithm, True, args.steps, device)
            rows.append({"algorithm": algorithm, **compare(eager, compiled, args.steps),
                         "graphs": counters["stats"]["unique_graphs"] - graphs0})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\ntrain.compile on {device} ({train['batch_size']} rows a micro-batch, grad_accum {train['grad_accum']}, "
          f"{args.steps} steps a pass):")
    print(f"{'algorithm':<10}{'eager tok/s':>13}{'compiled':>11}{'ratio':>8}{'goal':>7}{'compile s':>11}"
          f"{'break-even steps':>18}{'graphs':>8}")
    for r in rows:
        print(f"{r['algorithm']:<10}{r['eager_tokens_per_s']:>13}{r['compiled_tokens_per_s']:>11}"
              f"{r['compiled_vs_eager']:>8}{'> 1':>7}{r['compile_s']:>11}{str(r['break_even_steps']):>18}"
              f"{r['graphs']:>8}")
        print(f"FIGURE compile_step.{device.type}.{r['algorithm']}.compiled_vs_eager = {r['compiled_vs_eager']}")
        print(f"FIGURE compile_step.{device.type}.{r['algorithm']}.compile_s = {r['compile_s']}")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"compile_step: {time.perf_counter() - t0:.0f} s")
    sys.exit(rc)
