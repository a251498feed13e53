"""deepspec's loader beside litdata and MosaicML streaming, on the same samples, each written with its own
writer and read with its own Dataset API.

    make peers-site                                    # litdata and mosaicml-streaming into .peers-site (--no-deps)
    PYTHONPATH=.peers-site .venv/bin/python benchmarks/loader_peers.py [--samples 48] [--repeats 3] [--s3 | --s3-only]

The samples are the reference case's (Qwen3-4B, H = 2,560): input ids (int32), loss mask (uint8),
the hidden states of layers [1, 9, 17, 25, 33] and the last hidden state per token as bf16 bit
patterns (uint16), 600-1,400 tokens a sample (30,725 bytes a token). Written with:
  deepspec  CacheWriter (Zarr v3 shards, 64-token chunks with crc32c, 4 parts);
  litdata   `litdata.optimize` (its chunked binary format, 64 MB chunks);
  mds       `streaming.MDSWriter` (MDS shards, 64 MB).
Read map-style, `ds[i]` over every sample in a random order, page cache hot (each store read once
first), and through a DataLoader with `--workers` workers (each library's own loader for its
iterable dataset; deepspec's map-style dataset through torch's default collation, shuffled, and
deepspec's own batches as its trainer reads them, loader.batches: a batch sampler's index lists,
each batch read straight into its collated layout), the second epoch timed. The contenders
alternate, `--repeats` times; the table holds the median GB/s of sample bytes (what the arrays
returned hold) and the ratio to litdata. deepspec runs with its crc32c checks on (the default) and
off, and with checks on once more in two passes (a copy, then a crc32c: what the reader does where
its native copy-and-checksum kernel, deepspec/cache/read/_copycrc.c, is not built); neither peer
checks what it reads locally.

With `--s3` the same stores go to moto_server behind benchmarks/scale_s3.py's throttling proxy (a
delay per request and a paced rate per response stream, like one S3 stream): each contender opens
a fresh dataset (the peers a fresh local cache: they download whole chunks or shards; deepspec
reads byte ranges of the store, or mirrors whole arrays of its parts into a fresh `cache_dir`) and
reads every sample in a random order; printed are the time to the first sample, the GB/s of the rest,
and the GETs and bytes per sample that passed the proxy (it counts them).

mosaicml-streaming's package imports its vision datasets, which import torchvision; the CPU
torchvision wheel that matches torch is not on every index, so when torchvision cannot be imported
a stub stands in for it (nothing this benchmark calls reaches it).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

LAYERS = [1, 9, 17, 25, 33]
# loader-only contenders: deepspec's batches (loader.batches), as its trainer reads them
BATCHES = ("deepspec, batches", "deepspec, batches, two-pass")
TWO_PASS = "two-pass"  # a contender whose name ends so copies, then checksums (no native kernel)


def passes(name: str) -> None:
    """Before a contender runs (and forks its workers): one-pass checked copies (the native
    kernel, where it is built) or two passes."""
    import deepspec.cache.read.checks as checks
    import deepspec.cache.read.shards as shards

    shards.NATIVE_COPY = checks.NATIVE_COPY and not name.endswith(TWO_PASS)

H = 2560


def sample(i: int) -> dict[str, np.ndarray]:
    """Sample i: the same arrays for every writer (a function of i alone, so litdata's workers make it too)."""
    rng = np.random.default_rng(i)
    t = int(rng.integers(600, 1401))
    bits = rng.integers(0, 1 << 16, (len(LAYERS) + 1, t, H), dtype=np.uint32)
    hidden = ((bits & 0x807F) | (0x3800 + ((bits >> 7) & 0x1F) * 0x80)).astype(np.uint16)  # finite bf16
    return {"input_ids": rng.integers(0, 150_000, t).astype(np.int32), "loss_mask": rng.integers(0, 2, t).astype(np.uint8),
            "hidden": np.ascontiguousarray(hidden[:-1]), "last": np.ascontiguousarray(hidden[-1])}


def nbytes(item) -> int:
    if isinstance(item, dict):
        return sum(nbytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(nbytes(v) for v in item)
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if isinstance(item, np.ndarray):
        return item.nbytes
    return 0


def write_deepspec(root: Path, n: int, url: str | None = None, options: dict | None = None) -> str:
    from deepspec.cache.write.part_data import PartData
    from deepspec.cache.write.writer import CacheWriter

    manifest = {"target": {"id": "bench", "hidden_size": H}, "layers": LAYERS, "dtype": "bfloat16", "codec": "none",
                "max_length": 4096, "chunk_tokens": 64, "hidden_size": H}
    url = url or str(root / "deepspec.zarr")
    w = CacheWriter(url, manifest, options)
    per_part = -(-n // 4)
    for p in range(0, n, per_part):
        items = [sample(i) for i in range(p, min(n, p + per_part))]
        hidden = {layer: torch.from_numpy(np.concatenate([s["hidden"][k] for s in items])).view(torch.bfloat16)
                  for k, layer in enumerate(LAYERS)}
        hidden["last"] = torch.from_numpy(np.concatenate([s["last"] for s in items])).view(torch.bfloat16)
        w.write_part(PartData(f"p{p // per_part:06d}", np.arange(p, p + len(items), dtype=np.uint64) + 1,
                              np.array([len(s["input_ids"]) for s in items]),
                              np.concatenate([s["input_ids"] for s in items]),
                              np.concatenate([s["loss_mask"] for s in items]), hidden))
    w.write_manifest()
    w.release()
    return url


def write_litdata(root: Path, n: int) -> str:
    import litdata

    out = str(root / "litdata")
    litdata.optimize(fn=sample, inputs=list(range(n)), output_dir=out, chunk_bytes="64MB", num_workers=1,
                     mode="overwrite")
    # optimize() switches the process's multiprocessing start method to spawn; every DataLoader here
    # starts its workers the platform's default way (fork on Linux), as a training script would
    import multiprocessing

    multiprocessing.set_start_method("fork" if sys.platform == "linux" else "spawn", force=True)
    return out


def write_mds(root: Path, n: int) -> str:
    from streaming import MDSWriter

    out = str(root / "mds")
    columns = {"input_ids": "ndarray:int32", "loss_mask": "ndarray:uint8", "hidden": "ndarray:uint16",
               "last": "ndarray:uint16"}
    with MDSWriter(out=out, columns=columns, size_limit="64mb") as w:
        for i in range(n):
            w.write(sample(i))
    return out


def stub_torchvision() -> None:
    try:
        import torchvision  # noqa: F401
        return
    except Exception:  # absent, or a wheel built for another torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    # streaming imports transformers, which asks importlib whether torchvision exists (and caches the
    # answer): asked before the stub is in place, the answer is no, as it is
    import transformers.feature_extraction_utils  # noqa: F401
    tv = types.ModuleType("torchvision")
    datasets, transforms, functional = (types.ModuleType(f"torchvision.{m}") for m in
                                        ("datasets", "transforms", "transforms.functional"))

    class VisionDataset:  # what streaming.vision subclasses; never instantiated here
        pass

    def unavailable(*args, **kwargs):
        raise RuntimeError("torchvision is a stub in benchmarks/loader_peers.py")

    datasets.VisionDataset, datasets.CIFAR10, functional.to_tensor = VisionDataset, VisionDataset, unavailable
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional
    sys.modules.update({"torchvision": tv, "torchvision.datasets": datasets, "torchvision.transforms": transforms,
                        "torchvision.transforms.functional": functional})


def datasets(stores: dict[str, str]) -> dict:
    """Contender name -> map-style dataset, each library's own."""
    import litdata
    import streaming

    from deepspec.loader.dataset import TargetCacheDataset

    return {"deepspec, checks on": TargetCacheDataset(stores["deepspec"]),
            f"deepspec, checks on, {TWO_PASS}": TargetCacheDataset(stores["deepspec"]),
            "deepspec, checks off": TargetCacheDataset(stores["deepspec"], verify=False),
            "mosaicml-streaming": streaming.StreamingDataset(local=stores["mds"], batch_size=1, shuffle=False),
            "litdata": litdata.StreamingDataset(stores["litdata"])}


def map_style_gb_s(ds, order: list[int]) -> float:
    t0, total = time.perf_counter(), 0
    for i in order:
        total += nbytes(ds[i])
    return total / (time.perf_counter() - t0) / 1e9


def loader_gb_s(name: str, stores: dict[str, str], workers: int) -> float:
    """GB/s of the second epoch through a DataLoader with `workers` workers (the first starts them)."""
    import litdata
    import streaming
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    from deepspec.loader.batches import Batches
    from deepspec.loader.dataset import TargetCacheDataset

    common = {"batch_size": 1, "num_workers": workers, "persistent_workers": workers > 0}
    passes(name)
    if name in BATCHES:  # deepspec's own loader: a batch sampler's batches read straight into place
        ds = TargetCacheDataset(stores["deepspec"])
        batches = BatchSampler(RandomSampler(ds), 1, drop_last=False)
        loader = DataLoader(Batches(ds), sampler=batches, **dict(common, batch_size=None))
    elif name.startswith("deepspec"):
        ds = TargetCacheDataset(stores["deepspec"], verify="checks off" not in name)
        loader = DataLoader(ds, shuffle=True, **common)  # torch's default collation, as the peers' loaders
    elif name == "litdata":
        loader = litdata.StreamingDataLoader(litdata.StreamingDataset(stores["litdata"], shuffle=True), **common)
    else:
        ds = streaming.StreamingDataset(local=stores["mds"], batch_size=1, shuffle=True)
        loader = streaming.StreamingDataLoader(ds, **common)
    for _ in loader:
        pass
    t0, total = time.perf_counter(), 0
    for batch in loader:
        total += nbytes(batch)
    return total / (time.perf_counter() - t0) / 1e9


def s3_rows(args, stores: dict[str, str], tmp: Path) -> list[dict]:
    """The same samples on S3 (moto_server behind scale_s3.py's throttling proxy): per contender and
    repeat, a fresh dataset (and a fresh local cache for the peers, which download whole chunks or
    shards) reads every sample in a random order; time to the first sample, GB/s of the rest, and
    the GETs and bytes that passed the proxy per sample."""
    import fsspec
    import litdata
    import requests
    import streaming

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scale_s3 import LATENCY_S, STREAM_BYTES_S, moto_behind_proxy

    from deepspec.loader.dataset import TargetCacheDataset

    with moto_behind_proxy("peers") as (moto, proxy, _):
        direct = {"endpoint_url": moto, "key": "bench", "secret": "bench"}
        write_deepspec(tmp, args.samples, "s3://peers/deepspec.zarr", direct)
        fs = fsspec.filesystem("s3", **direct)
        for name in ("litdata", "mds"):
            fs.put(stores[name], f"peers/{name}", recursive=True)
        os.environ["S3_ENDPOINT_URL"] = proxy  # mosaicml-streaming's endpoint setting
        through = {"endpoint_url": proxy, "key": "bench", "secret": "bench"}
        opened = {
            "deepspec, range reads": lambda cache: TargetCacheDataset("s3://peers/deepspec.zarr", storage_options=through),
            "deepspec, part mirror": lambda cache: TargetCacheDataset("s3://peers/deepspec.zarr", storage_options=through,
                                                                      cache_dir=str(cache)),
            "mosaicml-streaming": lambda cache: streaming.StreamingDataset(remote="s3://peers/mds", local=str(cache),
                                                                           batch_size=1, shuffle=False),
            "litdata": lambda cache: litdata.StreamingDataset(
                "s3://peers/litdata", cache_dir=str(cache),
                storage_options={"endpoint_url": proxy, "aws_access_key_id": "bench", "aws_secret_access_key": "bench"}),
        }
        rows = []
        for rep in range(args.repeats):
            order = list(range(args.samples))
            random.Random(100 + rep).shuffle(order)
            for name, make in opened.items():
                cache = Path(tempfile.mkdtemp(prefix=f"{name[:4]}-", dir=tmp))
                requests.get(f"{proxy}/__counts?reset=1")
                t0 = time.perf_counter()
                ds = make(cache)
                nbytes(ds[order[0]])
                first = time.perf_counter() - t0
                t1, total = time.perf_counter(), 0
                for i in order[1:]:
                    total += nbytes(ds[i])
                steady = total / (time.perf_counter() - t1) / 1e9
                c = requests.get(f"{proxy}/__counts").json()
                rows.append({"repeat": rep, "contender": name, "first_sample_s": round(first, 2),
                             "GB_s": round(steady, 3), "GETs_per_sample": round(c.get("GET", 0) / args.samples, 2),
                             "other_requests": sum(v for k, v in c.items() if k not in ("GET", "bytes")),
                             "MB_fetched_per_sample": round(c.get("bytes", 0) / args.samples / 1e6, 1)})
                print(json.dumps(rows[-1]), flush=True)
                del ds
        print(json.dumps({"proxy_latency_ms": LATENCY_S * 1e3, "proxy_stream_MB_s": STREAM_BYTES_S / 1e6}))
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", type=Path, help="where the three stores go (default: a temporary directory)")
    ap.add_argument("--s3", action="store_true", help="also on S3: moto_server behind scale_s3.py's throttling proxy")
    ap.add_argument("--s3-only", action="store_true", help="only the S3 part")
    args = ap.parse_args()
    stub_torchvision()
    import litdata
    import streaming

    with tempfile.TemporaryDirectory(prefix="loader-peers-", dir=args.dir) as tmp:
        root = Path(tmp)
        stores = {}
        for name, write in (("deepspec", write_deepspec), ("litdata", write_litdata), ("mds", write_mds)):
            t0 = time.perf_counter()
            stores[name] = write(root, args.samples)
            size = sum(f.stat().st_size for f in Path(stores[name]).rglob("*") if f.is_file())
            print(json.dumps({"written": name, "seconds": round(time.perf_counter() - t0, 1), "GB": round(size / 1e9, 3),
                              "files": sum(1 for f in Path(stores[name]).rglob("*") if f.is_file())}), flush=True)
        if args.s3 or args.s3_only:
            s3 = s3_rows(args, stores, root)
        if args.s3_only:
            return print_s3(s3)
        sets = datasets(stores)
        assert all(len(ds) == args.samples for ds in sets.values()), {k: len(v) for k, v in sets.items()}
        for i in random.Random(1).sample(range(args.samples), 3):  # the same sample from every store
            want = sample(i)
            for name, ds in sets.items():
                got = ds[i]
                if name.startswith("deepspec"):
                    assert np.array_equal(got["input_ids"].numpy(), want["input_ids"]), name
                    assert np.array_equal(got["hidden"].view(torch.uint16).numpy(), want["hidden"]), name
                else:
                    assert all(np.array_equal(np.asarray(got[k]), v) for k, v in want.items()), name
        for ds in sets.values():  # page cache hot, metadata read
            map_style_gb_s(ds, list(range(args.samples)))
        results = {name: {"map": [], "loader": []} for name in [*sets, *BATCHES]}
        for rep in range(args.repeats):
            order = list(range(args.samples))
            random.Random(rep).shuffle(order)
            for name, ds in sets.items():
                passes(name)
                results[name]["map"].append(map_style_gb_s(ds, order))
            for name in results:
                results[name]["loader"].append(loader_gb_s(name, stores, args.workers))
            print(json.dumps({"repeat": rep, **{k: {m: round(v[m][-1], 2) for m in v if v[m]} for k, v in results.items()}}),
                  flush=True)
    if args.s3:
        print_s3(s3)
    med = {name: {m: statistics.median(v) if v else float("nan") for m, v in r.items()} for name, r in results.items()}
    ref = med["litdata"]
    print(f"\n{args.samples} samples, {args.repeats} interleaved repeats, median GB/s of sample bytes "
          f"(litdata {litdata.__version__}, mosaicml-streaming {streaming.__version__}, {os.cpu_count()} CPUs)")
    print(f"{'contender':<30} {'ds[i] GB/s':>11} {'vs litdata':>11} {f'loader {args.workers}w GB/s':>16} {'vs litdata':>11}")
    for name, m in med.items():
        mapped = (f"{m['map']:>11.2f} {m['map'] / ref['map']:>10.2f}x" if m['map'] == m['map']  # not nan
                  else f"{'-':>11} {'-':>11}")
        print(f"{name:<30} {mapped} {m['loader']:>16.2f} {m['loader'] / ref['loader']:>10.2f}x")


def print_s3(rows: list[dict]) -> None:
    print("\nS3 through the throttling proxy, median of the repeats")
    print(f"{'contender':<24} {'first sample s':>15} {'GB/s':>7} {'GETs/sample':>12} {'MB fetched/sample':>18}")
    for name in dict.fromkeys(r["contender"] for r in rows):
        mine = [r for r in rows if r["contender"] == name]
        med = {k: statistics.median(r[k] for r in mine) for k in ("first_sample_s", "GB_s", "GETs_per_sample",
                                                                  "MB_fetched_per_sample")}
        print(f"{name:<24} {med['first_sample_s']:>15.2f} {med['GB_s']:>7.3f} {med['GETs_per_sample']:>12.2f} "
              f"{med['MB_fetched_per_sample']:>18.1f}")


if __name__ == "__main__":
    main()
