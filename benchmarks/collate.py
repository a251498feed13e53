"""The trainer's collator against the one it replaced, through a DataLoader, at the reference width.

    python benchmarks/collate.py [--workers 0,2] [--batch 8] [--batches 24] [--rounds 3]

Samples are made once in memory (bf16 bits as in the cache: layers [1, 9, 17, 25, 33] + last at
H = 2,560, 600 to 1,400 tokens), so the loader's work is the collation and, with workers, the trip
to the training process. Contenders, interleaved, best of --rounds for each worker count:
  zero_then_copy  the earlier collator: every output made with torch.zeros, then the samples copied
                  in (in a worker, torch then copies the batch once more into shared memory)
  deepspec        deepspec.loader.collate: the samples copied into uninitialised outputs, only the
                  padding zeroed, in shared memory inside a worker
Prints GB/s of batch bytes per contender and worker count, and the ratio deepspec / zero_then_copy.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepspec.loader.collate import collate  # noqa: E402

LAYERS, H = 5, 2560


def zero_then_copy(samples: list[dict]) -> dict:
    sizes = [len(s["input_ids"]) for s in samples]
    B, T = len(samples), max(sizes)
    batch = {"lengths": torch.tensor(sizes, dtype=torch.int64, device="cpu"), "tokens": sum(sizes)}
    for key, dtype in (("input_ids", torch.int32), ("loss_mask", torch.uint8)):
        out = torch.zeros((B, T), dtype=dtype, device="cpu")
        for i, s in enumerate(samples):
            out[i, :len(s[key])] = s[key]
        batch[key] = out
    out = torch.zeros((B, T, LAYERS * H), dtype=samples[0]["hidden"].dtype, device="cpu")
    for i, s in enumerate(samples):
        n = s["hidden"].shape[1]
        out[i, :n].view(n, LAYERS, H).copy_(s["hidden"].transpose(0, 1))
    batch["hidden"] = out
    out = torch.zeros((B, T, H), dtype=samples[0]["last_hidden"].dtype, device="cpu")
    for i, s in enumerate(samples):
        out[i, :len(s["last_hidden"])] = s["last_hidden"]
    batch["last_hidden"] = out
    return batch


class InMemory(Dataset):
    def __init__(self, n: int, seed: int = 0):
        rng = random.Random(seed)
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.samples = []
        for _ in range(n):
            t = rng.randint(600, 1400)
            self.samples.append({
                "input_ids": torch.randint(0, 150_000, (t,), dtype=torch.int32, generator=g, device="cpu"),
                "loss_mask": torch.ones(t, dtype=torch.uint8, device="cpu"),
                "hidden": torch.randint(0, 2**15, (LAYERS, t, H), dtype=torch.int16, generator=g, device="cpu"),
                "last_hidden": torch.randint(0, 2**15, (t, H), dtype=torch.int16, generator=g, device="cpu")})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]


def nbytes(batch: dict) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


def gb_s(ds: Dataset, fn, workers: int, batch: int, batches: int) -> float:
    order = list(range(len(ds)))
    random.Random(1).shuffle(order)
    sampler = [order[i * batch:(i + 1) * batch] for i in range(batches)]
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=fn, num_workers=workers,
                        persistent_workers=workers > 0, prefetch_factor=2 if workers else None)
    for _ in loader:  # start the workers
        pass
    t0, total = time.perf_counter(), 0
    for b in loader:
        total += nbytes(b)
    return total / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ds = InMemory(args.batch * args.batches)
    contenders = {"zero_then_copy": zero_then_copy, "deepspec": collate}
    best: dict = {}
    for _ in range(args.rounds):
        for w in (int(x) for x in args.workers.split(",")):
            for name, fn in contenders.items():
                v = gb_s(ds, fn, w, args.batch, args.batches)
                best[(name, w)] = max(best.get((name, w), 0.0), v)
    print(f"{'workers':<8} {'zero_then_copy':>15} {'deepspec':>10} {'ratio':>7}   (GB/s of batch bytes, best of "
          f"{args.rounds})")
    for w in (int(x) for x in args.workers.split(",")):
        a, b = best[("zero_then_copy", w)], best[("deepspec", w)]
        print(f"{w:<8} {a:>15.2f} {b:>10.2f} {b / a:>7.2f}")
        print(f"FIGURE collate.workers_{w}.ratio = {b / a:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
