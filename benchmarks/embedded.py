"""The embedded default end to end: `make repro` from a fresh clone, timed, and what its stages measured.

    python benchmarks/embedded.py [--repo DIR]
    python benchmarks/record.py embedded --title "..." -- python benchmarks/embedded.py   # for docs/benchmarks.md

Clones this checkout's HEAD into a temporary directory (or uses `--repo`, a checkout where
`make repro` already ran: then nothing is timed), runs `make setup` and `make repro` there, each
timed, and prints every stage's metrics (data/*/metrics.json) as one table, then `FIGURE` lines
(benchmarks/record.py) for the quantities the docs may state: the two wall times, the cache's
size, the training's final loss and each eval suite's τ.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import minutes  # the wall times a record shows, spelled the same way

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("split", "regen", "cache", "train", "eval", "export")


def timed(cmd: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=sys.stderr, stderr=sys.stderr)
    return time.perf_counter() - start


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= flat(v, key + ".")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


def figures(repo: Path) -> dict[str, str]:
    """The quantities docs may state (benchmarks/figures.py), from the stages' own metrics."""
    out = {}
    cache = json.loads((repo / "data/cache/metrics.json").read_text())
    out["cache.samples"] = f"{cache['samples']:,}"
    out["cache.tokens"] = f"{cache['tokens']:,}"
    out["cache.files"] = str(cache["files"])
    out["cache.mb"] = f"{cache['bytes'] / 1e6:.0f}"
    if "wall_s" in cache:
        out["cache.wall"] = minutes(cache["wall_s"])
    train = json.loads((repo / "data/train/metrics.json").read_text())
    out["train.loss"] = f"{train['final_loss']:.2f}"
    if "wall_s" in train:
        out["train.wall"] = minutes(train["wall_s"])
    for suite, m in json.loads((repo / "data/eval/metrics.json").read_text()).items():
        if suite != "protocol":  # compact_metrics: tau (greedy), tau_sample, speedup per suite
            out[f"tau.{suite}.greedy"] = f"{m['tau']:.2f}"
            if "tau_sample" in m:
                out[f"tau.{suite}.sampled"] = f"{m['tau_sample']:.2f}"
            if "speedup" in m:
                out[f"speedup.{suite}"] = f"{m['speedup']:.1f}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, help="a checkout where `make repro` already ran (nothing is timed)")
    args = ap.parse_args()
    times = {}
    with tempfile.TemporaryDirectory(prefix="deepspec-embedded-") as tmp:
        repo = args.repo
        if repo is None:
            repo = Path(tmp) / "clone"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
            times["make_setup"] = timed(["make", "setup"], repo)
            times["make_repro"] = timed(["make", "repro"], repo)
        rows = {}
        for stage in STAGES:
            path = repo / "data" / stage / "metrics.json"
            if path.exists():
                rows |= flat(json.loads(path.read_text()), stage + ".")
        figs = figures(repo)
    for name, seconds in times.items():
        print(f"{name:<44} {minutes(seconds):>14}")
        figs[f"{name}.wall"] = minutes(seconds)
    for key, value in rows.items():
        print(f"{key:<44} {value:>14}")
    for key, value in figs.items():
        print(f"FIGURE {key} = {value}")


if __name__ == "__main__":
    main()
