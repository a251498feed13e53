"""Where the GPU seconds go, each as a ratio beside its goal, in one command (issue: every GPU second
goes to a forward or a step).

    make gpu-goals                    # on a GPU machine (installs .gpu-wheels first, as gpu-check does)
    make gpu-goals CPU=1              # the same script on the CPU, small sizes (part of `make test`)
    python benchmarks/gpu_goals.py [--cpu] [--out DIR] [--only SECTION,...]

On the shipped `builtin:tiny` and on a random target of Qwen3-4B's width (gpu_check's two targets):
- capture: tokens/s of the cache's capture (forward + hooks + encoding + pinned copies, waited for)
  against a plain forward of the same batches (gpu_check.check_cache); goal >= 0.95 at Qwen3-4B's width;
- writeback: every planned part captured with the cache stage's writer committing it, against the
  same capture with no writer (read_through.capture_cost); goal <= 1.05;
- compile: steady tokens/s of a compiled training step against the eager one on the same batches,
  the compile time and the graphs compiled (compile_step.passes); goal > 1 where `auto` compiles;
- train: steps with the real loader and default params (train.compile auto) against the same batches
  already on the device (gpu_check.check_train); goal >= 0.95 at both widths;
- host: dispatched ops, value reads and host ms per optimizer step (host_work.measure), no goal;
- read-through: on the tiny target, an offline run (cache stage, then train) and a read-through run
  (train fills the store) in a process of their own with `torch.use_deterministic_algorithms` (warn
  only: a CUDA op with no deterministic kernel is named, not fatal): the hash of every batch each
  trained on, in order, must be equal; the drafts are compared bit for bit, and the ops torch warned
  about are listed when they differ.
Prints each section as it ends, then the goals table; writes the whole as JSON to `--out DIR/gpu_goals.json`.
Exits 0 whether or not a goal is met (the table says which): a goal is a measurement, not a test.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import gpu_check  # noqa: E402

LAYERS = {"tiny": [1, 9, 17, 25, 33], "wide": [0, 1, 2]}
SECTIONS = ("capture", "writeback", "compile", "train", "host", "read-through")
STEPS = {"cuda": 20, "cpu": 3}


def targets(tmp: Path, device: torch.device) -> dict:
    """Both targets on CUDA; on the CPU (the script's check in `make test`) the tiny one: every section
    runs, and gpu_check's own CPU run covers the wide target's making."""
    size = gpu_check.SIZES[device.type]
    tiny = gpu_check.shipped_target(tmp / "tiny")
    if device.type != "cuda":
        return {"tiny": tiny}
    return {"wide": gpu_check.wide_target(tmp / "wide", tiny, size["wide"], device), "tiny": tiny}


def prepared(tmp: Path, kind: str, target: Path, device: torch.device) -> Path:
    """work dir of `kind` with regen.jsonl and cache.zarr (built once, shared by the sections)."""
    work = tmp / f"work-{kind}"
    if (work / "cache.zarr").exists():
        return work
    rows = gpu_check.SIZES[device.type][f"{kind}_rows"]
    return gpu_check.cached(work, target, rows, len(kind), device, LAYERS[kind], max_length=1024)


def section_capture(tmp, kind, target, device) -> dict:
    size = gpu_check.SIZES[device.type]
    work = tmp / f"capture-{kind}"
    work.mkdir()
    rows = gpu_check.conversations(size[f"{kind}_rows"], seed=len(kind))
    out = gpu_check.check_cache(work, target, LAYERS[kind], rows, size, device)
    return {"ratio": out["capture_vs_plain"], **out}


def section_writeback(tmp, kind, target, device) -> dict:
    import read_through
    from deepspec.config import CacheConfig

    work = prepared(tmp, kind, target, device)
    size = read_through.SIZES[device.type]
    cache = CacheConfig(url=str(work / "wb.zarr"), batch_tokens=size["batch_tokens"], part_tokens=size["part_tokens"])
    out = read_through.capture_cost(work, cache, LAYERS[kind], work / "regen.jsonl", target, device,
                                    gpu_check.Clock(device))
    return {"ratio": round(1 + out["writeback_overhead"], 3), **out}


def section_compile(tmp, kind, target, device) -> dict:
    import compile_step
    from torch._dynamo.utils import counters

    work = prepared(tmp, kind, target, device)
    size = gpu_check.SIZES[device.type]
    train = dict(size["train"], draft_layers=1, lr=1e-3, warmup_steps=1)
    steps = STEPS[device.type] * 2 if device.type == "cuda" else 2  # the compile dominates on the CPU
    graphs = counters["stats"]["unique_graphs"]
    eager = compile_step.passes(work, target, train, "dspark", False, steps, device, LAYERS[kind])
    compiled = compile_step.passes(work, target, train, "dspark", True, steps, device, LAYERS[kind])
    return {"ratio": None, **compile_step.compare(eager, compiled, steps),
            "graphs": counters["stats"]["unique_graphs"] - graphs}


def section_train(tmp, kind, target, device) -> dict:
    work = prepared(tmp, kind, target, device)
    size = gpu_check.SIZES[device.type]
    out, _ = gpu_check.check_train(work, target, LAYERS[kind], dict(size, steps=STEPS[device.type]), device)
    return {"ratio": out["loader_vs_resident"], **out}


def section_host(tmp, kind, target, device) -> dict:
    import host_work

    work = prepared(tmp, kind, target, device)
    return {"ratio": None, **host_work.measure(work, target, "dspark", "auto", STEPS[device.type], device,
                                                LAYERS[kind])}


def batch_hashes(trainer) -> list[str]:
    """Wraps `trainer.batches` so that every batch it yields is hashed, in order, into the list returned."""
    seen: list[str] = []
    batches = trainer.batches

    def hashing():
        for b in batches():
            h = hashlib.sha256()
            for k in ("lengths", "input_ids", "loss_mask", "hidden", "last_hidden"):
                t = b[k].detach().cpu().contiguous()
                h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes())
            seen.append(h.hexdigest()[:16])
            yield b
    trainer.batches = hashing
    return seen


def read_through_child(out_path: Path, device: torch.device) -> int:
    """The read-through section's own process: deterministic algorithms on from the start."""
    import dataclasses

    from deepspec.cache.build.fill import StoreFill, check_plan
    from deepspec.cache.build.stage import build_cache, plan_cache
    from deepspec.cache.read.reader import CacheReader
    from deepspec.config import CacheConfig, TrainConfig
    from deepspec.train.run import build_trainer

    torch.use_deterministic_algorithms(True, warn_only=True)
    import read_through

    size = read_through.SIZES[device.type]
    with tempfile.TemporaryDirectory(prefix="gpu-goals-rt-") as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tmp = Path(tmp)
        target = gpu_check.shipped_target(tmp / "tiny")
        regen = tmp / "regen.jsonl"
        rows = size["tiny_rows"] // 2 if device.type == "cuda" else 32  # on the CPU: that the section runs
        regen.write_text("".join(json.dumps(r) + "\n" for r in gpu_check.conversations(rows, seed=3)))
        layers = LAYERS["tiny"]
        cache = CacheConfig(url=str(tmp / "offline.zarr"), batch_tokens=size["batch_tokens"],
                            part_tokens=size["part_tokens"])
        # the order a read-through run takes by default, given to both runs
        cfg = TrainConfig(**size["train"], steps=STEPS[device.type] * 2, warmup_steps=2, checkpoint_every=10 ** 6,
                          window_parts="growing")
        build_cache(cache, layers, regen, target, device=device)
        runs = {}
        for name in ("offline", "read_through"):
            fill, url, manifest, run_cfg = None, str(tmp / "offline.zarr"), None, cfg
            if name == "read_through":
                rt = dataclasses.replace(cache, url=str(tmp / "rt.zarr"))
                recorded = plan_cache(rt, layers, regen, target, device, keep_index=tmp / "index.npz")["manifest"]
                fill = StoreFill(rt, layers, regen, target, device, index_from=tmp / "index.npz")
                check_plan(fill.plan(), recorded, "the plan")
                run_cfg = dataclasses.replace(cfg, capture="read-through")
            else:
                manifest = dict(CacheReader(url).manifest)
            trainer = build_trainer(run_cfg, layers, url, target, tmp / f"train-{name}", tmp / f"state-{name}",
                                    device=device, manifest=manifest, fill=fill)
            trainer.callbacks = [cb for cb in trainer.callbacks if type(cb).__name__ != "DvcLiveMetrics"]
            hashes = batch_hashes(trainer)
            trainer.fit()
            if fill is not None:
                fill.finish()
            trainer.model.save(tmp / f"draft-{name}")
            runs[name] = hashes
        same_batches = runs["offline"] == runs["read_through"] and len(runs["offline"]) > 0
        same = read_through.same_draft(tmp / "draft-offline", tmp / "draft-read_through")
        nondeterministic = sorted({str(w.message).split(" does not have a deterministic")[0]
                                   for w in caught if "deterministic" in str(w.message)})
    out_path.write_text(json.dumps({"batches": len(runs["offline"]), "same_batches": same_batches, "same_draft": same,
                                    "nondeterministic_ops": nondeterministic}))
    return 0


def section_read_through(tmp, device) -> dict:
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")  # cuBLAS's deterministic mode needs it before start
    out = tmp / "read-through.json"
    cmd = [sys.executable, __file__, "--read-through-child", str(out)] + (["--cpu"] if device.type == "cpu" else [])
    subprocess.run(cmd, check=True, env=env)
    res = json.loads(out.read_text())
    return {"ratio": None, **res}


GOALS = [  # (section, target, what, limit in words, test of the measured value)
    ("capture", "wide", "capture vs plain forward", ">= 0.95", lambda r: r["ratio"] >= 0.95),
    ("capture", "tiny", "capture vs plain forward", ">= 0.95", lambda r: r["ratio"] >= 0.95),
    ("writeback", "wide", "capture with write-back vs alone", "<= 1.05", lambda r: r["ratio"] <= 1.05),
    ("writeback", "tiny", "capture with write-back vs alone", "<= 1.05", lambda r: r["ratio"] <= 1.05),
    ("compile", "wide", "compiled vs eager step", "> 1", lambda r: r["compiled_vs_eager"] > 1),
    ("compile", "tiny", "compiled vs eager step", "> 1", lambda r: r["compiled_vs_eager"] > 1),
    ("train", "wide", "loader vs resident (defaults)", ">= 0.95", lambda r: r["ratio"] >= 0.95),
    ("train", "tiny", "loader vs resident (defaults)", ">= 0.95", lambda r: r["ratio"] >= 0.95),
    ("read-through", "tiny", "read-through batches == offline", "equal", lambda r: r["same_batches"]),
    ("read-through", "tiny", "read-through draft == offline", "equal", lambda r: r["same_draft"]),
]
SHOWN = {"capture": "ratio", "writeback": "ratio", "compile": "compiled_vs_eager", "train": "ratio",
         "read-through": None}


def table(results: dict) -> list[str]:
    lines = [f"{'goal':<46}{'measured':>12}{'limit':>10}{'met':>6}"]
    for section, kind, what, limit, met in GOALS:
        r = results.get(f"{section}.{kind}") if section != "read-through" else results.get("read-through")
        if r is None:
            continue
        if "error" in r:
            lines.append(f"{what + ' (' + kind + ')':<46}{'error':>12}{limit:>10}{'-':>6}")
            continue
        key = SHOWN[section] or ("same_batches" if "batches" in what else "same_draft")
        lines.append(f"{what + ' (' + kind + ')':<46}{str(r[key]):>12}{limit:>10}{'yes' if met(r) else 'NO':>6}")
    host = {k: v for k, v in results.items() if k.startswith("host.") and "error" not in v}
    for k, r in host.items():
        lines.append(f"host work per step ({k[5:]}): {r['ops']} ops ({r['trainer_ops']} around the model), "
                     f"{r['value_reads']} value reads, {r['host_ms']} host ms")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU at small sizes (what `make test` runs)")
    ap.add_argument("--out", type=Path, help="write gpu_goals.json here")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    ap.add_argument("--read-through-child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from deepspec.devices import local_device

    device = torch.device("cpu") if args.cpu else local_device()
    if args.read_through_child:
        return read_through_child(args.read_through_child, device)
    if device.type != "cuda" and not args.cpu:
        print("gpu_goals: no CUDA device here; `make gpu-goals CPU=1` runs the CPU version", file=sys.stderr)
        return 2
    only = args.only.split(",")
    results: dict = {"env": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                             "torch": torch.__version__, "cuda": torch.version.cuda}}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-goals-") as tmp:
        tmp = Path(tmp)
        import compile_step

        compile_step.cold_caches(tmp)  # the compile's seconds as a fresh machine pays them
        models = targets(tmp, device)
        runs = [(s, k) for s in SECTIONS if s in only and s != "read-through" for k in models]
        for section, kind in runs + ([("read-through", None)] if "read-through" in only else []):
            key = section if kind is None else f"{section}.{kind}"
            t0 = time.perf_counter()
            try:
                if section == "read-through":
                    value = section_read_through(tmp, device)
                else:
                    fn = globals()[f"section_{section}"]
                    value = fn(tmp, kind, models[kind], device)
                value["seconds"] = round(time.perf_counter() - t0, 1)
            except Exception:  # noqa: BLE001 - reported in the table
                value = {"error": traceback.format_exc()[-2000:]}
            results[key] = value
            print(f"{key}: {json.dumps(value)}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    lines = table(results)
    print(f"\ngoals on {results['env']['device']} ({results['seconds']} s):")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_goals.json").write_text(json.dumps(results, indent=1))
    errors = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    print(f"\ngpu_goals: {'errors in ' + ', '.join(errors) if errors else 'every section ran'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
