"""A read-through run's wait before its first optimizer step, by train.window_parts, side by side.

    python benchmarks/first_step.py [--cpu] [--rows 400] [--part-tokens 2048]

builtin:tiny (from the repo's DVC remote, as gpu_check does) and `rows` regen conversations, cut into
parts of `part-tokens` tokens (at least 40 parts); then, for each setting, a read-through run of a few
steps with the embedded default's train params on a new store: how many parts the batches drawn
before the end of its first step needed (`parts_before_first_step`) and the seconds to that step. The
default (`auto`: growing windows for read-through) against `0` (the default before it: an order over
all samples, whose first batches touch a part each) and a fixed window of 8 parts.
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

LAYERS = [1, 9, 17, 25, 33]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--part-tokens", type=int, default=2048)
    args = ap.parse_args()
    from deepspec.cache.build.fill import StoreFill
    from deepspec.config import CacheConfig, TrainConfig
    from deepspec.devices import local_device
    from deepspec.train.callbacks import Callback
    from deepspec.train.run import build_trainer, capture_counts

    device = torch.device("cpu") if args.cpu else local_device()
    train = gpu_check.default_train()

    class FirstStep(Callback):
        def on_step_end(self, trainer, metrics):
            self.at = getattr(self, "at", None) or time.perf_counter()

    rows = []
    with tempfile.TemporaryDirectory(prefix="first-step-") as tmp:
        tmp = Path(tmp)
        tiny = gpu_check.shipped_target(tmp / "tiny")
        regen = tmp / "regen.jsonl"
        regen.write_text("".join(json.dumps(r) + "\n" for r in gpu_check.conversations(args.rows, seed=6)))
        for window in ("auto", 0, 8):
            work = tmp / f"w{window}"
            t0 = time.perf_counter()
            fill = StoreFill(CacheConfig(url=str(work / "cache.zarr"), part_tokens=args.part_tokens), LAYERS, regen,
                             tiny, device)
            cfg = TrainConfig(**train, steps=3, checkpoint_every=10 ** 6, capture="read-through", window_parts=window,
                              num_workers=0)
            try:
                trainer = build_trainer(cfg, LAYERS, None, tiny, work / "train", work / "state", device=device,
                                        fill=fill)
                first = FirstStep()
                trainer.callbacks = [cb for cb in trainer.callbacks if type(cb).__name__ != "DvcLiveMetrics"] + [first]
                trainer.fit()
                fill.finish()
            except BaseException:
                fill.abort()
                raise
            counts = capture_counts(cfg, trainer, fill)
            rows.append({"window_parts": window, "parts": counts["parts_computed"] + counts["parts_kept"],
                         "parts_before_first_step": counts["parts_before_first_step"],
                         "first_step_s": round(first.at - t0, 2)})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nread-through on {device}, {train['batch_size']} rows a batch, grad_accum {train['grad_accum']}:")
    print(f"{'window_parts':>13}{'parts':>7}{'parts before first step':>25}{'goal':>7}{'first step s':>14}")
    for r in rows:
        print(f"{str(r['window_parts']):>13}{r['parts']:>7}{r['parts_before_first_step']:>25}"
              f"{'<= 2' if r['window_parts'] == 'auto' else '':>7}{r['first_step_s']:>14}")
        key = f"first_step.{device.type}.w{r['window_parts']}.parts_before_first_step"
        print(f"FIGURE {key} = {r['parts_before_first_step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
