"""Manifest/index cost vs number of parts, this code (format v2) beside the previous code (v1).

    python benchmarks/scale_index.py [--parts 100,500,2000] [--s3-parts 25,100,400]
                                     [--old-src DIR] [--keep DIR]

`--old-src` is a checkout of the previous code (e.g. `git archive 8a04f09 | tar -x -C DIR`); its
columns are left out without it. Parts are tiny synthetic parts (one 4-token sample, H = 8, one
layer) written through CacheWriter.submit, as the cache stage writes them: what grows with the
number of parts is the bookkeeping, which is what this measures. Each measurement runs in a fresh
subprocess whose PYTHONPATH is the code under test. Prints
  (a) bytes written to the root manifest, the index and the parts' commit records (parts/*/zarr.json)
      while writing N parts, and those bytes per committed part (goal: constant from 100 to 2,000);
  (b) the time and, on S3, the requests (counted at the moto server, 127.0.0.1) to open the store
      with CacheReader and look up its last sample (goal: O(1) requests);
  (c) files per part of this layout (counted on a part written with the reference's layers,
      [1, 9, 17, 25, 33] + last, bf16), and what that gives for the reference cache (1.25 B tokens,
      H = 2,560, 30,726 B/token) at several part sizes: files, files per TB, bytes of one hidden
      object, and bytes of one part (what the writer holds per part in memory).
  `--only-files` prints (c) alone (seconds).

Measured (2 shared cores, old = 8a04f09): bookkeeping bytes per part 457 / 439 / 436 at 100 / 500 /
2,000 parts (1.05x; old 5,025 / 22,222 / 86,723, 17.3x; root manifest bytes at 2,000 parts 173 KB
vs 173 MB); open on S3 4 requests at 25 / 100 / 400 parts (old 253 / 1,003 / 4,003, 10 per part);
local open 3 / 35 / 64 ms at 100 / 500 / 2,000 parts (old 264 / 1,194 / 7,771 ms).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
NEW_SRC = HERE.parent.parent


# ---- workers (run in a subprocess against one version of deepspec) ----------------------------

def _manifest() -> dict:
    return {"target": {"id": "scale-index", "architecture": "synthetic", "hidden_size": 8}, "layers": [0],
            "dtype": "bfloat16", "codec": "none", "max_length": 16, "chunk_tokens": 4, "hidden_size": 8}


def worker_write(url: str, parts: int) -> dict:
    """Write `parts` one-sample parts; count the bytes of every store write by key class."""
    import numpy as np

    from deepspec.cache.storage.durable import DurableLocalStore
    from deepspec.cache.write.part_data import PartData
    from deepspec.cache.write.writer import CacheWriter

    counts = {"root": 0, "index": 0, "record": 0, "arrays": 0, "root_writes": 0}
    real = DurableLocalStore._set

    async def counting(self, key, value, exclusive=False):
        if exclusive and (self.root / key).exists():
            return await real(self, key, value, exclusive)  # zarr-python's "create the parent if absent": no write
        n = len(value.as_buffer_like()) if hasattr(value, "as_buffer_like") else len(value.to_bytes())
        if key == "zarr.json":
            counts["root"] += n
            counts["root_writes"] += 1
        elif key.startswith("index/"):
            counts["index"] += n
        elif re.fullmatch(r"parts/p\d{6}/zarr.json", key):
            counts["record"] += n
        else:
            counts["arrays"] += n
        return await real(self, key, value, exclusive)

    DurableLocalStore._set = counting
    rng = np.random.default_rng(0)
    t0 = time.time()
    with CacheWriter(url, _manifest()) as w:
        for i in range(parts):
            bits = rng.integers(0, 2**16, size=(4, 8), dtype=np.uint16)
            w.submit(PartData(f"p{i:06d}", np.array([i + 1], dtype=np.uint64), np.array([4], dtype=np.int64),
                              rng.integers(0, 1000, 4).astype(np.int32), np.ones(4, np.uint8),
                              {0: (bits, None), "last": (bits.copy(), None)}))
    counts["wall_s"] = time.time() - t0
    return counts


def worker_open(url: str, repeat: int) -> dict:
    """Open the store `repeat` times (fresh reader each time); the best time and the sample count."""
    from deepspec.cache.read.reader import CacheReader

    best, n = float("inf"), 0
    for _ in range(repeat):
        t0 = time.time()
        r = CacheReader(url)
        n = len(r)
        r.sample_id(n - 1)
        best = min(best, time.time() - t0)
    return {"open_s": best, "samples": n}


def run_worker(src: Path, *args: str, env: dict | None = None) -> dict:
    e = dict(os.environ, PYTHONPATH=str(src), **(env or {}))
    out = subprocess.run([sys.executable, str(HERE), "--worker", *args], env=e, capture_output=True, text=True,
                         cwd=str(src))
    if out.returncode:
        raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- S3 (moto) -----------------------------------------------------------------------------------

class Moto:
    """moto_server on 127.0.0.1, started as tests/conftest.py's MotoServer does; its log is the
    request count."""

    def __init__(self, log_dir: Path):
        sys.path.insert(0, str(NEW_SRC))
        from tests.conftest import MotoServer

        self.server = MotoServer(log_dir)
        self.env = dict(self.server.env, AWS_ENDPOINT_URL=self.server.endpoint)

    def requests(self, bucket: str) -> int:
        time.sleep(0.3)
        text = Path(self.server.log.name).read_text(errors="replace")
        return len(re.findall(rf'"[A-Z]+ /{bucket}[/? ]', text))

    def upload(self, local: Path, bucket: str) -> str:
        import fsspec

        self.server.bucket(bucket)
        fs = fsspec.filesystem("s3", **self.server.storage_options)
        fs.put(str(local), f"{bucket}/store", recursive=True)
        return f"s3://{bucket}/store"


# ---- files per TB (item 3's measurement) --------------------------------------------------------

REF_TOKENS, REF_H, REF_LAYERS = 1_250_000_000, 2560, [1, 9, 17, 25, 33]


def files_per_part(storage: str) -> tuple[int, int]:
    """(files of one part, files at the store root) of a store holding one reference-layer part."""
    import numpy as np

    from deepspec.cache.spec.format import bytes_per_token
    from deepspec.cache.write.part_data import PartData
    from deepspec.cache.write.writer import CacheWriter

    h = 8
    m = dict(_manifest(), layers=REF_LAYERS, hidden_size=h, storage=storage,
             bytes_per_token=bytes_per_token(h, len(REF_LAYERS), "bfloat16"))
    with tempfile.TemporaryDirectory() as d:
        url = os.path.join(d, "store")
        rng = np.random.default_rng(0)
        hidden = {k: (rng.integers(0, 2**16, size=(8, h), dtype=np.uint16), None) for k in [*REF_LAYERS, "last"]}
        with CacheWriter(url, m) as w:
            w.submit(PartData("p000000", np.array([1, 2], dtype=np.uint64), np.array([4, 4], dtype=np.int64),
                              rng.integers(0, 1000, 8).astype(np.int32), np.ones(8, np.uint8), hidden))
        every = [p for p in Path(url).rglob("*") if p.is_file()]
        part = [p for p in every if "p000000" in str(p.relative_to(url))]
        return len(part), len(every) - len(part)


def files_table() -> None:
    from deepspec.cache.spec.format import bytes_per_token

    bpt = bytes_per_token(REF_H, len(REF_LAYERS), "bfloat16")
    row = REF_H * 2
    print(f"(c) files: reference cache {REF_TOKENS / 1e9:.2f} B tokens x {bpt:,} B/token = "
          f"{REF_TOKENS * bpt / 1e12:.1f} TB (H = {REF_H}, layers {REF_LAYERS} + last, bf16)")
    for storage in ("zarr", "hdf5"):
        per_part, root = files_per_part(storage)
        print(f"\n    {storage}: {per_part} files per part (+ {root} at the root)")
        print(f"    {'part_tokens':>11} {'shard_bytes needed':>18} {'parts':>8} {'files':>9} {'files/TB':>9} "
              f"{'hidden object':>13} {'part in memory':>14}")
        for pt in (65_536, 131_072, 262_144, 524_288, 1_048_576):
            parts = -(-REF_TOKENS // pt)
            files = parts * per_part + root
            print(f"    {pt:>11,} {pt * row / 2**30:>15.2f} GiB {parts:>8,} {files:>9,} "
                  f"{files / (REF_TOKENS * bpt / 1e12):>9,.0f} {pt * row / 1e9:>10.2f} GB {pt * bpt / 1e9:>11.2f} GB")


# ---- the tables --------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="100,500,2000")
    ap.add_argument("--s3-parts", default="25,100,400")
    ap.add_argument("--old-src", default=None, help="checkout of the previous code (format v1)")
    ap.add_argument("--keep", default=None, help="write the stores here instead of a temp dir")
    ap.add_argument("--worker", nargs="*")
    ap.add_argument("--only-files", action="store_true")
    a = ap.parse_args()
    if a.only_files:
        files_table()
        return
    if a.worker is not None:
        kind, url, n = a.worker
        print(json.dumps(worker_write(url, int(n)) if kind == "write" else worker_open(url, int(n))))
        return
    versions = [("new (v2)", NEW_SRC)] + ([("old (v1)", Path(a.old_src).resolve())] if a.old_src else [])
    work = Path(a.keep or tempfile.mkdtemp(prefix="scale-index-"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = [int(v) for v in a.parts.split(",")]
    s3_sizes = [int(v) for v in a.s3_parts.split(",")]

    print("(a) bytes written to the root manifest / index / part commit records while writing N parts")
    print(f"{'code':9} {'parts':>6} {'root B':>12} {'root writes':>11} {'index B':>9} {'records B':>10} "
          f"{'bookkeeping B/part':>18} {'wall s':>7}")
    stores = {}
    for label, src in versions:
        per_part = []
        for n in sizes:
            url = work / f"{label.split()[0]}-{n}"
            shutil.rmtree(url, ignore_errors=True)
            c = run_worker(src, "write", str(url), str(n))
            stores[(label, n)] = url
            book = c["root"] + c["index"] + c["record"]
            per_part.append(book / n)
            print(f"{label:9} {n:>6} {c['root']:>12,} {c['root_writes']:>11} {c['index']:>9,} {c['record']:>10,} "
                  f"{book / n:>18,.0f} {c['wall_s']:>7.1f}")
        print(f"{label:9} bookkeeping bytes per part, largest/smallest size: {max(per_part) / min(per_part):.3f}x "
              f"({sizes[0]} -> {sizes[-1]} parts)")

    print("\n(b) opening the store (CacheReader + last sample id): local, best of 3")
    print(f"{'code':9} {'parts':>6} {'open ms':>9}")
    for label, src in versions:
        for n in sizes:
            o = run_worker(src, "open", str(stores[(label, n)]), "3")
            print(f"{label:9} {n:>6} {o['open_s'] * 1000:>9.1f}")

    print("\n    on S3 (moto_server, 127.0.0.1): requests counted at the server, one open")
    print(f"{'code':9} {'parts':>6} {'requests':>9} {'req/part':>9} {'open ms':>9}")
    moto = Moto(work)
    try:
        for label, src in versions:
            for n in s3_sizes:
                local = work / f"s3src-{label.split()[0]}-{n}"
                shutil.rmtree(local, ignore_errors=True)
                run_worker(src, "write", str(local), str(n))
                bucket = f"scale-{label.split()[0]}-{n}-{os.getpid()}"
                url = moto.upload(local, bucket)
                before = moto.requests(bucket)
                o = run_worker(src, "open", url, "1", env=moto.env)
                req = moto.requests(bucket) - before
                print(f"{label:9} {n:>6} {req:>9} {req / n:>9.2f} {o['open_s'] * 1000:>9.1f}")
    finally:
        moto.server.stop()
    print()
    files_table()
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
