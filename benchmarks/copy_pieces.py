"""What one copy of page-cache bytes into a sample's buffer costs, by how it is made: the bound a
local read path with checks works against (issue: the loader ahead of litdata and MDS).

    python benchmarks/copy_pieces.py [--mb 32] [--repeats 7]

A file of --mb MB is read once (page cache hot), then copied into a fresh numpy buffer per
repetition, as a loader's sample is: with one `preadv` (the kernel's copy), from an `mmap` of it in
one piece, and from the mmap in pieces of 320 KB (one 64-token chunk at H = 2,560 in bf16: a
chunk with a checksum trailer after it cannot be copied in larger pieces), 1 MB, 2.5 MB and 5 MB;
then the same mmap copies followed by crc32c of the copy, and into a buffer reused across
repetitions (a pinned staging buffer is). Prints the median GB/s of each.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time

import numpy as np
from crc32c import crc32c

KB = 1 << 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    n = args.mb << 20
    with tempfile.NamedTemporaryFile(prefix="copy-pieces-") as f:
        f.write(np.random.default_rng(0).bytes(n))
        f.flush()
        fd = os.open(f.name, os.O_RDONLY)
        src = np.frombuffer(mmap.mmap(fd, 0, prot=mmap.PROT_READ), np.uint8)
        reused = np.empty(n, np.uint8)

        def pieces(size: int, out: np.ndarray | None = None, check: bool = False):
            def run():
                o = np.empty(n, np.uint8) if out is None else out
                for x in range(0, n, size):
                    np.copyto(o[x:x + size], src[x:x + size])
                if check:
                    crc32c(o)
            return run

        def pread():
            o = np.empty(n, np.uint8)
            os.preadv(fd, [memoryview(o)], 0)

        cases = {"preadv, one call": pread, "mmap, one piece": pieces(n)}
        cases |= {f"mmap, {size // KB} KB pieces": pieces(size) for size in (320 * KB, 1024 * KB, 2560 * KB, 5120 * KB)}
        cases |= {"mmap, one piece, then crc32c": pieces(n, check=True),
                  "mmap, 320 KB pieces, then crc32c": pieces(320 * KB, check=True),
                  "mmap, one piece, reused buffer": pieces(n, reused),
                  "mmap, 320 KB pieces, reused buffer": pieces(320 * KB, reused)}
        times = {name: [] for name in cases}
        for fn in cases.values():
            fn()
        for _ in range(args.repeats):  # interleaved: the machine's noise falls on every case alike
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        os.close(fd)
    print(f"{args.mb} MB copied from the page cache into a fresh buffer, median of {args.repeats}")
    for name, ts in times.items():
        print(f"{name:<36} {n / statistics.median(ts) / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
