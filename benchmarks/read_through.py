"""train.capture: read-through against offline (cache stage, then train), side by side in one run.

    python benchmarks/read_through.py [--cpu] [--rows N] [--steps N] [--window-parts W] [--capture-only]

On builtin:tiny (the embedded default's target, from the repo's DVC remote) and on a random target
of Qwen3-4B's width and vocabulary (a few layers; gpu_check.wide_target), the same regen rows go
through, in order:
- offline: the cache stage's build of a new store, then training on it;
- read-through: the cache stage's plan, then training on a new store that the run fills
  (cache/build/fill.py), capture on a thread of the training process;
- read-through with one capture rank: the same under torchrun with 2 processes, rank 1 capturing
  (cache/build/fill_ranks.py) and rank 0 training; its times count from the launch, so they include
  the two processes' start-up (imports, the target and the draft loaded again). On a GPU it needs
  two (NCCL puts no two ranks on one GPU);
- a second experiment (half the learning rate) in each mode, on the store its first one left (the
  read-through one as stages/train.py runs it: the store is full, so it is read as offline);
- capture alone against capture with its write-back: every planned part's forward passes with the
  states copied to the host, without a writer and with each kind of writer committing each part to
  a new store (a CacheWriter's threads in this process, a ProcessWriter), three interleaved rounds
  (an overhead is the median of the rounds' ratios; the one reported first is the writer the cache
  stage uses on this device, devices.separate_writer); the writer writes on as many threads as the
  cache stage's (devices.writer_threads). `--capture-only` runs this alone.
Prints per target: time to the first optimizer step and wall time of each run, the target forwards
each ran, the write-back's cost over capture alone, the data-wait fraction of each second experiment
(the store full), and whether the first drafts are equal (bit for bit on a CPU). The capture-rank
run's draft is trained in another process: on a CPU with more than one thread, two processes that
train the same draft on the same store differ in the last bits (an offline run in a fresh process
does too), and on a CPU each of its processes runs on half the threads; its draft is compared only
on a GPU (tests/train/test_read_through.py checks it bit for bit on a CPU, with one thread).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import gpu_check  # noqa: E402
from deepspec.train.callbacks import Callback  # noqa: E402

LAYERS = {"tiny": [1, 9, 17, 25, 33], "wide": [0, 1, 2]}
SIZES = {
    "cuda": {"tiny_rows": 1024, "wide_rows": 384, "batch_tokens": 65536, "part_tokens": 16384,
             "train": dict(batch_size=8, anchors_per_sample=64, block_size=7, markov_rank=128, num_workers=4),
             "wide": gpu_check.SIZES["cuda"]["wide"]},
    "cpu": {"tiny_rows": 192, "wide_rows": 96, "batch_tokens": 4096, "part_tokens": 2048,
            "train": dict(batch_size=4, anchors_per_sample=8, block_size=4, markov_rank=16, num_workers=0),
            "wide": gpu_check.SIZES["cpu"]["wide"]},
}


class FirstStep(Callback):
    """When the first optimizer step of the run ended."""

    def __init__(self, clock):
        self.clock, self.at = clock, None

    def on_step_end(self, trainer, metrics):
        if self.at is None:
            self.at = self.clock.now()


def train(work: Path, name: str, cfg, layers, target: Path, device, clock, t0: float, url=None, fill=None) -> dict:
    """One train stage run as stages/train.py runs it (build_trainer, fit, the store finished)."""
    from deepspec.cache.read.reader import CacheReader
    from deepspec.train.run import build_trainer

    manifest = None if fill is not None else dict(CacheReader(url).manifest)
    trainer = build_trainer(cfg, layers, url, target, work / f"train-{name}", work / f"state-{name}", device=device,
                            manifest=manifest, fill=fill)
    first = FirstStep(clock)
    # the run's own timing, not dvclive's files (a GPU machine may lack dvclive)
    trainer.callbacks = [cb for cb in trainer.callbacks if type(cb).__name__ != "DvcLiveMetrics"] + [first]
    final = trainer.fit()
    counts = {"target_forwards": 0}
    if fill is not None:
        fill.finish()
        counts = fill.counts()
    trainer.model.save(work / f"draft-{name}")
    end = clock.now()
    return {"first_step_s": round(first.at - t0, 2), "wall_s": round(end - t0, 2),
            "target_forwards": counts["target_forwards"], "data_wait_fraction": final["data_wait_fraction"],
            "tokens": final["tokens"]}


class WallClock(gpu_check.Clock):
    """Seconds since the epoch (after the device's queue drains): comparable across processes."""

    def now(self) -> float:
        super().now()
        return time.time()


def ranks_child(spec_path: Path) -> int:
    """One process of the capture-rank run (under torchrun, 2 processes): rank 1 captures, rank 0
    trains and writes its result beside the spec."""
    from deepspec.cache.build.fill_ranks import RanksFill, capture
    from deepspec.config import CacheConfig, TrainConfig
    from deepspec.distributed import launch, split

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])  # the parent's: a CPU's thread count is in the store's name
    work, target, regen, layers = Path(spec["work"]), Path(spec["target"]), Path(spec["regen"]), spec["layers"]
    with launch(600) as d:
        roles = split(d, 1, 3600)
        if roles.capturing:
            capture(CacheConfig(**spec["cache"]), layers, regen, target, roles, spec["recorded"], "the plan",
                    work / "index.npz")
            return 0
        fill = RanksFill(roles, target)
        fill.plan()
        device = roles.own.device
        res = train(work, "ranks", TrainConfig(**spec["train"]), layers, target, device, WallClock(device),
                    spec["t0"], fill=fill)
        res["wait_for_parts_s"] = fill.counts()["wait_for_parts_s"]
        (work / "ranks.json").write_text(json.dumps(res))
    return 0


def ranks_run(work: Path, cache, cfg, layers, regen: Path, target: Path, device) -> dict | None:
    """train.capture_ranks: 1 as the train stage runs it: a plan, then torchrun with 2 processes. On a
    CPU each process gets its share of this process's threads (the two roles split the cores, as they
    split GPUs); a CPU's thread count is in the store's name, so the plan is made with that share."""
    import dataclasses
    import subprocess

    from deepspec.cache.build.stage import plan_cache
    from deepspec.data.servers import free_port

    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return None
    threads = torch.get_num_threads()
    share = max(1, threads // 2) if device.type == "cpu" else threads
    cache = dataclasses.replace(cache, url=str(work / "ranks.zarr"))
    torch.set_num_threads(share)
    try:
        recorded = plan_cache(cache, layers, regen, target, device, keep_index=work / "index.npz")["manifest"]
    finally:
        torch.set_num_threads(threads)
    spec = work / "ranks-spec.json"
    spec.write_text(json.dumps({"work": str(work), "target": str(target), "regen": str(regen), "layers": layers,
                                "cache": dataclasses.asdict(cache), "train": dataclasses.asdict(cfg),
                                "recorded": recorded, "threads": share, "t0": time.time()}))
    env = dict(os.environ, OMP_NUM_THREADS=str(share))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                    str(free_port()), __file__, "--ranks-child", str(spec)], check=True, env=env)
    return dict(json.loads((work / "ranks.json").read_text()), threads=share)


def capture_cost(work: Path, cache_cfg, layers, regen: Path, target: Path, device, clock) -> dict:
    """Every planned part's forward passes, states to the host, without a writer and with each kind
    (a CacheWriter's threads in this process, a ProcessWriter); the overhead reported is that of the
    kind the cache stage uses on this device (devices.separate_writer)."""
    import dataclasses
    import statistics

    from deepspec.cache.build import stage
    from deepspec.cache.build.regen_rows import EncodeRules, part_samples
    from deepspec.devices import separate_writer, writer_threads
    from deepspec.models.target import load_identity

    ident = load_identity(target)
    tokenizer, model = stage.load_target(target, device, stage.compute_of(cache_cfg, target, device))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    index, _ = stage.index_input(tokenizer, regen, cache_cfg)
    plan = stage.plan_store(index, stage.part_tokens_for(cache_cfg, ident["hidden_size"]))
    parts = list(part_samples(tokenizer, index, plan, EncodeRules.of(cache_cfg)))
    # warm-up: kernels chosen for these shapes
    stage.compute_part(model, parts[0][0], parts[0][1], layers, cache_cfg.batch_tokens, pad, device, cache_cfg.dtype)
    out = {}
    for rep in range(3):  # interleaved: capture alone, then with each writer, three times
        t = clock.now()
        for name, samples in parts:
            stage.compute_part(model, name, samples, layers, cache_cfg.batch_tokens, pad, device, cache_cfg.dtype)
        out.setdefault("alone", []).append(clock.now() - t)
        for kind in ("thread", "process"):
            url = work / f"writeback-{kind}{rep}.zarr"
            cfg = dataclasses.replace(cache_cfg, url=str(url))
            writer = stage.new_writer(kind == "process", str(url), stage.cache_manifest(
                cfg, layers, ident, stage.compute_of(cfg, target, device)), threads=writer_threads(device))
            t = clock.now()  # from the writer open (a process's start-up is in the stage's time too)
            for name, samples in parts:
                stage.compute_part(model, name, samples, layers, cfg.batch_tokens, pad, device, cfg.dtype,
                                   writer=writer)
            writer.close(consolidate=False)
            out.setdefault(kind, []).append(clock.now() - t)
            writer.release()
            shutil.rmtree(url)
    # the median of each pair's ratio: a pair runs back to back, so a slow spell of the machine
    # (2 shared cores move either time by 20 %) lands on both of its runs
    ratio = {k: round(statistics.median(w / a for a, w in zip(out["alone"], out[k])) - 1, 3)
             for k in ("thread", "process")}
    chosen = "process" if separate_writer(device) else "thread"
    return {"capture_alone_s": round(statistics.median(out["alone"]), 3),
            "capture_written_s": round(statistics.median(out[chosen]), 3), "writeback_overhead": ratio[chosen],
            "writer": chosen, "overhead_by_writer": ratio, "writer_threads": writer_threads(device),
            "parts": len(parts)}


def same_draft(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def bench(kind: str, target: Path, root: Path, size: dict, args, device, clock) -> dict:
    import dataclasses

    from deepspec.cache.build.fill import StoreFill, check_plan, stored
    from deepspec.cache.build.stage import build_cache, plan_cache
    from deepspec.config import CacheConfig, TrainConfig

    work = root / kind
    work.mkdir()
    regen = work / "regen.jsonl"
    rows = gpu_check.conversations(size[f"{kind}_rows"], seed=3)
    regen.write_text("".join(json.dumps(r) + "\n" for r in rows))
    layers = LAYERS[kind]
    cache = CacheConfig(url=str(work / "offline.zarr"), batch_tokens=size["batch_tokens"],
                        part_tokens=size["part_tokens"])
    if args.capture_only:
        capture = capture_cost(work, cache, layers, regen, target, device, clock)
        return {"capture": capture, "parts": capture["parts"], "samples": len(rows), "layers": layers}
    cfg = TrainConfig(**size["train"], steps=args.steps, warmup_steps=2, window_parts=args.window_parts,
                      checkpoint_every=10 ** 6)
    second = dataclasses.replace(cfg, lr=cfg.lr / 2)
    res = {}
    t0 = clock.now()
    report = build_cache(cache, layers, regen, target, device=device)
    res["offline"] = train(work, "offline", cfg, layers, target, device, clock, t0, url=str(work / "offline.zarr"))
    res["offline"]["target_forwards"] = report["target_forwards"]
    res["offline"]["cache_stage_s"] = round(report["wall_s"], 2)
    rt_cache = dataclasses.replace(cache, url=str(work / "read_through.zarr"))
    t0 = clock.now()
    # as dvc repro runs it: the cache stage plans, then the train stage fills while it trains
    recorded = plan_cache(rt_cache, layers, regen, target, device, keep_index=work / "index.npz")["manifest"]
    fill = StoreFill(rt_cache, layers, regen, target, device, index_from=work / "index.npz")
    check_plan(fill.plan(), recorded, "the plan")
    res["read_through"] = train(work, "read_through", dataclasses.replace(cfg, capture="read-through"), layers,
                                target, device, clock, t0, fill=fill)
    res["read_through_ranks"] = ranks_run(work, cache, dataclasses.replace(cfg, capture="read-through",
                                                                           capture_ranks=1),
                                          layers, regen, target, device)
    t0 = clock.now()
    res["offline_2nd"] = train(work, "offline_2nd", second, layers, target, device, clock, t0,
                               url=str(work / "offline.zarr"))
    t0 = clock.now()
    # another learning rate: the cache stage does not run again, and the train stage finds the store full
    full = stored(recorded)
    assert full is not None, "the first read-through run left an incomplete store"
    res["read_through_2nd"] = train(work, "read_through_2nd", dataclasses.replace(second, capture="read-through"),
                                    layers, target, device, clock, t0, url=full["url"])
    res["capture"] = capture_cost(work, cache, layers, regen, target, device, clock)
    res["same_draft"] = same_draft(work / "draft-offline", work / "draft-read_through")
    if res["read_through_ranks"] is not None and res["read_through_ranks"]["threads"] == torch.get_num_threads():
        res["same_draft_ranks"] = same_draft(work / "draft-offline", work / "draft-ranks")
    res["parts"] = len(json.loads((work / "offline.zarr" / "zarr.json").read_text())["attributes"]["parts"])
    res["samples"], res["layers"] = len(rows), layers
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--window-parts", type=int, default=2)
    ap.add_argument("--only", choices=["tiny", "wide"], help="one target only")
    ap.add_argument("--capture-only", action="store_true", help="only capture alone against capture with its write-back")
    ap.add_argument("--ranks-child", type=Path, help=argparse.SUPPRESS)  # a process of ranks_run's torchrun
    args = ap.parse_args()
    if args.ranks_child:
        return ranks_child(args.ranks_child)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    size = SIZES[device.type]
    clock = gpu_check.Clock(device)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny = gpu_check.shipped_target(root / "tiny_target")
        targets = {"tiny": tiny}
        if args.only != "tiny":
            targets["wide"] = gpu_check.wide_target(root / "wide_target", tiny, size["wide"], device)
        if args.only == "wide":
            targets.pop("tiny")
        for kind, target in targets.items():
            results[kind] = r = bench(kind, target, root, size, args, device, clock)
            print(f"\n{kind}: {r['samples']} samples, {r['parts']} parts, layers {r['layers']}, {args.steps} steps, "
                  f"window_parts {args.window_parts}, {device.type}")
            print(f"{'run':<22}{'first step s':>14}{'wall s':>10}{'target forwards':>17}{'data wait':>11}")
            for run in ("offline", "read_through", "read_through_ranks", "offline_2nd", "read_through_2nd"):
                if run not in r:
                    continue
                x = r[run]
                if x is None:
                    print(f"{run:<22}(needs 2 GPUs)")
                    continue
                print(f"{run:<22}{x['first_step_s']:>14}{x['wall_s']:>10}{x['target_forwards']:>17}"
                      f"{x['data_wait_fraction']:>11}")
            c = r["capture"]
            print(f"capture alone {c['capture_alone_s']} s, with write-back {c['capture_written_s']} s "
                  f"(the stage's {c['writer']} writer, {c['writer_threads']} threads): overhead "
                  f"{100 * c['writeback_overhead']:.1f} %; by writer: "
                  + ", ".join(f"{k} {100 * v:.1f} %" for k, v in c["overhead_by_writer"].items()))
            print(f"FIGURE {kind}.writeback_overhead_pct = {100 * c['writeback_overhead']:.1f}")
            if args.capture_only:
                continue
            print(f"read-through draft equals offline draft: {r['same_draft']}"
                  + (f"; with a capture rank: {r['same_draft_ranks']}" if "same_draft_ranks" in r else ""))
            if r["read_through_ranks"] is not None:
                print(f"FIGURE {kind}.ranks_first_step_ratio = "
                      f"{r['read_through_ranks']['first_step_s'] / r['offline']['first_step_s']:.3f}")
            ratio = r["read_through"]["first_step_s"] / r["offline"]["first_step_s"]
            print(f"FIGURE {kind}.first_step_ratio = {ratio:.3f}")
            print(f"FIGURE {kind}.second_forwards = {r['read_through_2nd']['target_forwards']}")
            print(f"FIGURE {kind}.same_draft = {r['same_draft']}")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
