"""A derived cache vs one computed from scratch, measured side by side in one run through the cache stage.

    python benchmarks/cache_derive.py [--target data/target --regen data/regen/train.jsonl] [--rows N]

Runs `stages/cache.py` (the whole stage: imports, tokenising, the store) in scratch work dirs:
  1. the superset, layers [1, 9, 17, 25, 33], computed;
  2. layers [9, 25]: derived from (1) in place (what `dvc exp run -S 'layers=[9,25]'` runs), and
     computed from scratch (`cache.derive_from: none`) — the two stores must be equal file for file;
  3. `cache.dtype: fp8` on the default layers: derived from (1) and computed — equal too.
Prints each stage's wall time, the derive's own `wall_s` from report.json and the build's, and the
ratios (issue 16's goal for the layer subset: derive < 10% of a from-scratch build, stage < 30%).
Without --target it uses a random-weight model of the embedded default's shape (36 layers, width
128; the values do not matter for timing) over the packaged corpus's train rows as regen rows.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SUPERSET, SUBSET = [1, 9, 17, 25, 33], [9, 25]


def random_target(out: Path, rows: list[dict]) -> Path:
    import torch
    from transformers import Qwen3ForCausalLM

    from deepspec.config import TinyTargetConfig
    from deepspec.io import write_json
    from deepspec.models.target import identity
    from deepspec.embedded.tiny import build_config, build_tokenizer, conversation_text

    cfg = TinyTargetConfig()
    tok = build_tokenizer([conversation_text(r["conversations"]) for r in rows[:2000]], cfg.vocab_size)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(build_config(cfg, tok))
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    write_json(out / "identity.json", identity(out))
    return out


def files(store: Path) -> dict[str, str]:
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file() and p.relative_to(store) != Path("zarr.json")}


def stage(work: Path, layers: list[int], **cache) -> tuple[float, dict]:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["layers"] = layers
    params["cache"].update(cache)
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    env = dict(os.environ, PYTHONPATH=str(REPO), DEEPSPEC_LOG="WARNING")
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(REPO / "stages" / "cache.py")], cwd=work, env=env, text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        raise SystemExit(f"cache stage failed in {work}:\n{proc.stderr[-3000:]}")
    seconds = time.time() - t0
    report = json.loads((work / "data/cache/report.json").read_text())
    # the stage keeps its timings in metrics.json (report.json is a function of the input alone)
    timings = json.loads((work / "data/cache/metrics.json").read_text())
    report["wall_s"] = timings["wall_s"]
    if isinstance(report.get("derive"), dict) and "derive_wall_s" in timings:
        report["derive"]["wall_s"] = timings["derive_wall_s"]
    return seconds, report


def workdir(root: Path, name: str, target: Path, regen: Path) -> Path:
    work = root / name
    (work / "data" / "regen").mkdir(parents=True)
    os.symlink(target.resolve(), work / "data" / "target")
    shutil.copy(regen, work / "data" / "regen" / "train.jsonl")
    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path)
    parser.add_argument("--regen", type=Path)
    parser.add_argument("--rows", type=int, default=0, help="use the first N regen rows (0 = all)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cache_derive_"))
    try:
        if args.target is None:
            from deepspec.config import SplitConfig
            from deepspec.embedded.tiny import builtin_train_rows

            rows = builtin_train_rows(SplitConfig())
            target = random_target(root / "target", rows)
            regen = root / "regen.jsonl"
            regen.write_text("".join(json.dumps(r) + "\n" for r in rows[:args.rows or None]))
        else:
            target, regen = args.target, args.regen or Path("data/regen/train.jsonl")
            if args.rows:
                lines = regen.read_text().splitlines(keepends=True)[:args.rows]
                regen = root / "regen.jsonl"
                regen.write_text("".join(lines))
        derived = workdir(root, "derived", target, regen)
        full_s, full = stage(derived, SUPERSET)
        superset = derived / "data" / "cache.zarr"
        fp8_src = root / "superset.zarr"
        subprocess.run(["cp", "-a", str(superset), str(fp8_src)], check=True)
        sub_s, sub = stage(derived, SUBSET)
        scratch = workdir(root, "scratch", target, regen)
        scratch_s, scratch_report = stage(scratch, SUBSET, derive_from="none")
        same = files(superset) == files(scratch / "data" / "cache.zarr")
        fp8_work = workdir(root, "fp8", target, regen)
        fp8_s, fp8 = stage(fp8_work, SUPERSET, dtype="fp8", derive_from=str(fp8_src))
        fp8_scratch_work = workdir(root, "fp8-scratch", target, regen)
        fp8_scratch_s, fp8_scratch = stage(fp8_scratch_work, SUPERSET, dtype="fp8", derive_from="none")
        fp8_same = files(fp8_work / "data/cache.zarr") == files(fp8_scratch_work / "data/cache.zarr")
        out = {
            "tokens": json.loads((derived / "data/cache/metrics.json").read_text())["tokens"],
            "superset_stage_s": round(full_s, 2), "superset_build_wall_s": full["wall_s"],
            "subset": {"mode": sub["mode"], "method": sub["derive"].get("method"),
                       "derive_wall_s": sub["derive"].get("wall_s"), "derive_stage_s": round(sub_s, 2),
                       "scratch_build_wall_s": scratch_report["wall_s"], "scratch_stage_s": round(scratch_s, 2),
                       "derive_vs_scratch_build": round(sub["derive"]["wall_s"] / scratch_report["wall_s"], 3),
                       "stage_vs_scratch_stage": round(sub_s / scratch_s, 3), "stores_equal": same},
            "fp8": {"mode": fp8["mode"], "derive_wall_s": fp8["derive"].get("wall_s"), "derive_stage_s": round(fp8_s, 2),
                    "scratch_build_wall_s": fp8_scratch["wall_s"], "scratch_stage_s": round(fp8_scratch_s, 2),
                    "derive_vs_scratch_build": round(fp8["derive"]["wall_s"] / fp8_scratch["wall_s"], 3),
                    "stage_vs_scratch_stage": round(fp8_s / fp8_scratch_s, 3), "stores_equal": fp8_same},
        }
        print(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
