"""`dvc add` / `dvc status` / `dvc push` time vs the number of files in a cache store (issue 15, item 6).

    python benchmarks/scale_dvc.py [--files 1000,3000,10000] [--bytes 2048]

For each size, a fresh git + DVC repo in a temp dir holds a store-shaped directory (parts/pNNNNNN/
with as many files a part as a Zarr part of the reference layers has; every file distinct, --bytes each), and the three
commands are timed as a user runs them: `dvc add` (hash every file, link it into the DVC cache),
`dvc status` (warm: DVC's state db answers for unchanged files), and `dvc push` to a moto_server
bucket on 127.0.0.1. The files are small on purpose: what is measured is the per-file cost; the
per-byte cost (hashing 38 TB on `dvc add`, uploading it on `dvc push`) is a bandwidth figure, not a
file-count one, and is printed separately as a measured md5 rate. The last table extrapolates the
per-file slope (a least-squares line through the sizes) to the reference cache's file counts.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from scale_index import REF_TOKENS, Moto, files_per_part  # noqa: E402


def make_store(root: Path, files: int, size: int, per_part: int) -> None:
    for i in range(files):
        p = root / "parts" / f"p{i // per_part:06d}" / f"f{i % per_part:02d}"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(size))


def reference_files() -> dict[str, int]:
    """Files of the reference cache per layout, from one-part stores our writer writes."""
    out = {}
    for storage, pts in (("zarr", (65_536, 262_144, 1_048_576)), ("hdf5", (65_536,))):
        per_part, root = files_per_part(storage)
        out.update({f"{storage}, part_tokens {pt:,}": -(-REF_TOKENS // pt) * per_part + root for pt in pts})
    return out


def timed(cmd: list[str], cwd: Path, env: dict) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return time.perf_counter() - t0


def measure(files: int, size: int, per_part: int, moto) -> dict:
    with tempfile.TemporaryDirectory() as d:
        repo = Path(d) / "repo"
        repo.mkdir()
        env = dict(os.environ, DVC_NO_ANALYTICS="1", **moto.env)
        for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "config", "core.analytics", "false"]):
            subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)
        bucket = moto.server.bucket(f"dvc-{files}")
        subprocess.run(["dvc", "remote", "add", "-d", "s3", f"s3://{bucket}/r"], cwd=repo, env=env, check=True,
                       capture_output=True)
        subprocess.run(["dvc", "remote", "modify", "s3", "endpointurl", moto.server.endpoint], cwd=repo, env=env,
                       check=True)
        make_store(repo / "store", files, size, per_part)
        return {"files": files,
                "add_s": timed(["dvc", "add", "-q", "store"], repo, env),
                "status_s": timed(["dvc", "status", "-q"], repo, env),
                "push_s": timed(["dvc", "push", "-q", "-j", "16"], repo, env)}


def md5_rate() -> float:
    data = os.urandom(256 << 20)
    t0 = time.perf_counter()
    hashlib.md5(data).hexdigest()
    return len(data) / (time.perf_counter() - t0) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default="1000,3000,10000")
    ap.add_argument("--bytes", type=int, default=2048, help="size of each file")
    args = ap.parse_args()
    import numpy as np

    reference = reference_files()
    per_part = files_per_part("zarr")[0]
    with tempfile.TemporaryDirectory() as logs:
        moto = Moto(Path(logs))
        try:
            rows = [measure(int(n), args.bytes, per_part, moto) for n in args.files.split(",")]
        finally:
            moto.server.stop()
    print(f"\ndvc time vs files in the store ({args.bytes} B a file; push to moto_server on 127.0.0.1, -j 16)")
    print(f"    {'files':>8} {'dvc add s':>10} {'dvc status s':>13} {'dvc push s':>11} {'add ms/file':>12}")
    for r in rows:
        print(f"    {r['files']:>8,} {r['add_s']:>10.1f} {r['status_s']:>13.1f} {r['push_s']:>11.1f} "
              f"{1000 * r['add_s'] / r['files']:>12.2f}")
    xs = [r["files"] for r in rows]
    fits = {k: np.polyfit(xs, [r[k] for r in rows], 1) for k in ("add_s", "status_s", "push_s")}
    print("\n    per-file slopes (least squares): " + ", ".join(f"{k[:-2]} {1000 * b:.2f} ms/file"
                                                             for k, (b, _) in fits.items()))
    print(f"    md5 on one core: {md5_rate():,.0f} MB/s (dvc add hashes every byte of a local output once)")
    print("\n    extrapolated to the reference cache (1.25 B tokens, 38.4 TB), per-file cost only:")
    print(f"    {'layout':<36} {'files':>8} {'dvc add min':>12} {'dvc status min':>15} {'dvc push min':>13}")
    for name, n in reference.items():
        est = {k: (b * n + a) / 60 for k, (b, a) in fits.items()}
        print(f"    {name:<36} {n:>8,} {est['add_s']:>12.1f} {est['status_s']:>15.1f} {est['push_s']:>13.1f}")


if __name__ == "__main__":
    main()
