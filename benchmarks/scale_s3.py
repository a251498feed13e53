"""S3 read throughput vs requests in flight, through an S3 endpoint with injected latency and bandwidth.

    python benchmarks/scale_s3.py [--samples 6] [--tokens 768] [--in-flight 1 4 16 64] [--cat-ranges]

moto_server on 127.0.0.1 holds a cache at the reference width (H = 2,560, layers [1, 9, 17, 25, 33]
+ last, bf16, uncompressed); `--tokens` 768 makes each array of a sample one ~3.9 MB range
(12 chunks of 64 tokens), the 4 MB ranges of the issue. The reader reaches moto through a
throttling proxy written here (aiohttp, its own process on 127.0.0.1) that adds 30 ms before each
request and paces each response body to 20 MB/s: a stand-in for one S3 stream's latency and
bandwidth. For each number of requests in flight N the loader reads one sampler-style batch
(TargetCacheDataset.__getitems__, read_ahead = N, range_bytes = 4 MB; samples repeat so a batch has
>= 2N large ranges) and the script prints absolute MB/s of payload, the ratio to N = 1, and the CPU
of the proxy, of moto_server and of the reading process as a fraction of one core (the proxy and
moto are Python processes that cannot use much more than one; well under 1.0 means that process
was not the limit) and the machine's load average (on a shared machine, what the others ran). `MB_s_per_core` turns
each process's CPU per MB into the rate it could carry on one core of its own: on an oversubscribed
machine every process gets only its share of a core, and that share, not the throttle's design, is
then what caps the wider rows. Goal: >= 8x the single stream at N = 16.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LATENCY_S = 0.030
STREAM_BYTES_S = 20e6
PIECE = 256 << 10  # paced in pieces of 12.8 ms at 20 MB/s: fine enough, few wake-ups
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


def serve_proxy(port: int, upstream: str) -> None:
    """The throttle: every request waits LATENCY_S, then its response body streams at STREAM_BYTES_S.
    `GET /__counts` answers the requests (by method) and response bytes passed so far, with
    `?paths=1` the requests by method and path instead, and with `?reset=1` starts the counts again."""
    import aiohttp
    from aiohttp import web

    counts, paths = collections.Counter(), collections.Counter()

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/__counts":
            answer = web.json_response(dict(paths if request.query.get("paths") else counts))
            if request.query.get("reset"):
                counts.clear()
                paths.clear()
            return answer
        counts[request.method] += 1
        paths[f"{request.method} {request.path}"] += 1
        body = await request.read()
        await asyncio.sleep(LATENCY_S)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        session: aiohttp.ClientSession = request.app["session"]
        async with session.request(request.method, upstream + request.path_qs, headers=headers, data=body,
                                   allow_redirects=False, auto_decompress=False) as up:
            resp = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                 if k.lower() not in HOP})
            await resp.prepare(request)
            loop, sent = asyncio.get_running_loop(), 0
            start = loop.time()
            async for piece in up.content.iter_chunked(PIECE):
                await resp.write(piece)
                sent += len(piece)
                counts["bytes"] += len(piece)
                ahead = start + sent / STREAM_BYTES_S - loop.time()
                if ahead > 0:
                    await asyncio.sleep(ahead)
            await resp.write_eof()
            return resp

    async def session_ctx(app: web.Application):
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
        yield
        await app["session"].close()

    app = web.Application(client_max_size=1 << 30)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def wait_http(url: str, seconds: float = 60) -> None:
    import requests

    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            requests.get(url, timeout=1)
            return
        except requests.RequestException:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


@contextlib.contextmanager
def moto_behind_proxy(bucket: str):
    """moto_server on 127.0.0.1 holding `bucket`, and the throttling proxy in front of it (each its
    own process): yields (moto URL, proxy URL); both stop on exit."""
    import boto3

    from deepspec.data.servers import free_port

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_EC2_METADATA_DISABLED="true",
                      AWS_DEFAULT_REGION="us-east-1")
    moto_port, proxy_port = free_port(), free_port()
    moto_url, proxy_url = f"http://127.0.0.1:{moto_port}", f"http://127.0.0.1:{proxy_port}"
    procs = [subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(moto_port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-proxy", str(proxy_port),
                                       moto_url]))
        wait_http(moto_url)
        wait_http(proxy_url)
        boto3.client("s3", endpoint_url=moto_url).create_bucket(Bucket=bucket)
        yield moto_url, proxy_url, procs
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=6, help="samples stored (each ~24 MB)")
    ap.add_argument("--tokens", type=int, default=768)
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--cat-ranges", action="store_true",
                    help="instead: the reader's byte-range gather vs fsspec's cat_ranges on the same ranges")
    ap.add_argument("--serve-proxy", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_proxy:
        return serve_proxy(int(args.serve_proxy[0]), args.serve_proxy[1])

    import numpy as np
    import psutil
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from loader import REF_LAYERS, synthetic_flat

    from deepspec.cache.write.part_data import PartData
    from deepspec.cache.write.writer import CacheWriter
    from deepspec.loader.dataset import TargetCacheDataset

    with moto_behind_proxy("bench") as (moto_url, proxy_url, procs):
        H, T, n = 2560, args.tokens, args.samples
        flat = synthetic_flat(T * n, H, REF_LAYERS)
        direct = {"endpoint_url": moto_url, "key": "bench", "secret": "bench"}
        manifest = {"target": {"id": "bench", "hidden_size": H}, "layers": REF_LAYERS, "dtype": "bfloat16",
                    "codec": "none", "max_length": 4096, "chunk_tokens": 64, "hidden_size": H}
        w = CacheWriter("s3://bench/c.zarr", manifest, direct)
        # one sample a part: moto_server reads a whole object to answer a range of it, so objects the
        # size of a range keep moto's own cost per byte served the same as a real S3's
        for i in range(n):
            rows = slice(i * T, (i + 1) * T)
            w.write_part(PartData(f"p{i:06d}", np.array([i + 1], dtype=np.uint64), np.array([T]),
                                  flat["input_ids"][rows], flat["loss_mask"][rows],
                                  {k: torch.from_numpy(flat[k][rows]).view(torch.bfloat16) for k in [*REF_LAYERS, "last"]}))
        w.write_manifest()
        w.release()
        del flat
        through = {"endpoint_url": proxy_url, "key": "bench", "secret": "bench"}
        if args.cat_ranges:
            return compare_cat_ranges(through, args.in_flight)
        proxy, moto = psutil.Process(procs[1].pid), psutil.Process(procs[0].pid)
        rows, base = [], None
        for N in args.in_flight:
            ds = TargetCacheDataset("s3://bench/c.zarr", storage_options=through, read_ahead=N, range_bytes=4 << 20)
            ds.__getitems__(list(range(n)))  # metadata and shard indexes of every part: what is timed is sample reads
            per_sample = len(REF_LAYERS) + 1  # large ranges per sample
            batch = [i % n for i in range(max(2, -(-2 * N // per_sample)))]
            me = psutil.Process()
            cpu0 = {p: sum(p.cpu_times()[:2]) for p in (proxy, moto, me)}
            t0 = time.perf_counter()
            items = ds.__getitems__(batch)
            dt = time.perf_counter() - t0
            cpu = {p: (sum(p.cpu_times()[:2]) - cpu0[p]) / dt for p in (proxy, moto, me)}
            nbytes = sum(v.numel() * v.element_size() for it in items for v in it.values() if isinstance(v, torch.Tensor))
            mb_s = nbytes / dt / 1e6
            base = base or mb_s
            rows.append({"in_flight": N, "MB": round(nbytes / 1e6, 1), "seconds": round(dt, 2), "MB_s": round(mb_s, 1),
                         "vs_1_stream": round(mb_s / base, 2), "proxy_cpu_cores": round(cpu[proxy], 2),
                         "moto_cpu_cores": round(cpu[moto], 2), "reader_cpu_cores": round(cpu[me], 2),
                         # CPU seconds each process spent per MB, as the MB/s one free core would
                         # carry: the rate that process caps the read at when it has a core of its own
                         "MB_s_per_core": {name: round(nbytes / 1e6 / (cpu[q] * dt), 0) if cpu[q] else None
                                           for name, q in (("proxy", proxy), ("moto", moto), ("reader", me))},
                         "load_avg_1min": round(os.getloadavg()[0], 1)})
            print(json.dumps(rows[-1]), flush=True)
        one = 4e6 / (LATENCY_S + 4e6 / STREAM_BYTES_S) / 1e6  # one 4 MB range after another
        print(json.dumps({"latency_ms": LATENCY_S * 1e3, "stream_MB_s": STREAM_BYTES_S / 1e6,
                          "ideal_single_stream_MB_s_at_4MB": round(one, 1), "cpus": os.cpu_count(),
                          "table": rows}, indent=1))


def compare_cat_ranges(options: dict, in_flight: list[int], repeats: int = 3) -> None:
    """The same 4 MB ranges of every shard through fsspec's `cat_ranges` (`batch_size` = requests in
    flight; what ByteRanges.read_ranges calls) and through the gather the reader used before it
    (coroutines of s3fs's `_cat_file` under a semaphore, on s3fs's loop), alternating, `repeats`
    times each; prints the median MB/s of each and the ratio."""
    import asyncio

    from fsspec.asyn import sync

    from deepspec.cache.read.ranges import ByteRanges

    files = ByteRanges("s3://bench/c.zarr", options, connections=max(in_flight))
    fs, root = files.fs, files.root
    shards = sorted(k for k in fs.find(root) if "/parts/" in k and "zarr.json" not in k)
    ranges = [(k[len(root) + 1:], a, min(a + (4 << 20), fs.size(k))) for k in shards
              for a in range(0, fs.size(k), 4 << 20)]
    total = sum(e - a for _, a, e in ranges)
    for n in in_flight:
        best = {"gather": [], "cat_ranges": []}
        for _ in range(repeats):
            async def gather(n=n):
                gate = asyncio.Semaphore(n)

                async def fetch(key, start, end):
                    async with gate:
                        return await fs._cat_file(f"{root}/{key}", start=start, end=end)
                return await asyncio.gather(*(fetch(*r) for r in ranges))

            t0 = time.perf_counter()
            mine = sync(fs.loop, gather)
            best["gather"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            theirs = files.read_ranges(ranges, n)
            best["cat_ranges"].append(time.perf_counter() - t0)
            assert mine == theirs
        mb_s = {k: round(total / 1e6 / sorted(v)[len(v) // 2], 1) for k, v in best.items()}
        print(json.dumps({"in_flight": n, "ranges": len(ranges), "MB": round(total / 1e6, 1),
                          "gather_MB_s": mb_s["gather"], "cat_ranges_MB_s": mb_s["cat_ranges"],
                          "cat_ranges_vs_gather": round(mb_s["cat_ranges"] / mb_s["gather"], 2)}), flush=True)


if __name__ == "__main__":
    main()
