"""The capture write-back's cost to a capture loop that holds the GIL, measured on a CPU.

    python benchmarks/writeback_gil.py [--widths 128] [--part-tokens 16384] [--part-ms 45] [--parts 24]
                                       [--threads 1,4] [--writers thread,process,apart] [--switch 0.005]
                                       [--repeats 5]

On a GPU the cache stage's (and a read-through run's) forward passes of a narrow target are bound by
the Python that launches their kernels. This measures what a writer costs such a loop on a CPU: the
loop is a stand-in that spends `--part-ms` a part in small module calls (each op gives up the GIL in
its dispatch, as a CUDA launch does) and then hands over the part's states (5 layers and the last,
bf16 bits; views of one buffer, as if copied into pinned memory), each part in one batch (a GPU's
cache.batch_tokens holds a whole part). It runs alone, then with each writer committing every part
to a new Zarr store (under BENCH_TMP, e.g. /dev/shm), in interleaved rounds:
- thread: a CacheWriter in the loop's process (its threads share the loop's GIL);
- process: a ProcessWriter (the same writer in a child process, the states handed over in shared
  memory), what the cache stage uses beside a GPU;
- apart: the control, the loop alone while a CacheWriter in another process is handed a part every
  --part-ms: what the writer's work costs the loop through the machine's cores and memory alone.
An overhead is the median over the rounds of (time with the writer / time alone - 1), until the
last part is handed over ("loop") and until the writer is closed ("closed": plus the last part's
write). `--switch` runs each round under these sys.setswitchinterval values (the longest a thread
waiting for the GIL waits before it asks the holder to drop it). On a machine of few cores the
writer's own work competes with the loop for them; a GPU node has cores to spare.

The stand-in is a worst case of a real capture loop: it never waits for a GPU with the GIL released.
It is a proxy for benchmarks/read_through.py --capture-only on a GPU, which is the measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from deepspec.cache.write.part_data import PartData  # noqa: E402
from deepspec.cache.write.process_writer import ProcessWriter  # noqa: E402
from deepspec.cache.write.writer import CacheWriter  # noqa: E402

KINDS = ["thread", "process", "apart"]

LAYERS = [1, 9, 17, 25, 33]
SAMPLE_TOKENS = 512


class Launches(torch.nn.Module):
    """A forward of many small ops: Python module calls around dispatches that give up the GIL."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, ops: int) -> torch.Tensor:
        for _ in range(ops):
            x = torch.tanh(self.b(torch.relu(self.a(x))) + x)
        return x


def calibrate(model: Launches, part_ms: float) -> int:
    """Op groups a part runs so that the loop alone takes `part_ms` a part."""
    x = torch.zeros(4, 16)
    model(x, 200)
    n = 2000
    t = time.perf_counter()
    model(x, n)
    per = (time.perf_counter() - t) / n
    return max(1, round(part_ms / 1e3 / per))


def parts(part_tokens: int, count: int, model: Launches, ops: int, bits: np.ndarray):
    """`count` parts, each of part_tokens // 512 samples (part k's last one k tokens shorter, so no two
    share their arrays' shapes), its forward run when its batch is drawn."""
    n = part_tokens // SAMPLE_TOKENS
    x = torch.zeros(4, 16)
    for p in range(count):
        lengths = np.full(n, SAMPLE_TOKENS, np.int64)
        lengths[-1] -= p
        tokens = int(lengths.sum())

        def batches(tokens=tokens):
            model(x, ops)
            yield {a: (bits[:tokens], None) for a in [*LAYERS, "last"]}

        yield PartData(None, np.arange(p * n, (p + 1) * n, dtype=np.uint64), lengths,
                       np.zeros(tokens, np.int32), np.ones(tokens, np.uint8), batches=batches())


def paced_writer(width: int, args, threads: int, tmp: Path, go) -> None:
    """The control: the same writer in a process of its own, handed a part every --part-ms (what the
    loop hands over) from the moment `go` is set, while the loop runs alone in the parent."""
    bits = np.random.default_rng(0).integers(0, 1 << 16, (args.part_tokens, width), dtype=np.uint16)
    none = Launches()
    writer = CacheWriter(str(tmp / f"c{os.getpid()}.zarr"), manifest(width), threads=threads)
    go.wait()
    t0 = time.perf_counter()
    for k, part in enumerate(parts(args.part_tokens, args.parts, none, 0, bits)):
        time.sleep(max(0.0, t0 + k * args.part_ms / 1e3 - time.perf_counter()))
        writer.submit(part)
    writer.close(consolidate=False)
    writer.release()


def manifest(width: int) -> dict:
    return {"target": {"id": "bench", "hidden_size": width}, "layers": LAYERS, "dtype": "bfloat16",
            "codec": "none", "max_length": 1024, "chunk_tokens": 64, "hidden_size": width, "storage": "zarr"}


def run(width: int, args, threads: int, ops: int, model: Launches, bits: np.ndarray, tmp: Path,
        kind: str) -> tuple:
    """(seconds until the last part is handed over, seconds until the writer is closed). `kind`:
    "alone" (the batches dropped), "thread" (CacheWriter), "process" (ProcessWriter), or "apart"
    (the loop alone beside paced_writer's process)."""
    if kind == "apart":
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        go = ctx.Event()
        child = ctx.Process(target=paced_writer, args=(width, args, threads, tmp, go))
        child.start()
        time.sleep(1.0)  # the child's writer open
        go.set()
        t = run(width, args, threads, ops, model, bits, tmp, "alone")
        child.join()
        assert child.exitcode == 0, child.exitcode
        return t
    t0 = time.perf_counter()
    if kind == "alone":
        for part in parts(args.part_tokens, args.parts, model, ops, bits):
            for _ in part.batches:
                pass
        t = time.perf_counter() - t0
        return t, t
    url = tmp / f"s{time.monotonic_ns()}.zarr"
    writer = (ProcessWriter if kind == "process" else CacheWriter)(str(url), manifest(width), threads=threads)
    t0 = time.perf_counter()
    for part in parts(args.part_tokens, args.parts, model, ops, bits):
        writer.submit(part)
    loop = time.perf_counter() - t0
    writer.close(consolidate=False)
    closed = time.perf_counter() - t0
    writer.release()
    import shutil

    shutil.rmtree(url)
    return loop, closed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="128")
    ap.add_argument("--part-tokens", type=int, default=16384)
    ap.add_argument("--part-ms", type=float, default=45.0, help="the loop's time a part, alone")
    ap.add_argument("--parts", type=int, default=24)
    ap.add_argument("--threads", default="1,4", help="the writer's thread counts")
    ap.add_argument("--switch", default="0.005", help="sys.setswitchinterval values, seconds")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--writers", default=",".join(KINDS),
                    help="thread: CacheWriter in the loop's process; process: ProcessWriter; apart: the loop alone "
                         "beside a CacheWriter in another process handed a part every --part-ms")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kinds = args.writers.split(",")
    model = Launches()
    ops = calibrate(model, args.part_ms)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        for width in [int(w) for w in args.widths.split(",")]:
            bits = np.random.default_rng(0).integers(0, 1 << 16, (args.part_tokens, width), dtype=np.uint16)
            for switch in [float(s) for s in args.switch.split(",")]:
                sys.setswitchinterval(switch)
                for threads in [int(t) for t in args.threads.split(",")]:
                    for kind in set(kinds) - {"apart"}:  # warm-up: imports, the first documents
                        run(width, args, threads, ops, model, bits, Path(tmp), kind)
                    runs = []
                    for rep in range(args.repeats):
                        got = {"alone": run(width, args, threads, ops, model, bits, Path(tmp), "alone")}
                        for kind in kinds:
                            got[kind] = run(width, args, threads, ops, model, bits, Path(tmp), kind)
                        runs.append(got)
                        print(json.dumps({"width": width, "switch": switch, "threads": threads, "repeat": rep,
                                          **{k: [round(x, 4) for x in v] for k, v in got.items()}}), flush=True)
                    # per writer: the medians of its (loop, closed) over alone, pair by pair
                    rows.append((width, switch, threads, statistics.median(r["alone"][0] for r in runs),
                                 {k: [statistics.median(r[k][i] / r["alone"][0] - 1 for r in runs) for i in (0, 1)]
                                  for k in kinds}))
                sys.setswitchinterval(0.005)
    print(f"\n{args.parts} parts of {args.part_tokens} tokens (5 layers + last, bf16), the loop alone "
          f"{args.part_ms} ms a part ({ops} op groups); medians over {args.repeats} interleaved rounds")
    print(f"{'width':>6} {'switch s':>9} {'threads':>8} {'alone ms/part':>14}"
          + "".join(f" {k + ' loop':>13} {k + ' closed':>15}" for k in kinds))
    for width, switch, threads, alone, by in rows:
        print(f"{width:>6} {switch:>9} {threads:>8} {alone / args.parts * 1e3:>14.1f}"
              + "".join(f" {100 * by[k][0]:>12.1f}% {100 * by[k][1]:>14.1f}%" for k in kinds))
        for k in kinds:
            print(f"FIGURE w{width}.t{threads}.s{switch}.{k}_loop_overhead_pct = {100 * by[k][0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
