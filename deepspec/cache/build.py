"""The `cache` stage: regen rows -> target forward passes -> store parts (Zarr or HDF5).

Part boundaries are a pure function of the rows still to do (greedy packing in input order up to
`cache.part_tokens`), so after a crash the rerun produces exactly the parts an uninterrupted run
would have. Forward passes run in length-sorted batches within a part; the writer thread encodes
and writes one part while the model computes the next.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from deepspec.cache.format import bytes_per_token, encode_hidden, sample_id_to_int
from deepspec.cache.lease import new_run_id
from deepspec.cache.store import check_lake, is_remote, store_url
from deepspec.cache.writer import CacheWriter, PartData
from deepspec.config import CacheConfig
from deepspec.data.template import TemplateError, encode_conversation
from deepspec.io import read_jsonl
from deepspec.models.capture import forward_capture
from deepspec.models.target import check_layers, load_identity

log = logging.getLogger(__name__)


@dataclass
class Sample:
    sample_id: int
    input_ids: list[int]
    loss_mask: list[int]


def encode_rows(tokenizer, rows, max_length: int) -> tuple[list[Sample], list[dict]]:
    """Samples for every usable row; the rest as {id, reason} (kept in the stage report)."""
    samples, dropped = [], []
    for row in rows:
        try:
            enc = encode_conversation(tokenizer, row["conversations"], max_length)
        except TemplateError as e:
            dropped.append({"id": row["id"], "reason": "template", "detail": str(e)})
            continue
        if sum(enc.loss_mask) == 0:
            # nothing to learn from: no anchor can be drawn (e.g. the answer was cut by max_length)
            dropped.append({"id": row["id"], "reason": "no_loss_tokens",
                            "detail": "truncated" if enc.truncated else "no assistant tokens"})
            continue
        samples.append(Sample(sample_id_to_int(row["id"]), enc.input_ids, enc.loss_mask))
    return samples, dropped


def plan_parts(samples: list[Sample], part_tokens: int, first_index: int) -> list[tuple[str, list[Sample]]]:
    parts, current, tokens = [], [], 0
    for s in samples:
        if current and tokens + len(s.input_ids) > part_tokens:
            parts.append(current)
            current, tokens = [], 0
        current.append(s)
        tokens += len(s.input_ids)
    if current:
        parts.append(current)
    return [(f"p{first_index + i:06d}", p) for i, p in enumerate(parts)]


def length_batches(samples: list[Sample], batch_tokens: int) -> list[list[int]]:
    """Indices grouped so that (batch size x longest length) stays within batch_tokens."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
    batches, current = [], []
    for i in order:
        longest = len(samples[current[0]].input_ids) if current else len(samples[i].input_ids)
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def compute_part(model, name: str, samples: list[Sample], layers: list[int], batch_tokens: int,
                 pad_id: int, device: torch.device, dtype: str = "bfloat16") -> PartData:
    """Forward passes for one part; hidden states come back already encoded (bf16 bits or fp8 +
    scale), so the writer thread only checksums and writes."""
    per_sample: list[dict | None] = [None] * len(samples)
    for batch in length_batches(samples, batch_tokens):
        longest = max(len(samples[i].input_ids) for i in batch)
        ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, i in enumerate(batch):
            n = len(samples[i].input_ids)
            ids[row, :n] = torch.tensor(samples[i].input_ids)
            mask[row, :n] = 1
        captured, last = forward_capture(model, ids.to(device), mask.to(device), layers)
        for row, i in enumerate(batch):
            n = len(samples[i].input_ids)  # right padding: a sample's rows are its first n positions
            out = {layer: captured[layer][row, :n] for layer in layers}
            out["last"] = last[row, :n]
            per_sample[i] = out
    keys = [*layers, "last"]
    return PartData(
        name=name,
        sample_ids=np.array([s.sample_id for s in samples], dtype=np.uint64),
        lengths=np.array([len(s.input_ids) for s in samples], dtype=np.int64),
        input_ids=np.concatenate([np.asarray(s.input_ids, dtype=np.int32) for s in samples]),
        loss_mask=np.concatenate([np.asarray(s.loss_mask, dtype=np.uint8) for s in samples]),
        hidden={k: encode_hidden(torch.cat([per_sample[i][k] for i in range(len(samples))]), dtype) for k in keys},
    )


def cache_manifest(cfg: CacheConfig, layers: list[int], ident: dict) -> dict:
    return {
        "target": ident,
        "layers": list(layers),
        "dtype": cfg.dtype,
        "codec": cfg.codec,
        "max_length": cfg.max_length,
        "chunk_tokens": cfg.chunk_tokens,
        "hidden_size": ident["hidden_size"],
        "storage": cfg.format,
        "bytes_per_token": bytes_per_token(ident["hidden_size"], len(layers), cfg.dtype),
    }


def part_tokens_for(cfg: CacheConfig, hidden_size: int) -> int:
    """Tokens per part: at most part_tokens, and small enough that one hidden array of a part
    (= one shard file) stays within shard_bytes."""
    row_bytes = hidden_size * (2 if cfg.dtype == "bfloat16" else 1)
    return max(1, min(cfg.part_tokens, cfg.shard_bytes // row_bytes))


def load_tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


def load_model(target_dir: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def load_target(target_dir: Path, device: torch.device):
    return load_tokenizer(target_dir), load_model(target_dir, device)


def build_cache(cfg: CacheConfig, layers: list[int], regen_path: Path, target_dir: Path,
                rank: int = 0, world: int = 1, barrier=None, device: torch.device | None = None,
                prune_stale: bool | None = None, share=None) -> dict:
    """Compute and write every missing part of the store for `cfg.url` (store.store_url: the path
    itself, or `<lake>/<store key>` on a remote URL); returns the stage report (rank 0's view,
    `report["url"]` is the store written). Multi-rank: `barrier()` synchronises the ranks and
    `share(value)` returns rank 0's value on every rank (it passes the job's lease run id)."""
    from deepspec.cache.derive import Derivation, prepare

    t0 = time.time()
    device = device or torch.device("cpu")
    ident = load_identity(target_dir)
    check_layers(layers, ident["num_layers"])
    tokenizer = load_tokenizer(target_dir)
    # the target is loaded only when a part has to be computed (a derive may need none)
    model_box: dict = {}

    def get_model():
        if "model" not in model_box:
            tm = time.time()
            model_box["model"] = load_model(target_dir, device)
            model_box["load_s"] = time.time() - tm
        return model_box["model"]

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    manifest = cache_manifest(cfg, layers, ident)
    url = store_url(cfg.url, manifest)
    remote = is_remote(cfg.url)
    if world > 1 and share is None:
        raise ValueError("a multi-rank build needs `share` to hand rank 0's run id to the other ranks")
    run_id = new_run_id() if rank == 0 else None
    if share is not None:
        run_id = share(run_id)
    writer = None
    derivation = Derivation(url, url)
    try:
        if rank == 0:
            if remote:
                check_lake(cfg.url, cfg.storage_options)
            t_derive = time.time()
            derivation = prepare(cfg, manifest, url, world)  # where the store's parts can come from
            derivation.started = t_derive
            writer = CacheWriter(derivation.write_url, derivation.manifest(manifest), cfg.storage_options, rank=0,
                                 prune_stale=prune_stale, run_id=run_id)
        if barrier:
            barrier()
        if writer is None:
            writer = CacheWriter(url, manifest, cfg.storage_options, rank=rank, run_id=run_id)
        report = _build(writer, cfg, layers, regen_path, ident, tokenizer, get_model, pad_id, device,
                        rank, world, barrier, derivation.source)
        writer.release()
        derivation.finish()  # a local in-place derive: the new store takes the old one's place
    except BaseException:
        if writer is not None:
            writer.release()
        derivation.abort()
        raise
    report["url"] = url
    report["wall_s"] = round(time.time() - t0, 2)
    if rank == 0:
        derive = derivation.report(report.pop("parts_computed"))
        if derive["source"] is not None:
            # the derive's own work: everything from choosing the source to the swap, less the target's
            derive["wall_s"] = round(time.time() - derivation.started - model_box.get("load_s", 0.0)
                                     - report["forward_s"], 2)
        report["derive"] = derive
        report["mode"] = "derived" if derive["parts_derived"] and not derive["parts_computed"] else \
            "derived+computed" if derive["parts_derived"] else "computed"
    return report


def _build(writer: CacheWriter, cfg: CacheConfig, layers: list[int], regen_path: Path, ident: dict, tokenizer,
           get_model, pad_id: int, device: torch.device, rank: int, world: int, barrier, source=None) -> dict:
    """Write every missing part: taken from `source` (deepspec.cache.derive) when it holds a part of
    the same composition, else computed with the target."""
    rows = list(read_jsonl(regen_path))
    samples, dropped = encode_rows(tokenizer, rows, cfg.max_length)
    done = writer.committed_sample_ids()
    pending = [s for s in samples if s.sample_id not in done]
    existing = writer.committed_parts()
    first = 1 + max((int(n[1:]) for n in existing), default=-1)
    plan = plan_parts(pending, part_tokens_for(cfg, ident["hidden_size"]), first)
    mine = plan[rank * len(plan) // world:(rank + 1) * len(plan) // world]  # a contiguous sample range
    if barrier:
        barrier()  # every rank plans from the same store snapshot, before any rank commits a part
    log.info("cache: %d rows, %d usable, %d already cached, %d parts to write (%d on this rank)",
             len(rows), len(samples), len(done), len(plan), len(mine))

    forward_s, computed = 0.0, 0
    bar = tqdm(total=sum(len(s.input_ids) for _, p in mine for s in p), unit="tok", desc=f"cache[{rank}]",
               dynamic_ncols=True, disable=rank != 0 and world > 1)
    try:
        for name, part_samples in mine:
            part = source.part(name, part_samples) if source is not None else None
            if part is None:
                model = get_model()
                tf = time.time()
                part = compute_part(model, name, part_samples, layers, cfg.batch_tokens, pad_id, device, cfg.dtype)
                forward_s += time.time() - tf
                computed += 1
            writer.submit(part)
            bar.update(part.tokens)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    if barrier:
        barrier()
    report = {"rows": len(rows), "samples": len(samples), "dropped": dropped, "forward_s": round(forward_s, 2),
              "parts_computed": computed}
    if rank == 0:
        report["manifest"] = writer.write_manifest(rescan=world > 1)  # other ranks' parts too
    return report
