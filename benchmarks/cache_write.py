"""Cache writing, measured side by side in one run on real activations of the embedded target.

    python benchmarks/cache_write.py [--target data/target] [--rows 600] [--repeat 8]
    python benchmarks/cache_write.py --parts [--widths 128,2560] [--part-tokens 16384] [--storage hdf5] [--code DIR]
                                     [--threads 1,2]

Prints
  1. writer MB/s vs raw numpy.memmap writes of the same bytes (ratio),
  2. bytes/token on disk for each dtype/codec vs the reference's raw layout (ratio), with the
     8-bit modes' error on these activations (fp8 e4m3 and int8 absmax, per-token scale),
  3. cache-stage wall time vs forward-only time over the same rows (overlap ratio; goal <= 1.10).
Needs data/target and data/regen/train.jsonl (run `make repro` first).

`--parts` measures the streamed writer alone, as the cache stage and a read-through run feed it
(CacheWriter.submit of a part's batches; the writer thread encodes, checksums, writes, fsyncs and
commits), on synthetic bf16 bits of each width (5 layers and the last state, 512-token samples, part k's last
sample k tokens shorter, so that no two parts have arrays of the same shape):
ms per part and GB/s of state bytes, beside plain files of the same bytes (one file per array,
written in 256 KB pieces, the fastest size on the VM this was written on, and fsynced at the end of
each part: no chunks, checksums, metadata, commit or early writeback). With
`--threads 1,2` the writer runs with each of these thread counts (CacheWriter's `threads`;
the cache stage uses devices.writer_threads: one on a CPU). With
`--code DIR` the writer of another checkout (e.g. a worktree of the previous commit) runs too,
interleaved, each in a fresh process; the page cache is synced before every run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from deepspec.cache.build.stage import build_cache, compute_part, load_target
from deepspec.cache.spec.plan import part_ranges, store_order
from deepspec.cache.tools.estimate import reference_bytes_per_token
from deepspec.cache.spec.format import decode_hidden, encode_hidden
from deepspec.cache.tools.verify import disk_usage
from deepspec.cache.write.part_data import PartData
from deepspec.cache.build.regen_rows import EncodeRules, encode_rows
from deepspec.cache.write.writer import CacheWriter
from deepspec.config import CacheConfig
from deepspec.io import read_jsonl

LAYERS = [1, 9, 17, 25, 33]  # --layers overrides (e.g. for a 30-layer target)


def activations(target: Path, rows: list[dict]) -> PartData:
    tok, model = load_target(target, torch.device("cpu"))
    samples, _ = encode_rows(tok, rows, EncodeRules(1024))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    part = compute_part(model, "p000000", samples, LAYERS, 8192, pad, torch.device("cpu"))
    part.hidden = {k: decode_hidden(bits, scale, "bfloat16").float() for k, (bits, scale) in part.hidden.items()}
    return part


def tile(part: PartData, repeat: int, name: str = "p000000") -> PartData:
    return PartData(name, np.concatenate([part.sample_ids + np.uint64(i * 10**6) for i in range(repeat)]),
                    np.tile(part.lengths, repeat), np.tile(part.input_ids, repeat), np.tile(part.loss_mask, repeat),
                    {k: v.repeat(repeat, 1) for k, v in part.hidden.items()})


def manifest(dtype: str, codec: str, hidden: int) -> dict:
    return {"target": {"id": "bench", "hidden_size": hidden}, "layers": LAYERS, "dtype": dtype, "codec": codec,
            "max_length": 1024, "chunk_tokens": 64, "hidden_size": hidden}


def write_store(root: Path, part: PartData, dtype: str, codec: str) -> float:
    shutil.rmtree(root, ignore_errors=True)
    w = CacheWriter(str(root), manifest(dtype, codec, part.hidden["last"].shape[1]))
    t0 = time.perf_counter()
    w.write_part(part)
    os.sync()
    elapsed = time.perf_counter() - t0
    w.release()
    return elapsed


def write_memmap(root: Path, part: PartData) -> float:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    arrays = {"input_ids": part.input_ids.astype(np.int32), "loss_mask": part.loss_mask}
    t0 = time.perf_counter()
    for k, v in part.hidden.items():  # the same conversion work as the writer: float -> bf16 bits
        arrays[f"h{k}"] = encode_hidden(v, "bfloat16")[0]
    for name, a in arrays.items():
        mm = np.lib.format.open_memmap(root / f"{name}.npy", mode="w+", dtype=a.dtype, shape=a.shape)
        mm[...] = a
        mm.flush()
        del mm
    os.sync()
    return time.perf_counter() - t0


def quant_error(x: torch.Tensor) -> dict:
    """Per-token cosine and relative L2 error of fp8-e4m3 and int8-absmax (both with per-token scale)."""
    x = x.float()
    bits, scale = encode_hidden(x, "fp8")
    fp8 = decode_hidden(bits, scale, "fp8").float()
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    int8 = (x / s).round().clamp(-127, 127) * s
    out = {}
    for name, y in (("fp8_e4m3", fp8), ("int8_absmax", int8)):
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
        rel = (x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)
        out[name] = {"cos_min": round(float(cos.min()), 5), "cos_mean": round(float(cos.mean()), 6),
                     "rel_l2_mean": round(float(rel.mean()), 5)}
    return out


PART_LAYERS = [1, 9, 17, 25, 33]


def parts_child(width: int, part_tokens: int, parts: int, batch: int, raw: bool, storage: str = "zarr",
                threads: int = 1) -> dict:
    """One run of --parts in this process: the writer (of whichever checkout is on sys.path), or
    plain files."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, (batch, width), dtype=np.uint16)
    arrays = [*PART_LAYERS, "last"]
    n = part_tokens // 512
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        t0 = time.perf_counter()
        if raw:
            for p in range(parts):
                files = [open(Path(tmp) / f"p{p}-{a}", "xb") for a in arrays]
                for _ in range(part_tokens // batch):
                    for f in files:
                        view = memoryview(bits).cast("B")
                        for a in range(0, len(view), 1 << 18):
                            f.write(view[a:a + (1 << 18)])
                for f in files:
                    f.flush()
                    os.fsync(f.fileno())
                    f.close()
        else:
            from deepspec.cache.write.writer import CacheWriter

            man = {"target": {"id": "bench", "hidden_size": width}, "layers": PART_LAYERS, "dtype": "bfloat16",
                   "codec": "none", "max_length": 1024, "chunk_tokens": 64, "hidden_size": width, "storage": storage}
            writer = CacheWriter(str(Path(tmp) / "s.zarr"), man, **({"threads": threads} if threads > 1 else {}))
            for p in range(parts):
                lengths = np.full(n, 512, np.int64)
                lengths[-1] -= p  # parts of the same shape would share their array documents
                tokens = int(lengths.sum())
                batches = ({a: (bits[:min(batch, tokens - at)], None) for a in arrays} for at in range(0, tokens, batch))
                writer.submit(PartData(None, np.arange(p * n, (p + 1) * n, dtype=np.uint64), lengths,
                                       rng.integers(0, 1000, tokens).astype(np.int32), np.ones(tokens, np.uint8),
                                       batches=batches))
            writer.close(consolidate=False)
            writer.release()
        elapsed = time.perf_counter() - t0
    gb = parts * part_tokens * width * 2 * len(arrays) / 1e9
    return {"ms_per_part": round(elapsed / parts * 1e3, 1), "GB_s": round(gb / elapsed, 3)}


def parts_bench(args) -> None:
    import statistics
    import subprocess
    import sys

    here = Path(__file__).resolve()
    threads = [int(t) for t in args.threads.split(",")]
    codes = [(f"this, {t} thr" if len(threads) > 1 else "this", here.parents[1], t) for t in threads]
    if args.code:
        codes += [(f"--code, {t} thr" if len(threads) > 1 else "--code", Path(args.code).resolve(), t) for t in threads]
    rows = []
    for width in [int(w) for w in args.widths.split(",")]:
        parts = max(4, min(24, (2 << 30) // (args.part_tokens * width * 12)))  # about 2 GB a run at most
        got: dict = {}
        for rep in range(args.repeats):
            for name, code, n_threads in [*codes, ("plain files", None, 1)]:
                os.sync()
                cmd = [sys.executable, str(here), "--parts-child", str(width), str(args.part_tokens), str(parts),
                       "--storage", args.storage, "--threads", str(n_threads)]
                if code is None:
                    cmd.append("--raw")
                env = dict(os.environ, PYTHONPATH=str(code or here.parents[1]))
                out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=code or here.parents[1])
                row = json.loads(out.stdout.strip().splitlines()[-1])
                got.setdefault(name, []).append(row)
                print(json.dumps({"width": width, "repeat": rep, "writer": name, **row}), flush=True)
        floor = statistics.median(r["ms_per_part"] for r in got["plain files"])
        for name, runs in got.items():
            ms = statistics.median(r["ms_per_part"] for r in runs)
            rows.append((width, parts, name, ms, statistics.median(r["GB_s"] for r in runs), ms / floor))
    print(f"\n{args.storage}: streamed parts of {args.part_tokens} tokens (5 layers + last, bf16), median of "
          f"{args.repeats} interleaved runs")
    print(f"{'width':>6} {'parts':>5}  {'writer':<13} {'ms/part':>8} {'GB/s':>6} {'vs plain':>8}")
    for width, parts, name, ms, gbs, ratio in rows:
        print(f"{width:>6} {parts:>5}  {name:<13} {ms:>8.1f} {gbs:>6.2f} {ratio:>7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", action="store_true", help="the streamed writer per part, beside plain files")
    ap.add_argument("--widths", default="128,2560")
    ap.add_argument("--part-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--code", help="with --parts: also the writer of this checkout")
    ap.add_argument("--threads", default="1", help="with --parts: the writer's thread counts to run (e.g. 1,2)")
    ap.add_argument("--storage", default="zarr", choices=["zarr", "hdf5"], help="with --parts: the store's backend")
    ap.add_argument("--parts-child", nargs=3, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--target", default="data/target")
    ap.add_argument("--regen", default="data/regen/train.jsonl")
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=8, help="tile the real activations to this many copies")
    ap.add_argument("--layers", default="", help="comma-separated layer ids (default 1,9,17,25,33)")
    args = ap.parse_args()
    if args.parts_child:
        width, part_tokens, parts = args.parts_child
        print(json.dumps(parts_child(width, part_tokens, parts, 4096, args.raw, args.storage, int(args.threads))))
        return
    if args.parts:
        parts_bench(args)
        return
    if args.layers:
        LAYERS[:] = [int(x) for x in args.layers.split(",")]
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = list(read_jsonl(args.regen))[: args.rows]
    real = activations(Path(args.target), rows)
    part = tile(real, args.repeat)
    H = part.hidden["last"].shape[1]
    tokens = int(part.lengths.sum())
    payload = tokens * (4 + 1 + len(part.hidden) * H * 2)
    report: dict = {"tokens": tokens, "hidden_size": H, "payload_MB": round(payload / 1e6, 1)}

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        # 1. writer vs memmap, alternating to share the machine's noise
        w_times, m_times = [], []
        for _ in range(3):
            m_times.append(write_memmap(tmp / "raw", part))
            w_times.append(write_store(tmp / "zarr", part, "bfloat16", "none"))
        w, m = min(w_times), min(m_times)
        report["write"] = {"writer_MB_s": round(payload / w / 1e6, 1), "memmap_MB_s": round(payload / m / 1e6, 1),
                           "ratio_writer_vs_memmap": round(m / w, 3)}

        # 2. bytes/token per dtype/codec vs the reference layout
        ref = reference_bytes_per_token(H, len(LAYERS))
        sizes = {}
        for dtype, codec in (("bfloat16", "none"), ("bfloat16", "blosc-lz4"), ("bfloat16", "blosc-zstd"),
                             ("fp8", "none"), ("fp8", "blosc-zstd")):
            secs = write_store(tmp / f"{dtype}-{codec}", part, dtype, codec)
            size, files = disk_usage(str(tmp / f"{dtype}-{codec}"))
            sizes[f"{dtype}/{codec}"] = {"bytes_per_token": round(size / tokens, 1),
                                         "ratio_vs_reference": round(size / tokens / ref, 4),
                                         "write_MB_s": round(payload / secs / 1e6, 1), "files": files}
        report["bytes_per_token"] = {"reference_layout": ref, **sizes}
        report["quantization_error"] = {str(k): quant_error(real.hidden[k]) for k in (*LAYERS[::2], "last")}

        # 3. the stage: forward-only vs forward + background writes, over the same rows
        regen = tmp / "regen.jsonl"
        regen.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tok, model = load_target(Path(args.target), torch.device("cpu"))
        samples, _ = encode_rows(tok, rows, EncodeRules(1024))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        cfg = CacheConfig(url=str(tmp / "stage.zarr"), part_tokens=4096)
        t0 = time.perf_counter()
        lengths = np.array([len(s.input_ids) for s in samples])
        keys = np.array([s.key for s in samples], dtype=np.uint64)
        for k, (a, b) in enumerate(part_ranges(lengths, keys, cfg.part_tokens)):  # the stage's own plan
            part = [samples[i] for i in store_order(np.arange(a, b), lengths)]
            compute_part(model, f"p{k:06d}", part, LAYERS, cfg.batch_tokens, pad, torch.device("cpu"))
        forward_only = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_target(Path(args.target), torch.device("cpu"))
        encode_rows(tok, rows, EncodeRules(1024))
        setup = time.perf_counter() - t0  # what the stage does before its first forward
        t0 = time.perf_counter()
        build_cache(cfg, LAYERS, regen, Path(args.target))
        os.sync()
        stage = time.perf_counter() - t0
        report["stage"] = {"forward_only_s": round(forward_only, 2), "stage_s": round(stage, 2),
                           "setup_s": round(setup, 2),
                           "overlap_ratio": round((stage - setup) / forward_only, 3),
                           "note": "overlap_ratio = (stage - loading the model and tokenising) / forward-only"}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
