"""Run one benchmark (or `make test`) and keep what it printed as a record for docs/benchmarks.md.

    python benchmarks/record.py NAME [--title "..."] [--results DIR] -- COMMAND [ARGS...]

The command runs in the current directory with its output passed through; afterwards
`benchmarks/results/NAME.json` holds the date, the machine, the command line, its wall time, the
last lines it printed and the figures it declared. A script declares a figure by printing a line
`FIGURE <key> = <value>` (figures.py: a doc that states the quantity must state this value).
`benchmarks/report.py` (`make benchmarks-doc`) turns every record into docs/benchmarks.md, so the
page says only what a run printed, with where and when.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
KEEP_LINES = 300  # a script prints its tables last; the page shows them whole
FIGURE = re.compile(r"^FIGURE (?P<key>[a-z0-9_.]+) = (?P<value>.+?)\s*$")
NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def machine() -> str:
    """The machine in words: CPU model and cores, memory, accelerator, Python and torch."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    words = [f"{cores} cores of {cpu}"]
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        words.append(f"{pages * size / 2**30:.0f} GiB")
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import torch
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        words.append(f"{gpu}, Python {platform.python_version()}, torch {torch.__version__}")
    except ImportError:
        words.append(f"Python {platform.python_version()}")
    return ", ".join(words)


def redact(line: str, roots: tuple[str, ...]) -> str:
    """A printed line without this machine's absolute paths (tracebacks, warnings): the checkout and
    the working directory become relative, installed code and temporary files a placeholder."""
    line = re.sub(r"/[^\s\"':]*/site-packages/", "<site-packages>/", line)
    line = re.sub(r"/[^\s\"':]*/lib/python3\.\d+/", "<python>/", line)
    for root in roots:
        line = line.replace(root.rstrip("/") + "/", "")
    return re.sub(re.escape(tempfile.gettempdir().rstrip("/")) + r"/[^\s\"':]*", "<tmp>", line)


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def figures_of(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        m = FIGURE.match(line.strip())
        if m:
            out[m["key"]] = m["value"]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: record.py NAME [--title T] -- COMMAND [ARGS...]")
    cut = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--title", default="")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the record goes (default: benchmarks/results)")
    args = ap.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not NAME.fullmatch(args.name) or not command:
        raise SystemExit(f"record.py: {args.name!r} is not a record name ([a-z0-9_-]) or no command was given")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # what else ran when it started
    start, lines = time.perf_counter(), []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line.rstrip("\n"))
            del lines[:-2000]
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        print(f"record.py: {shlex.join(command)} exited with {proc.returncode}; nothing recorded", file=sys.stderr)
        return proc.returncode
    roots = (str(Path.cwd()), str(RESULTS.parent.parent))
    shown = [redact(line, roots) for line in lines if not FIGURE.match(line.strip()) and "\r" not in line]
    record = {"name": args.name, "title": args.title or args.name,
              "command": shlex.join(command), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
              "machine": machine(), "load_at_start": None if load is None else round(load, 1), "wall_s": round(wall, 1),
              "figures": {f"{args.name}.wall": minutes(wall)} | figures_of(lines), "output": shown[-KEEP_LINES:]}
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"{args.name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    print(f"record.py: {path} written ({wall:.0f} s); "
          "`make benchmarks-doc` renders docs/benchmarks.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
