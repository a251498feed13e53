"""Fuzzes stores written by anyone: N hostile cases through the harness of tests/cache/test_fuzz.py, with a table.

    python benchmarks/fuzz_stores.py --cases 10000 [--seed S] [--backends zarr-local hdf5-local zarr-s3 hdf5-s3]
                                     [--no-s3] [--examples 1]

Each case copies a small pristine store (Zarr or HDF5, local or on a moto_server started here; bf16
uncompressed or fp8 + blosc-zstd), applies 1-3 mutations (tests/cache/fuzz/mutations.py: JSON fields set to
hostile values, truncation, bit flips, links in and out of the store, /dev/zero, FIFOs, directories,
sparse or oversized files, duplicated names and keys, deletions, index rows and shard indexes
rewritten with valid checksums) and reads every sample (CacheReader fast path; for some cases also
fast=False and verify). The property: the pristine samples or a CacheFormatError naming the store;
nothing opened outside the store; a tracemalloc peak under the bound; no hang. Unlike the test,
every case runs whatever failed before. Printed: cases by mutation kind and backend (a case counts
once for each kind it applied), outcomes of the fast path (same samples, refused by error class),
property failures by class and backend (0 expected), each failure group (class and where it was
raised) with its mutation kinds, files and one example, peak RSS, the largest tracemalloc peak of a
mode, time per case per backend and the wall time.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import resource
import shutil
import signal
import sys
import time
import uuid
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}


def table(title: str, rows: list[str], cols: list[str], cell) -> None:
    """A fixed-width table: `cell(row, col)` -> int or str; a total column for ints."""
    width = max([len(r) for r in rows] + [len(title)])
    cw = max([len(c) for c in cols] + [7])
    print(f"\n{title:<{width}}  " + "  ".join(f"{c:>{cw}}" for c in cols) + f"  {'total':>{cw}}")
    for r in rows:
        values = [cell(r, c) for c in cols]
        total = sum(v for v in values if isinstance(v, int))
        print(f"{r:<{width}}  " + "  ".join(f"{v:>{cw}}" for v in values) + f"  {total:>{cw}}")


def run_backend(F, harness, pristines, n: int, seed: int) -> tuple[list, float]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    outcomes: list = []

    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @with_seed(seed)
    @given(F.cases(pristines))
    def one(case):
        outcomes.append(harness.run(case))  # collected: a failure does not stop the run

    start = time.perf_counter()
    one()
    return outcomes, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1000, help="cases in all, shared equally by the backends")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", nargs="+", default=None, help="of zarr-local hdf5-local zarr-s3 hdf5-s3")
    ap.add_argument("--no-s3", action="store_true", help="local backends only (no moto_server)")
    ap.add_argument("--examples", type=int, default=1, help="example cases printed per failure group")
    args = ap.parse_args()

    # a stopped run still stops its moto_server (the `finally` below); `kill -USR1` prints every thread's stack
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # the range requests of a mode cut short are cancelled (fuzz.watch.cancel_background): not news
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited")
    from tests.cache import fuzz as F

    backends = args.backends or [b for b in F.BACKENDS if not (args.no_s3 and b.endswith("-s3"))]
    work = F.scratch("fuzz-stores-")
    moto = client = bucket = None
    wall = time.perf_counter()
    try:
        if any(b.endswith("-s3") for b in backends):
            for k, v in AWS_ENV.items():
                os.environ.setdefault(k, v)
            from tests.conftest import MotoServer

            moto = MotoServer(Path(work))
            client, bucket = moto.client(), moto.bucket(f"fuzz-{uuid.uuid4().hex[:12]}")
        harness = F.Harness(work, client, bucket)
        results: dict[str, list] = {}
        per_case: dict[str, float] = {}
        for b in backends:
            t = time.perf_counter()
            if b.endswith("-s3"):
                pristines = [F.build_pristine(b, v, f"s3://{bucket}/pristine-{b}-{v}", moto.storage_options)
                             for v in F.VARIANTS]
            else:
                pristines = [F.build_pristine(b, v, os.path.join(work, f"pristine-{b}-{v}", "store"), None)
                             for v in F.VARIANTS]
            built = time.perf_counter() - t
            outcomes, seconds = run_backend(F, harness, pristines, max(1, args.cases // len(backends)), args.seed)
            results[b], per_case[b] = outcomes, seconds / max(len(outcomes), 1)
            failed = sum(bool(o.failures) for o in outcomes)
            print(f"{b}: {len(outcomes)} cases in {seconds:.1f} s ({per_case[b] * 1000:.0f} ms a case; stores built "
                  f"in {built:.1f} s), {failed} with a property failure", flush=True)
        harness.close()
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    wall = time.perf_counter() - wall
    report(F, results, per_case, wall, args.examples)
    return 0


def report(F, results: dict[str, list], per_case: dict[str, float], wall: float, examples: int) -> None:
    backends = list(results)
    kinds = sorted({m.kind for outs in results.values() for o in outs
                    for m, a in zip(o.case.mutations, o.applied) if a == "applied"})

    def by_kind(k, b):
        return sum(any(m.kind == k and a == "applied" for m, a in zip(o.case.mutations, o.applied)) for o in results[b])

    table("cases by mutation kind", kinds, backends, by_kind)
    summaries = sorted({o.summary for outs in results.values() for o in outs})
    table("fast path outcome", summaries, backends, lambda s, b: sum(o.summary == s for o in results[b]))
    modes = sorted({(r.mode, r.outcome) for outs in results.values() for o in outs for r in o.results})
    table("mode outcome (every mode)", [f"{m} {x}" for m, x in modes], backends,
          lambda s, b: sum(f"{r.mode} {r.outcome}" == s for o in results[b] for r in o.results))
    classes = ["wrong-exception", "message-without-store", "different-samples", "read-outside", "memory", "hang"]
    table("property failures (mode results)", classes, backends,
          lambda c, b: sum(F.failure_class(f).split(" ")[0] == c for o in results[b] for f in o.failures))
    table("cases with a property failure", ["cases"], backends, lambda _, b: sum(bool(o.failures) for o in results[b]))

    every = [o for outs in results.values() for o in outs]
    found = F.failure_groups(every)
    print(f"\nfailure groups: {len(found)} (class, where raised)\n")
    print(F.format_groups(found, examples))

    peaks = [r.peak for o in every for r in o.results]
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; largest tracemalloc peak "
          f"of a mode {max(peaks, default=0) / 2**20:.2f} MiB (bound {F.MEMORY_BOUND >> 20} MiB)")
    print("time a case: " + ", ".join(f"{b} {s * 1000:.0f} ms" for b, s in per_case.items()))
    print(f"{len(every)} cases, {sum(bool(o.failures) for o in every)} with a property failure; wall {wall:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
