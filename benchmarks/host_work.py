"""What the host does per optimizer step around the draft's own math: dispatched ops, allocations,
value reads (device syncs on CUDA), pinned copies and host milliseconds, split into the model's
forward + backward and the trainer's work around it.

    python benchmarks/host_work.py [--cpu] [--steps 8] [--algorithms dspark,eagle3] [--compile auto,true] [--label L]

builtin:tiny (from the repo's DVC remote, as gpu_check does) caches a few hundred conversations, then a
trainer with gpu_check's train sizes runs warm-up steps and `--steps` measured steps over batches already
on the device (so the loader is not counted). Every aten op dispatched (forward, autograd's backward, the
optimizer, the step's metrics, the anchor draw) is counted by a dispatch mode: on a GPU each is about one
kernel launch and some host time. Allocations are op outputs in storage none of the op's inputs held.
"Value reads" are the ops whose result the host waits for, asked by deepspec's code (a device sync on
CUDA: `_local_scalar_dense`, `nonzero`, indexing with a bool mask). The same counts for the model's
forward and backward alone, on the same micro-batches with the same anchors, give what the trainer adds.
A compiled step's kernels are not dispatched op by op, so it is counted only by its kernel launches (on
CUDA, the profiler's launch events) and its host time. Host ms per step: on CUDA the time the step's
Python takes until it returns (the GPU runs behind), on the CPU the step's wall time (math included).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import gpu_check  # noqa: E402

LAYERS = [1, 9, 17, 25, 33]
READS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "item", "unique"}


class OpCount(TorchDispatchMode):
    """Counts every aten op dispatched below autograd, the new storage they allocate, and the reads of a
    value by the host that deepspec's own code makes (a read inside torch, such as AdamW's step counter,
    reads a tensor torch keeps on the host on every device: never a device sync)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.reads = 0
        self.pins = 0
        self.allocations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.ops[name] += 1
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
            if i is not None)
        if (name in READS or bool_index) and _asked_by_deepspec():
            self.reads += 1
        if name in ("_pin_memory", "pin_memory"):
            self.pins += 1
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        self.allocations += sum(1 for t in _tensors(out) if t.untyped_storage().data_ptr() not in given
                                and t.untyped_storage().nbytes() > 0)
        return out


def _asked_by_deepspec() -> bool:
    """Whether the innermost frame outside the dispatch machinery is deepspec's (not torch's own)."""
    machinery = (f"torch{os.sep}_compile.py", f"torch{os.sep}_dynamo{os.sep}", "_python_dispatch.py",
                 f"torch{os.sep}utils{os.sep}_contextlib.py", "host_work.py")
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(m in frame.filename for m in machinery):
            return f"{os.sep}deepspec{os.sep}" in frame.filename
    return False


def _tensors(tree):
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def measure(work: Path, target: Path, algorithm: str, compile_: str, steps: int, device: torch.device,
            layers: list[int] = LAYERS) -> dict:
    """Counts and times of `steps` trainer steps on work/cache.zarr over resident batches, and of the model
    alone."""
    from deepspec.config import TrainConfig
    from deepspec.models.objectives import anchor_generator, sample_anchors
    from deepspec.train.run import build_trainer

    size = gpu_check.SIZES[device.type]
    clock = gpu_check.Clock(device)
    cfg = TrainConfig(**dict(size["train"], num_workers=0), algorithm=algorithm, steps=10 ** 6, warmup_steps=1,
                      lr=1e-3, draft_layers=1,
                      **({} if compile_ == "auto" else {"compile": compile_ == "true"}))
    layers = gpu_check.eagle3_layers(layers) if algorithm == "eagle3" else layers
    trainer = build_trainer(cfg, layers, str(work / "cache.zarr"), target, work / f"train-{algorithm}",
                            work / f"state-{algorithm}-{compile_}", device=device)
    trainer.module.train()
    warm = 3
    resident = gpu_check.resident(trainer, (warm + 2 * steps) * cfg.grad_accum)
    batches = iter(resident)
    t0 = time.perf_counter()
    for _ in range(warm):
        trainer.step(batches)
    clock.now()
    warm_s = time.perf_counter() - t0
    measured = resident[warm * cfg.grad_accum:]

    # host time first (the counting below costs host time, and a compiled step under a dispatch mode
    # runs eager from then on)
    host, wall = [], []
    for _ in range(steps):
        t = time.perf_counter()
        trainer.step(batches)
        host.append(time.perf_counter() - t)
        clock.now()
        wall.append(time.perf_counter() - t)
    out = {"host_ms": round(1000 * sorted(host)[steps // 2], 2), "wall_ms": round(1000 * sorted(wall)[steps // 2], 2),
           "launches": None}
    if device.type == "cuda":  # what reaches the GPU: kernel launches per step, compiled or not
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                trainer.step(batches)
            clock.now()
        out["launches"] = round(sum(1 for e in prof.events() if "LaunchKernel" in e.name) / steps, 1)
    compiled = getattr(trainer, "compiled", False)
    if compiled:  # a compiled graph's kernels are not dispatched op by op: only the launches count them
        return {"algorithm": algorithm, "compile": compile_, "compiled": True, "steps": steps,
                "grad_accum": cfg.grad_accum, "batch_size": cfg.batch_size, "warm_up_s": round(warm_s, 2), **out}

    # the whole step: ops, allocations and reads
    with OpCount() as step_count:
        for _ in range(steps):
            trainer.step(batches)
    clock.now()

    # the model alone: forward + backward of the same micro-batches with anchors drawn beforehand
    micro = measured[:steps * cfg.grad_accum]
    anchors = [sample_anchors(b["loss_mask"], b["lengths"].to(device), cfg.anchors_per_sample,
                              anchor_generator(cfg.seed, 0, m, 0)) for m, b in enumerate(micro)]
    with OpCount() as model_count:
        for b, a in zip(micro, anchors):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = trainer.module(b, a, cfg.ce_weight, cfg.l1_weight, cfg.conf_weight, cfg.decay_gamma, norm=1.0)
                loss.loss.backward()
        trainer.optimizer.zero_grad(set_to_none=True)
    clock.now()
    per = lambda v: round(v / steps, 1)  # noqa: E731
    step_ops, model_ops = sum(step_count.ops.values()), sum(model_count.ops.values())
    return {"algorithm": algorithm, "compile": compile_, "compiled": False, "steps": steps,
            "grad_accum": cfg.grad_accum, "batch_size": cfg.batch_size, "warm_up_s": round(warm_s, 2),
            "ops": per(step_ops), "model_ops": per(model_ops), "trainer_ops": per(step_ops - model_ops),
            "allocations": per(step_count.allocations), "model_allocations": per(model_count.allocations),
            "value_reads": per(step_count.reads), "model_value_reads": per(model_count.reads),
            "pinned_copies": per(step_count.pins), **out,
            "trainer_ops_by_name": dict((step_count.ops - model_count.ops).most_common(10))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--algorithms", default="dspark,eagle3")
    ap.add_argument("--compile", default="auto",
                    help="train.compile settings to measure, comma-separated (auto, true, false)")
    ap.add_argument("--label", default="now", help="the figures' middle name (before, after, ...)")
    args = ap.parse_args()
    from deepspec.devices import local_device

    device = torch.device("cpu") if args.cpu else local_device()
    rows = []
    with tempfile.TemporaryDirectory(prefix="host-work-") as tmp:
        tmp = Path(tmp)
        tiny = gpu_check.tiny_store(tmp, args.rows, 4, device, LAYERS, max_length=1024)
        for algorithm in args.algorithms.split(","):
            for compile_ in args.compile.split(","):
                rows.append(measure(tmp, tiny, algorithm, compile_, args.steps, device))
                print(json.dumps(rows[-1]), flush=True)
    keys = ("ops", "model_ops", "trainer_ops", "allocations", "value_reads", "pinned_copies", "launches", "host_ms")
    print(f"\nper optimizer step on {device} (grad_accum {rows[0]['grad_accum']}, batch {rows[0]['batch_size']}):")
    print(f"{'algorithm':<18}" + "".join(f"{k:>14}" for k in keys))
    for r in rows:
        tag = r["algorithm"] + (" compiled" if r["compiled"] else "")
        print(f"{tag:<18}" + "".join(f"{str(r.get(k, '-')):>14}" for k in keys))
        key = r["algorithm"] + (".compiled" if r["compiled"] else "")
        for k in ("ops", "trainer_ops", "value_reads", "launches", "host_ms"):
            if r.get(k) is not None:
                print(f"FIGURE host_work.{args.label}.{key}.{k} = {r[k]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
