"""Checked random reads through a DataLoader, as the trainer runs them, at the reference width.

    python benchmarks/checks_workers.py [--gb 0.6] [--workers 0,2,4] [--batch 8] [--seconds 6]

Synthetic bf16 rows at H = 2,560, layers [1, 9, 17, 25, 33] + last, ~1,000-token samples, page
cache hot (benchmarks/loader.py builds them). Each contender is a map-style dataset read through
`torch.utils.data.DataLoader(batch_sampler=random batches, collate_fn=deepspec's collate,
num_workers=W)`, the trainer's configuration, for every W of --workers, side by side in one run:
  mmap_copy         the reference reader: a flat record file, mmapped, each tensor copied out
  checks_off        TargetCacheDataset(verify=False)
  checks_inline     TargetCacheDataset(verify=True, check_threads=0): crc32c in the reading thread
                    of each loading process (the crc32c package releases the GIL)
  checks_python_thread  the same checks on one Python helper thread per loading process
Prints samples/s per (contender, W), best of three interleaved rounds, with the spread of the rounds
(the noise a difference must beat), and the ratios: checks on / mmap_copy (the goal: >= 0.9) and
Python helper thread / inline. The same script with a native checker thread as a fifth contender
decided that checker's removal (deepspec/cache/read/checks.py says with which numbers).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loader import REF_LAYERS, build, synthetic_flat, warm, write_reference  # noqa: E402

from deepspec.loader.collate import collate  # noqa: E402
from deepspec.loader.dataset import TargetCacheDataset  # noqa: E402


class MmapRecords(Dataset):
    """The reference design: one flat file of records, mmapped (lazily, per loading process)."""

    def __init__(self, path: Path, index: list[tuple[int, int, int]], layers: list[int], width: int):
        self.path, self.index, self.layers, self.width = path, index, layers, width
        self._mm = None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        off, _, t = self.index[i]
        L, H, mm = len(self.layers), self.width, self._mm
        ids = torch.from_numpy(np.frombuffer(mm, np.int32, t, off).copy())
        loss = torch.from_numpy(np.frombuffer(mm, np.uint8, t, off + 5 * t).copy())
        hid = torch.from_numpy(np.frombuffer(mm, np.uint16, t * L * H, off + 6 * t).copy()).view(torch.bfloat16)
        last = torch.from_numpy(np.frombuffer(mm, np.uint16, t * H, off + 6 * t + 2 * t * L * H).copy())
        # the shapes TargetCacheDataset hands the collator (the copy is the cost; the order is not)
        return {"input_ids": ids, "loss_mask": loss, "hidden": hid.view(L, t, H),
                "last_hidden": last.view(torch.bfloat16).view(t, H)}


def random_batches(n: int, batch: int, seed: int) -> list[list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [order[i:i + batch] for i in range(0, n - batch + 1, batch)] * 50


def timed_loader(dataset, workers: int, batch: int, seconds: float, seed: int) -> dict:
    """samples/s over `seconds` of a DataLoader's batches, after its first batch (worker start-up)."""
    loader = DataLoader(dataset, batch_sampler=random_batches(len(dataset), batch, seed), collate_fn=collate,
                        num_workers=workers, prefetch_factor=2 if workers else None)
    it = iter(loader)
    next(it)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        next(it)
        count += batch
    dt = time.perf_counter() - t0
    del it
    return {"samples_s": round(count / dt, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=0.6)
    ap.add_argument("--width", type=int, default=2560)
    ap.add_argument("--sample-tokens", type=int, default=1000)
    ap.add_argument("--workers", default="0,2,4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=6.0)
    args = ap.parse_args()
    layers, H, T = REF_LAYERS, args.width, args.sample_tokens
    workers = [int(w) for w in args.workers.split(",")]
    per_sample = T * (5 + (len(layers) + 1) * H * 2)
    n = max(4 * args.batch, int(args.gb * 1e9 / per_sample))
    flat = synthetic_flat(int(T * 1.2) * 8 + 1, H, layers)
    out: dict = {"samples": n, "sample_tokens": T, "hidden_size": H, "batch": args.batch, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        url, _ = build(tmp / "store", layers, flat, n, T, "bfloat16", "none")
        del flat
        index = write_reference(tmp / "reference.bin", TargetCacheDataset(url))
        warm(tmp)
        contenders = {"mmap_copy": MmapRecords(tmp / "reference.bin", index, layers, H),
                      "checks_off": TargetCacheDataset(url, verify=False),
                      "checks_inline": TargetCacheDataset(url, verify=True, check_threads=0),
                      "checks_python_thread": TargetCacheDataset(url, verify=True, check_threads=1)}
        results: dict = {}
        for rep in range(3):  # interleaved, best of three: the machine is noisy
            for w in workers:
                for name, ds in contenders.items():
                    r = timed_loader(ds, w, args.batch, args.seconds / 3, seed=rep)
                    results.setdefault(f"{name}@{w}", []).append(r["samples_s"])
    # best of the rounds, and how far the rounds of one contender lie apart (the noise to beat)
    out["results"] = {k: {"samples_s": max(v), "round_spread": round((max(v) - min(v)) / max(v), 3)}
                      for k, v in results.items()}
    results = out["results"]
    out["load_avg_1min"] = round(os.getloadavg()[0], 1)
    out["ratios"] = {}
    for w in workers:
        s = {name: results[f"{name}@{w}"]["samples_s"] for name in contenders}
        out["ratios"][f"workers_{w}"] = {
            "inline_vs_mmap_copy": round(s["checks_inline"] / s["mmap_copy"], 3),
            "python_thread_vs_inline": round(s["checks_python_thread"] / s["checks_inline"], 3),
            "checks_off_vs_mmap_copy": round(s["checks_off"] / s["mmap_copy"], 3)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
