"""How the lake's costs grow with size (issue 15), one table per section, sizes spanning >= 10x.

    python benchmarks/scale.py [--only cache_rss,...] [--rows 1000,3000,10000] [--code DIR]

Each section is one function registered with `@section`; `--only` runs a subset. Sections:
  cache_rss  peak RSS of the cache stage above its post-import baseline vs number of regen rows,
             each size in a fresh subprocess (the kernel's VmHWM minus the RSS after the imports and
             a warm-up build of 8 rows). Synthetic rows through a synthetic target of real width
             (Qwen3, hidden 2,560, one decoder layer, random weights, the builtin tokenizer); the
             forward pass is not the point. The rows are realistic in size (--row-chars of answer
             text, about a regen answer) but `max_length` cuts each to a few tokens, so the forward
             passes and the bytes written stay small while what a build holds per row does not.
             With `--code DIR` the stage runs from another checkout (e.g. the previous commit's,
             `git worktree add` or `git archive | tar -x`) for a side-by-side table.
  part_rss   the same peak RSS vs `cache.part_tokens` (--part-sizes) at a fixed forward batch
             (--batch-tokens, default 1,024), for the last --rows value: the writer streams a
             part's shards batch by batch, so it stays flat where a writer that holds parts grows
             (compare with --code).
  regen_rss  peak RSS above the post-import baseline of the regen stage's resume-and-write path vs
             journal rows (--regen-rows, answers of --row-chars): the journal is opened (its
             recovery pass), the split file read in input order and every finished row written to
             train.jsonl, as a rerun after a crash does; beside it, in its own process, the same
             rows held in a dict and a list (what the stage did before it streamed).
  train_init_rss  peak RSS above the post-import baseline of building a fresh draft from a target of
             real width and >= 2 GB on disk (Qwen3-4B's H = 2,560, V = 151,936, intermediate 9,728,
             --init-layers decoder layers, bf16 safetensors), less the draft's own parameters: what
             reading the target costs beyond the draft. This code reads the embedding and lm_head
             slice by slice from the safetensors; `whole` loads the target in float32 and copies
             them (what the stage did before). Each run in a fresh process.
  train_accum_rss  peak RSS above baseline of training steps vs train.grad_accum (--accum, e.g.
             1 vs 64) at a fixed micro-batch, on a cache of --train-tokens-token samples of the
             synthetic target (H = 2,560): micro-batches that stream stay flat, a trainer that
             collects a step's micro-batches before the first backward grows with grad_accum (compare
             with --code).
  index      manifest/index bytes written vs parts, store open time and requests (local, moto S3)
             vs parts, files per part and per TB: benchmarks/scale_index.py (its own options there).
  s3         S3 read throughput vs requests in flight through a throttling proxy in front of moto:
             benchmarks/scale_s3.py.
  split_rss  peak RSS above baseline of the split stage vs source rows (--regen-rows, answers of
             --row-chars), streamed to its files vs every kept row held in lists (what it did before).
  stages     every stage in one table: split and regen at --regen-rows, cache at --rows, train at
             --stage-accum, each with its log-log slope (0 = flat).
  dvc        `dvc add` / `dvc status` / `dvc push` (to moto) time vs files in a store, extrapolated
             to the reference cache's file counts: benchmarks/scale_dvc.py.
  reader_rss loader RSS (the process and its DataLoader workers) vs parts read, over one epoch of a
             store of --reader-parts parts (Zarr and HDF5), with 0 and 2 workers, and the slope in MB
             per 1,000 parts: what a reading process keeps of the parts it touched (shard indexes,
             chunk tables, layouts) is bounded, so the slope (over the epoch's second half) is ~0.
             Parts are small but have many chunks (chunk_tokens 1), so their tables weigh what a
             reference-size part's do relative to its data. With --code, side by side.
The delegated sections run as their own scripts (their options: `--help` of each).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS: dict = {}

WORDS = ("the a of to in is it that for on with as was at by an be this from or have not are but "
         "what which one all were when we there can more if out so said up its about into than them "
         "number plus sum answer result value first second third step because therefore").split()


def section(fn):
    SECTIONS[fn.__name__] = fn
    return fn


def table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n## {title}")
    for k, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


# ---- cache_rss -------------------------------------------------------------------------------------
def synthetic_rows(n: int, chars: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        answer, size = [], 0
        while size < chars:
            w = rng.choice(WORDS)
            answer.append(w)
            size += len(w) + 1
        rows.append({"id": f"{i + 1:016x}", "conversations": [
            {"role": "user", "content": f"{rng.choice(WORDS)}?"},
            {"role": "assistant", "content": " ".join(answer)}]})
    return rows


def synthetic_target(out: Path, hidden: int = 2560) -> Path:
    """A random Qwen3 of real width, one decoder layer, small heads/MLP/vocab: loading and a forward
    pass cost little, the hidden states a part holds are as wide as the reference target's."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from deepspec.io import write_json
    from deepspec.models.target import default_generation_config, identity
    from deepspec.embedded.tiny import build_tokenizer, conversation_text

    tok = build_tokenizer([conversation_text(r["conversations"]) for r in synthetic_rows(200, 400)], 512)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=True, torch_dtype="float32",
                      bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                      pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config = default_generation_config(cfg.eos_token_id, cfg.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    write_json(out / "identity.json", identity(out))
    return out


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def cache_child(spec: dict) -> None:
    """One cache stage in this (fresh) process; prints its memory as JSON. The baseline is taken
    after the imports and a warm-up build of a few rows into another store, so the stage's lazy
    imports (safetensors, accelerate, boto3, zarr codecs) and one-time allocations are in it; the
    kernel's peak (VmHWM) is then reset and read again after the measured build."""
    import gc

    import torch

    from deepspec.cache.build.stage import build_cache
    from deepspec.config import CacheConfig

    torch.set_num_threads(spec["threads"])

    def build(url: str, regen: str) -> dict:
        # `truncate`: each row cut at max_length, mid-answer (the default cut_turn would drop rows whose
        # one answer does not fit), so every row is a sample of a few tokens
        cfg = CacheConfig(url=url, part_tokens=spec["part_tokens"], batch_tokens=spec["batch_tokens"],
                          max_length=spec["max_length"], dtype=spec["dtype"], overlong="truncate")
        return build_cache(cfg, spec["layers"], Path(regen), Path(spec["target"]))

    build(spec["url"] + ".warm", spec["warm"])
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    base = status_kb("VmRSS")
    t0 = time.time()
    report = build(spec["url"], spec["regen"])
    peak = status_kb("VmHWM")
    print(json.dumps({"baseline_kb": base, "peak_kb": peak, "wall_s": round(time.time() - t0, 1),
                      "samples": report["manifest"]["num_samples"], "parts": len(report["manifest"]["parts"]),
                      "dropped": len(report["dropped"])}))


def run_cache(code: Path, root: Path, target: Path, rows: int, args) -> dict:
    regen, warm = root / f"regen-{rows}.jsonl", root / "warm.jsonl"
    for path, n, seed in ((regen, rows, 1), (warm, 8, 2)):
        with open(path, "w") as f:
            for r in synthetic_rows(n, args.row_chars, seed=seed):
                f.write(json.dumps(r) + "\n")
    spec = {"url": str(root / f"cache-{rows}-{code.name}.zarr"), "regen": str(regen), "warm": str(warm),
            "target": str(target),
            "layers": [-1], "part_tokens": args.part_tokens, "batch_tokens": args.batch_tokens or args.part_tokens,
            "max_length": args.max_length, "dtype": "fp8", "threads": args.threads}
    env = dict(os.environ, PYTHONPATH=str(code), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                          env=env, capture_output=True, text=True, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"cache stage at {rows} rows failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    import shutil

    shutil.rmtree(spec["url"])
    shutil.rmtree(spec["url"] + ".warm")
    regen.unlink()
    return out


def rss_sweep(args, sizes: list, run) -> tuple[list, dict]:
    """`run(code, root, target, size)` for each size, with this checkout and `--code`'s, on one
    synthetic target; returns the code labels and {(label, size): result} (each also on stderr)."""
    codes = [("this", REPO)] + ([("--code", Path(args.code).resolve())] if args.code else [])
    results = {}
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        root = Path(tmp)
        target = synthetic_target(root / "target")
        for label, code in codes:
            for size in sizes:
                results[(label, size)] = r = run(code, root, target, size)
                print(f"  {label} {size}: {json.dumps(r)}", file=sys.stderr)
    return [label for label, _ in codes], results


def above_baseline(labels: list, sizes: list, results: dict):
    """(label, size, result, MB above the baseline, that vs the smallest size) per run."""
    for label in labels:
        first = None
        for size in sizes:
            r = results[(label, size)]
            above = (r["peak_kb"] - r["baseline_kb"]) / 1024
            first = first if first is not None else above
            yield label, size, r, round(above, 1), f"{above / first:.2f}x"


@section
def cache_rss(args) -> None:
    sizes = [int(s) for s in args.rows.split(",")]
    labels, results = rss_sweep(args, sizes, lambda code, root, target, n: run_cache(code, root, target, n, args))
    rows = [[label, n, r["samples"], r["parts"], round(r["baseline_kb"] / 1024), above, ratio, r["wall_s"]]
            for label, n, r, above, ratio in above_baseline(labels, sizes, results)]
    table(f"cache stage: peak RSS above post-import baseline vs regen rows (H=2560, part_tokens="
          f"{args.part_tokens}, max_length={args.max_length}, {args.row_chars}-char answers, fp8, layers [-1])",
          ["code", "rows", "samples", "parts", "baseline_MB", "above_MB", "vs_smallest", "wall_s"], rows)


@section
def part_rss(args) -> None:
    """Peak RSS vs part size at a fixed forward batch: a writer that holds a part (and queues more)
    grows with part_tokens; one that streams a part's shards batch by batch does not."""
    import copy

    sizes = [int(s) for s in args.part_sizes.split(",")]
    n_rows = int(args.rows.split(",")[-1])
    batch_tokens = args.batch_tokens or 1024

    def run(code, root, target, size):
        a = copy.copy(args)
        a.part_tokens, a.batch_tokens = size, batch_tokens
        return run_cache(code, root, target, n_rows, a)

    labels, results = rss_sweep(args, sizes, run)
    rows = [[label, size, r["parts"], r["samples"], above, ratio, r["wall_s"]]
            for label, size, r, above, ratio in above_baseline(labels, sizes, results)]
    table(f"cache stage: peak RSS above post-import baseline vs part_tokens ({n_rows} rows, batch_tokens="
          f"{batch_tokens}, H=2560, max_length={args.max_length}, fp8, layers [-1])",
          ["code", "part_tokens", "parts", "samples", "above_MB", "vs_smallest", "wall_s"], rows)


def regen_child(spec: dict) -> None:
    """The regen stage's journal and output path in this (fresh) process; prints its memory as JSON."""
    import gc

    from deepspec.config import RegenConfig, SamplingConfig
    from deepspec.data.journal import Journal
    from deepspec.data.regen import SplitRows, write_outputs

    cfg = RegenConfig(fraction=1.0)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = status_kb("VmRSS")
    t0 = time.time()
    journal = Journal(Path(spec["journal"]), "fp")
    rows = SplitRows(Path(spec["split"]), cfg)
    if spec["mode"] == "held":  # the journal's rows parsed into a dict, the output a list of them
        done: dict = {}
        for line in open(journal.rows_path, "rb"):
            row = json.loads(line)
            done.setdefault(row["id"], row)
        ordered = [done[r["id"]] for r in rows if r["id"] in done]
    else:
        ordered = journal.in_order(rows)
    write_outputs(Path(spec["out"]), ordered, [], SamplingConfig(), "t" * 16)
    journal.close()
    print(json.dumps({"baseline_kb": base, "peak_kb": status_kb("VmHWM"), "wall_s": round(time.time() - t0, 1)}))


def run_regen_rss(root: Path, rows: int, mode: str, args) -> dict:
    split, journal, out = root / f"split-{rows}.jsonl", root / f"journal-{rows}", root / f"out-{rows}-{mode}"
    if not split.exists():
        journal.mkdir()
        (journal / "meta.json").write_text(json.dumps({"fingerprint": "fp"}))
        with open(split, "w") as s, open(journal / "rows.jsonl", "w") as j:
            for r in synthetic_rows(rows, args.row_chars):
                s.write(json.dumps(r) + "\n")
                j.write(json.dumps(dict(r, finish_reasons=["stop"], completion_tokens=100)) + "\n")
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    spec = {"split": str(split), "journal": str(journal), "out": str(out), "mode": mode}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--regen-child", json.dumps(spec)],
                          env=env, capture_output=True, text=True, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"regen at {rows} rows failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def streamed_vs_held(prefix: str, sizes: list[int], run) -> list[list]:
    """`run(root, size, mode)` for each size, streamed then held, in one temporary directory: table
    rows of (mode, size, MB above baseline, that vs the smallest size, wall s)."""
    out = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for mode in ("streamed", "held"):
            first = None
            for n in sizes:
                r = run(Path(tmp), n, mode)
                above = (r["peak_kb"] - r["baseline_kb"]) / 1024
                first = first if first is not None else above
                out.append([mode, n, round(above, 1), f"{above / first:.2f}x", r["wall_s"]])
                print(f"  {mode} {n}: {json.dumps(r)}", file=sys.stderr)
    return out


@section
def regen_rss(args) -> None:
    sizes = [int(s) for s in args.regen_rows.split(",")]
    out = streamed_vs_held("scale-regen-", sizes, lambda root, n, mode: run_regen_rss(root, n, mode, args))
    table(f"regen stage, journal recovery + output in input order: peak RSS above baseline vs journal rows "
          f"({args.row_chars}-char answers)", ["mode", "rows", "MB above baseline", "vs smallest", "wall s"], out)


# ---- split ---------------------------------------------------------------------------------------
def split_child(spec: dict) -> None:
    """The split stage on a source file in this (fresh) process; prints its memory as JSON."""
    import gc

    from deepspec.config import SplitConfig
    from deepspec.data.split import run_split, split_rows
    from deepspec.io import write_jsonl

    cfg = SplitConfig(source=spec["source"])
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = status_kb("VmRSS")
    t0 = time.time()
    if spec["mode"] == "held":  # every kept row in lists, then written (what the stage did before it streamed)
        result = split_rows(cfg)
        for name in ("train", "eval", "rejected"):
            write_jsonl(Path(spec["out"]) / f"{name}.jsonl", getattr(result, name))
    else:
        run_split(cfg, spec["out"])
    print(json.dumps({"baseline_kb": base, "peak_kb": status_kb("VmHWM"), "wall_s": round(time.time() - t0, 1)}))


def run_split_rss(root: Path, rows: int, mode: str, args) -> dict:
    source = root / f"source-{rows}.jsonl"
    if not source.exists():
        with open(source, "w") as f:
            for r in synthetic_rows(rows, args.row_chars, seed=5):
                f.write(json.dumps(r) + "\n")
    spec = {"source": str(source), "out": str(root / f"split-{rows}-{mode}"), "mode": mode}
    return run_child("--split-child", spec, REPO, root, f"split at {rows} rows")


@section
def split_rss(args) -> None:
    sizes = [int(s) for s in args.regen_rows.split(",")]
    out = streamed_vs_held("scale-split-", sizes, lambda root, n, mode: run_split_rss(root, n, mode, args))
    table(f"split stage: peak RSS above baseline vs source rows ({args.row_chars}-char answers)",
          ["mode", "rows", "MB above baseline", "vs smallest", "wall s"], out)


# ---- reader_rss ----------------------------------------------------------------------------------
def reader_store(url: str, kind: str, parts: int, tokens: int = 1024) -> None:
    """A store of `parts` parts of `tokens` tokens each (16 samples), hidden width 16, one chunk per token."""
    import numpy as np

    from deepspec.cache.write.part_data import PartData
    from deepspec.cache.write.writer import CacheWriter

    manifest = {"target": {"id": "reader-rss", "hidden_size": 16, "architecture": "synthetic"}, "layers": [0, 1],
                "dtype": "bfloat16", "codec": "none", "max_length": tokens, "chunk_tokens": 1, "hidden_size": 16,
                "storage": kind}
    rng = np.random.default_rng(0)
    with CacheWriter(url, manifest) as writer:
        for k in range(parts):
            lengths = np.full(16, tokens // 16, dtype=np.int64)
            hidden = {layer: (rng.integers(0, 2**16, size=(tokens, 16), dtype=np.uint16), None) for layer in (0, 1, "last")}
            writer.submit(PartData(None, np.arange(16, dtype=np.uint64) + 16 * k, lengths,
                                   rng.integers(0, 1000, size=tokens).astype(np.int32), np.ones(tokens, np.uint8), hidden))


def reader_child(spec: dict) -> None:
    """One epoch over the store in part order; prints RSS (this process + its workers) at checkpoints."""
    import psutil
    import torch
    from torch.utils.data import DataLoader

    from deepspec.loader.dataset import TargetCacheDataset

    torch.set_num_threads(1)
    ds = TargetCacheDataset(spec["url"])
    parts_of = ds.reader.part_start
    me = psutil.Process()

    def rss_mb() -> float:
        return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]) / 2**20

    loader = DataLoader(ds, batch_size=16, num_workers=spec["workers"], collate_fn=list,
                        persistent_workers=False, prefetch_factor=2 if spec["workers"] else None)
    marks, out, seen = set(spec["marks"]), [], 0
    for batch in loader:
        seen += len(batch)
        parts = int((parts_of <= seen - 1).sum())
        if parts in marks:
            marks.discard(parts)
            out.append([parts, round(rss_mb(), 1)])
    print(json.dumps(out))


@section
def reader_rss(args) -> None:
    codes = [("this", REPO)] + ([("--code", Path(args.code).resolve())] if args.code else [])
    n = args.reader_parts
    marks = sorted({max(1, n // 20), n // 4, n // 2, 3 * n // 4, n})
    rows = []
    with tempfile.TemporaryDirectory(prefix="reader-rss-") as tmp:
        for label, code in codes:
            for kind in ("zarr", "hdf5"):
                url = str(Path(tmp) / f"{label}-{kind}")
                t0 = time.time()
                env = dict(os.environ, PYTHONPATH=str(code))
                subprocess.run([sys.executable, "-c", "import sys, json; sys.path.insert(0, sys.argv[1]); "
                                "from benchmarks.scale import reader_store; reader_store(*json.loads(sys.argv[2]))",
                                str(REPO), json.dumps([url, kind, n])], env=env, check=True, cwd=REPO)
                print(f"  {label} {kind}: {n} parts written in {time.time() - t0:.0f} s", file=sys.stderr)
                for workers in (0, 2):
                    got = run_child("--reader-child", {"url": url, "workers": workers, "marks": marks}, code, tmp,
                                    "reader_rss")
                    # over the epoch's second half: by then every process (each worker reads its share of
                    # the parts) has filled its bounded caches, and what still grows is what is not bounded
                    (p0, r0), (p1, r1) = got[-3], got[-1]
                    slope = (r1 - r0) / max(p1 - p0, 1) * 1000
                    rows.append([label, kind, workers, " ".join(f"{p}:{r:.0f}" for p, r in got), f"{slope:.1f}"])
    table("reader_rss: loader RSS (MB, process + workers) vs parts read in one epoch",
          ["code", "store", "workers", "parts read: RSS MB", "MB per 1,000 parts"], rows)


# ---- train ---------------------------------------------------------------------------------------
def run_child(flag: str, spec: dict, code: Path, cwd, what: str) -> dict:
    """This script's `flag` child in a fresh process importing `code`; its last stdout line as JSON."""
    env = dict(os.environ, PYTHONPATH=str(code), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), flag, json.dumps(spec)], env=env,
                          capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def big_target(out: Path, layers: int) -> Path:
    """A random Qwen3-4B-shaped target with `layers` decoder layers, saved in bf16 (as the hub ships
    it), with the builtin tokenizer (its 512 tokens are fewer than the 151,936 embedding rows)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from deepspec.io import write_json
    from deepspec.models.target import default_generation_config, identity
    from deepspec.embedded.tiny import build_tokenizer, conversation_text

    tok = build_tokenizer([conversation_text(r["conversations"]) for r in synthetic_rows(200, 400)], 512)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                      pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config = default_generation_config(cfg.eos_token_id, cfg.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    write_json(out / "identity.json", identity(out))
    return out


def train_init_child(spec: dict) -> None:
    import gc

    import torch

    from deepspec.config import TrainConfig
    from deepspec.train.run import new_draft
    import transformers  # noqa: F401  (imports in the baseline)

    torch.set_num_threads(spec["threads"])
    target = Path(spec["target"])
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = status_kb("VmRSS")
    t0 = time.time()
    cfg = TrainConfig()
    if spec["mode"] == "whole":  # the stage's earlier way: the whole target in float32, two copies taken
        from transformers import AutoModelForCausalLM

        draft = new_draft(cfg, [-1], target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        draft.copy_target_embeddings(model)
        del model
    else:
        draft = new_draft(cfg, [-1], target)
    peak = status_kb("VmHWM")
    own = sum(t.numel() * t.element_size() for t in draft.state_dict().values()) // 1024
    print(json.dumps({"baseline_kb": base, "peak_kb": peak, "draft_kb": own, "wall_s": round(time.time() - t0, 1)}))


@section
def train_init_rss(args) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="scale-train-") as tmp:
        target = big_target(Path(tmp) / "target", args.init_layers)
        size_mb = sum(p.stat().st_size for p in target.glob("*.safetensors")) / 2 ** 20
        for mode in ("this", "whole"):
            r = run_child("--train-init-child", {"target": str(target), "mode": mode, "threads": args.threads},
                          REPO, tmp, f"draft init ({mode})")
            print(f"  {mode}: {json.dumps(r)}", file=sys.stderr)
            above = (r["peak_kb"] - r["baseline_kb"]) / 1024
            beyond = above - r["draft_kb"] / 1024
            rows.append([mode, round(size_mb), round(above), round(r["draft_kb"] / 1024), round(beyond),
                         f"{beyond / size_mb:.2f}x", r["wall_s"]])
    table(f"train stage, a fresh draft from a {args.init_layers}-layer Qwen3-4B-shaped target (bf16 on disk): peak RSS "
          "above baseline, and beyond the draft's own parameters, vs the target's size",
          ["read", "target_MB", "above_MB", "draft_MB", "beyond_draft_MB", "vs target size", "wall_s"], rows)


def train_accum_child(spec: dict) -> None:
    import gc

    import torch

    from deepspec.config import TrainConfig
    from deepspec.train.run import build_trainer

    torch.set_num_threads(spec["threads"])
    cfg = TrainConfig(steps=spec["steps"], grad_accum=spec["accum"], batch_size=spec["batch"], warmup_steps=0,
                      checkpoint_every=10 ** 6, markov_rank=8)
    root = Path(spec["root"])
    trainer = build_trainer(cfg, [-1], spec["cache"], Path(spec["target"]), root / "out", root / "state")
    trainer.callbacks = []
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = status_kb("VmRSS")
    t0 = time.time()
    trainer.fit()
    print(json.dumps({"baseline_kb": base, "peak_kb": status_kb("VmHWM"), "wall_s": round(time.time() - t0, 1)}))


def accum_sweep(args, accums: list[int], codes: list[tuple[str, Path]]) -> list[tuple[str, int, dict]]:
    """(code label, grad_accum, child result) for each code and grad_accum, on one cache."""
    import shutil

    from deepspec.cache.build.stage import build_cache
    from deepspec.config import CacheConfig

    out = []
    with tempfile.TemporaryDirectory(prefix="scale-accum-") as tmp:
        root = Path(tmp)
        target = synthetic_target(root / "target")
        regen = root / "regen.jsonl"
        n = max(accums) * args.train_batch * 2
        with open(regen, "w") as f:
            for r in synthetic_rows(n, args.train_tokens * 4, seed=3):
                f.write(json.dumps(r) + "\n")
        cache = root / "cache.zarr"
        build_cache(CacheConfig(url=str(cache), max_length=args.train_tokens, part_tokens=65536,
                                overlong="truncate"), [-1], regen, target)
        for label, code in codes:
            for a in accums:
                run = root / f"run-{label}-{a}"
                # the same micro-batches at every grad_accum (2 steps of the largest): only how they are
                # grouped into steps differs, not how much of the cache is read
                spec = {"cache": str(cache), "target": str(target), "root": str(run), "accum": a,
                        "batch": args.train_batch, "steps": 2 * max(accums) // a, "threads": args.threads}
                r = run_child("--train-accum-child", spec, code, tmp, f"training at grad_accum {a}")
                print(f"  {label} {a}: {json.dumps(r)}", file=sys.stderr)
                out.append((label, a, r))
                shutil.rmtree(run, ignore_errors=True)
    return out


@section
def train_accum_rss(args) -> None:
    accums = [int(a) for a in args.accum.split(",")]
    codes = [("this", REPO)] + ([("--code", Path(args.code).resolve())] if args.code else [])
    rows, first = [], {}
    for label, a, r in accum_sweep(args, accums, codes):
        above = (r["peak_kb"] - r["baseline_kb"]) / 1024
        first.setdefault(label, above)
        rows.append([label, a, round(above, 1), f"{above / first[label]:.2f}x", r["wall_s"]])
    table(f"train stage: peak RSS above baseline over {2 * max(accums)} micro-batches vs grad_accum (micro-batch {args.train_batch} x "
          f"{args.train_tokens} tokens, H=2560, layers [-1])", ["code", "grad_accum", "above_MB", "vs first", "wall_s"],
          rows)


# ---- every stage in one table --------------------------------------------------------------------
@section
def stages(args) -> None:
    """Each stage's peak RSS above its post-import baseline at three sizes spanning >= 10x, in one
    table with the log-log slope (0: flat; 1: grows with the size)."""
    import math

    three = [int(s) for s in args.regen_rows.split(",")]
    sweeps: list[tuple[str, str, list[int], list[dict]]] = []
    with tempfile.TemporaryDirectory(prefix="scale-stages-") as tmp:
        root = Path(tmp)
        sweeps.append(("split", "source rows", three, [run_split_rss(root, n, "streamed", args) for n in three]))
        sweeps.append(("regen", "journal rows", three, [run_regen_rss(root, n, "streamed", args) for n in three]))
    rows_sizes = [int(s) for s in args.rows.split(",")]
    _, cache = rss_sweep(args, rows_sizes, lambda code, root, target, n: run_cache(code, root, target, n, args))
    sweeps.append(("cache", "regen rows", rows_sizes, [cache[("this", n)] for n in rows_sizes]))
    accums = [int(a) for a in args.stage_accum.split(",")]
    sweeps.append(("train", "grad_accum", accums, [r for _, _, r in accum_sweep(args, accums, [("this", REPO)])]))
    out = []
    for stage, axis, sizes, results in sweeps:
        above = [max((r["peak_kb"] - r["baseline_kb"]) / 1024, 0.1) for r in results]
        slope = math.log(above[-1] / above[0]) / math.log(sizes[-1] / sizes[0])
        out.append([stage, axis, " / ".join(f"{s:,}" for s in sizes), " / ".join(f"{a:.1f}" for a in above),
                    f"{above[-1] / above[0]:.2f}x", f"{slope:.2f}", " / ".join(str(r["wall_s"]) for r in results)])
    table("every stage: peak RSS above the post-import baseline (MB) at three sizes; slope = d log(MB) / d log(size)",
          ["stage", "size", "sizes", "MB above baseline", "last vs first", "slope", "wall s"], out)
    print("(train, draft init, vs the target's size: section train_init_rss; the EAGLE-3 loss at V = 151,936: "
          "benchmarks/eagle3_memory.py)")


@section
def index(args) -> None:
    subprocess.run([sys.executable, str(REPO / "benchmarks/scale_index.py"),
                    *(["--old-src", args.code] if args.code else [])], check=True)


@section
def s3(args) -> None:
    subprocess.run([sys.executable, str(REPO / "benchmarks/scale_s3.py")], check=True)


@section
def dvc(args) -> None:
    subprocess.run([sys.executable, str(REPO / "benchmarks/scale_dvc.py")], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {sorted(SECTIONS)}")
    ap.add_argument("--rows", default="1000,3000,10000", help="cache_rss: regen row counts")
    ap.add_argument("--row-chars", type=int, default=1000, help="cache_rss: characters of each answer")
    ap.add_argument("--max-length", type=int, default=24, help="cache_rss: tokens kept of each row")
    ap.add_argument("--part-tokens", type=int, default=1024, help="cache_rss: cache.part_tokens")
    ap.add_argument("--batch-tokens", type=int, default=0, help="cache.batch_tokens (cache_rss: part_tokens; "
                    "part_rss: 1,024)")
    ap.add_argument("--part-sizes", default="2048,8192,32768", help="part_rss: cache.part_tokens values")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--code", help="cache_rss: also run the stage from this checkout, side by side")
    ap.add_argument("--regen-rows", default="10000,30000,100000", help="regen_rss: journal row counts; split_rss: "
                    "source row counts")
    ap.add_argument("--init-layers", type=int, default=7, help="train_init_rss: decoder layers of the target "
                    "(7: 2.2 GB of bf16 weights)")
    ap.add_argument("--accum", default="1,64", help="train_accum_rss: grad_accum values")
    ap.add_argument("--stage-accum", default="1,8,64", help="stages: grad_accum values of the train row")
    ap.add_argument("--train-batch", type=int, default=1, help="train_accum_rss: train.batch_size")
    ap.add_argument("--train-tokens", type=int, default=1024, help="train_accum_rss: tokens per sample")
    ap.add_argument("--reader-parts", type=int, default=2000, help="reader_rss: parts of the store read")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--reader-child", help=argparse.SUPPRESS)
    ap.add_argument("--train-init-child", help=argparse.SUPPRESS)
    ap.add_argument("--train-accum-child", help=argparse.SUPPRESS)
    ap.add_argument("--regen-child", help=argparse.SUPPRESS)
    ap.add_argument("--split-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.split_child:
        split_child(json.loads(args.split_child))
        return
    if args.child:
        cache_child(json.loads(args.child))
        return
    if args.reader_child:
        reader_child(json.loads(args.reader_child))
        return
    if args.regen_child:
        regen_child(json.loads(args.regen_child))
        return
    if args.train_init_child:
        train_init_child(json.loads(args.train_init_child))
        return
    if args.train_accum_child:
        train_accum_child(json.loads(args.train_accum_child))
        return
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; known: {sorted(SECTIONS)}")
    for name in args.only.split(","):
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
