"""The `cache` stage: regen rows -> target forward passes -> store parts (Zarr or HDF5).

The stage streams: one pass tokenises every row to learn its length, content key and byte offset
(kept as numpy arrays, the tokens dropped), the part plan is made from those alone, and a part's
rows are re-read and tokenised only when that part is computed, so a rank holds a few parts of
samples, never the corpus. The plan is a pure function of the input (`plan_store`, cache/spec/plan.py):
parts are cut by content and named by it, so a part the store already holds is kept, every other
planned part is computed, and the store's new manifest lists exactly the planned parts. The result
equals a from-scratch build of the same input, and a rerun after a crash, single- or multi-rank,
writes exactly the parts an uninterrupted run would have. Forward passes run in length-sorted
batches within a part; the writer writes one part while the model computes the next, on threads
of this process or, beside a GPU, in a process of its own (devices.separate_writer).
"""
from __future__ import annotations

import collections
import logging
import time
from pathlib import Path

import numpy as np
import torch

from deepspec.cache.spec.format import bytes_per_token, encode_hidden_on_device
from deepspec.cache.spec.manifest import Manifest
from deepspec.cache.spec.plan import pack_ranges
from deepspec.cache.write.lease import new_run_id
from deepspec.cache.storage.urls import is_remote
from deepspec.cache.storage.naming import check_lake, store_url
from deepspec.cache.build.on_demand import OnDemand
from deepspec.cache.write.part_data import PartData, PartWriter
from deepspec.cache.build.regen_rows import (EncodeRules, RowIndex, Sample, index_key, load_index, part_samples,
                                             save_index)
from deepspec.cache.build.input_plan import (EmptyInput, check_not_empty, index_input, input_report,  # noqa: F401
                                             plan_store, planned_manifest)
from deepspec.cache.write.process_writer import ProcessWriter
from deepspec.cache.write.writer import CacheWriter
from deepspec.config import CacheConfig
from deepspec.devices import HostCopies, landed, separate_writer as separate_writer_of, writer_threads
from deepspec.models.capture import forward_capture
from deepspec.models.target import check_layers, compute_fingerprint, compute_settings, load_causal_lm, load_identity
from deepspec.progress import progress

log = logging.getLogger(__name__)


def length_batches(samples: list[Sample], batch_tokens: int) -> list[list[int]]:
    """Consecutive runs of `samples` (a part's samples come longest first, plan_parts) such that
    batch size x longest length stays within batch_tokens."""
    ranges = pack_ranges([len(s.input_ids) for s in samples], batch_tokens, padded=True)
    return [list(range(a, b)) for a, b in ranges]


def padded(samples: list[Sample], batch: list[int], pad_id: int, pin: bool = False):
    """(input ids, attention mask, lengths) of `batch` (indices into `samples`), right-padded on the
    host (pinned for an asynchronous copy to a GPU): a sample's rows are its first n positions."""
    lengths = [len(samples[i].input_ids) for i in batch]
    longest = max(lengths)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long, device="cpu", pin_memory=pin)
    mask = torch.zeros((len(batch), longest), dtype=torch.long, device="cpu", pin_memory=pin)
    for row, (i, n) in enumerate(zip(batch, lengths)):
        ids[row, :n] = torch.as_tensor(samples[i].input_ids, device="cpu")
        mask[row, :n] = 1
    return ids, mask, lengths


def forward_batches(model, samples: list[Sample], layers: list[int], batch_tokens: int, pad_id: int,
                    device: torch.device, dtype: str = "bfloat16"):
    """Forward passes over `samples` in order; yields each batch's hidden states as a devices.HostBatch
    whose result() is {layer or "last": (bits, scale)}, the batch's rows back to back in sample order,
    already encoded, so the writer only waits for the copy (on a thread of its own), checksums and
    writes. On a GPU the copies to pinned host buffers run on a copy stream while the next batch's
    forward computes."""
    copies = HostCopies(device)
    for batch in length_batches(samples, batch_tokens):
        ids, mask, lengths = padded(samples, batch, pad_id, pin=device.type == "cuda")
        captured, last = forward_capture(model, ids.to(device, non_blocking=True),
                                         mask.to(device, non_blocking=True), layers)
        rows = [*((k, captured[k]) for k in layers), ("last", last)]
        batch_out = copies.copy({layer: encode_hidden_on_device(torch.cat([values[row, :n] for row, n in
                                                                           enumerate(lengths)]), dtype)
                                 for layer, values in rows})
        del captured, last, rows  # not held while the next batch computes: one batch of states on the device
        yield batch_out


def part_header(name: str, samples: list[Sample]) -> PartData:
    """A part's ids, keys, lengths, tokens and loss mask, in store order (its hidden states come apart)."""
    return PartData(
        name=name,
        keys=np.array([s.key for s in samples], dtype=np.uint64).reshape(-1, 2),
        sample_ids=np.array([s.sample_id for s in samples], dtype=np.uint64),
        lengths=np.array([len(s.input_ids) for s in samples], dtype=np.int64),
        input_ids=np.concatenate([np.asarray(s.input_ids, dtype=np.int32) for s in samples]) if samples else
        np.zeros(0, np.int32),
        loss_mask=np.concatenate([np.asarray(s.loss_mask, dtype=np.uint8) for s in samples]) if samples else
        np.zeros(0, np.uint8),
    )


def compute_part(model, name: str, samples: list[Sample], layers: list[int], batch_tokens: int,
                 pad_id: int, device: torch.device, dtype: str = "bfloat16", writer=None,
                 computed_by: str | None = None) -> PartData:
    """Forward passes for one part, samples in the given (store) order. With a `writer` the part is
    streamed (CacheWriter.submit of its `batches`): each batch goes to the part's shards as it is
    computed, and the returned PartData has no hidden states; without one they are collected into it.
    `computed_by` (models.target.compute_fingerprint) goes into the part's commit record."""
    part = part_header(name, samples)
    part.computed_by = computed_by
    batches = forward_batches(model, samples, layers, batch_tokens, pad_id, device, dtype)
    if writer is None:
        got = list(landed(batches))  # a batch's copies land while the next ones compute
        part.hidden = {k: (np.concatenate([b[k][0] for b in got]),
                           None if got[0][k][1] is None else np.concatenate([b[k][1] for b in got]))
                       for k in [*layers, "last"]}
        return part
    part.batches = batches
    writer.submit(part)  # draws the batches (the forward passes) here; the writer's threads write them
    return part


def compute_of(cfg: CacheConfig, target_dir: Path, device: torch.device) -> dict:
    """Every setting a part's bits depend on beyond its samples and the store's other content fields,
    so that a change of any of them names another store (docs/cache-format.md §7): the target's dtype
    and attention kernel; the forward batching (`cache.batch_tokens`: which samples share a padded
    batch changes the last bits of their states); on a CPU the thread count (how a matmul's work is
    split); the tensor-parallel degree. The software and hardware are recorded per part instead."""
    compute = dict(compute_settings(target_dir, device), batch_tokens=cfg.batch_tokens)
    if device.type == "cpu":
        compute["threads"] = torch.get_num_threads()
    compute |= {"tensor_parallel": cfg.tensor_parallel} if cfg.tensor_parallel > 1 else {}  # sharded sums
    return compute


def cache_manifest(cfg: CacheConfig, layers: list[int], ident: dict, compute: dict | None = None) -> dict:
    """`compute`: compute_of (dtype, attention kernel, batching the states come from)."""
    return {
        "target": ident,
        **({"compute": compute} if compute else {}),
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
    """Tokens per part: at most part_tokens, and one hidden array of a part (a shard file) within shard_bytes."""
    row_bytes = hidden_size * (2 if cfg.dtype == "bfloat16" else 1)
    return max(1, min(cfg.part_tokens, cfg.shard_bytes // row_bytes))


def load_tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


def load_model(target_dir: Path, device: torch.device, compute: dict | None = None):
    return load_causal_lm(target_dir, device, compute)


def load_target(target_dir: Path, device: torch.device, compute: dict | None = None):
    return load_tokenizer(target_dir), load_model(target_dir, device, compute)


class FillHooks:
    """Where a read-through run (fill.py) joins a single-rank build; each default changes nothing.
    The hooks run on the building thread, except `committed`, which runs on a thread of the writer's
    (its commit thread, or the thread a ProcessWriter calls on_commit on)."""

    def inputs(self, index: RowIndex, plan: list[tuple[str, np.ndarray]], rules: EncodeRules) -> None:
        """What the plan is made of, just before `planned`: the planned samples encode again from it."""

    def planned(self, url: str, manifest: Manifest, rows: np.ndarray, have: set[str]) -> list[str] | None:
        """The store at `url` is planned (planned_manifest) and holds the parts `have`; returns the
        order to write the others in (None: plan order)."""
        return None

    def before_part(self, name: str) -> None:
        """About to write part `name` (raise to stop the build: nothing uncommitted is kept)."""

    def committed(self, name: str) -> None:
        """Part `name` is committed: readable from now on."""

    def filled(self) -> None:
        """Every planned part is committed; the root is switched to the plan once this returns."""


def new_writer(separate: bool, url: str, manifest: dict, storage_options: dict | None = None,
               **kwargs) -> PartWriter:
    """A CacheWriter, or with `separate` the same writer in a process of its own (ProcessWriter)."""
    return (ProcessWriter if separate else CacheWriter)(url, manifest, storage_options, **kwargs)


def build_cache(cfg: CacheConfig, layers: list[int], regen_path: Path, target_dir: Path,
                rank: int = 0, world: int = 1, device: torch.device | None = None,
                prune_stale: bool | None = None, share=None, gather=None, hooks: FillHooks | None = None,
                index_from: Path | None = None, separate_writer: bool | None = None,
                also: tuple[str, ...] = (), load=None) -> dict:
    """Compute and write every missing part of the store for `cfg.url` (store.store_url: the path
    itself, or `<lake>/<store key>` on a remote URL); returns the stage report (rank 0's view,
    `report["url"]` is the store written). Multi-rank: `share(value)` returns rank 0's value on every
    rank (the job's lease run id, the derivation, the store snapshot) and `gather(value)` every rank's
    value, in rank order, on every rank (the index shares, the counts); both also synchronise the ranks.
    `hooks`: a read-through run's view of the build (FillHooks; on several ranks each takes every
    world-th part of the order rank 0's hook returns). `index_from`: a RowIndex plan_cache kept, used
    (read by rank 0, shared) when it was made from this very input. `separate_writer`: write in a
    process of its own (process_writer.ProcessWriter; default devices.separate_writer(device)), unless
    parts may be derived from another store (their copies need its objects in this process). `also`:
    other local stores its parts may be derived from (derive.prepare)."""
    from deepspec.cache.build.derive import Derivation, follow, prepare

    t0 = time.time()
    device = device or torch.device("cpu")
    ident = load_identity(target_dir)
    check_layers(layers, ident["num_layers"])
    tokenizer = load_tokenizer(target_dir)
    # the target is loaded only when a part has to be computed (a derive may need none)
    if cfg.tensor_parallel > 1 and load is None:
        raise ValueError(f"cache.tensor_parallel {cfg.tensor_parallel}: the target is sharded by the stage's groups "
                         "(stages/cache.py under torchrun, models/tensor_parallel.py), which pass `load`")
    target = OnDemand(load or (lambda: load_model(target_dir, device, compute)))  # load: a tensor-parallel lead's

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    compute = compute_of(cfg, target_dir, device)
    manifest = cache_manifest(cfg, layers, ident, compute)
    url = store_url(cfg.url, manifest)
    remote = is_remote(cfg.url)
    if world > 1 and (share is None or gather is None):
        raise ValueError("a multi-rank build needs `share` (rank 0's run id and store snapshot) and `gather` "
                         "(every rank's share of the input index)")
    run_id = new_run_id() if rank == 0 else None
    if share is not None:
        run_id = share(run_id)
    separate = separate_writer_of(device) if separate_writer is None else separate_writer
    writer = None
    derivation = Derivation(url, url)
    try:
        if rank == 0:
            if remote:
                check_lake(cfg.url, cfg.storage_options)
            t_derive = time.time()
            derivation = prepare(cfg, manifest, url, also)  # where the store's parts can come from
            derivation.started = t_derive
            writer = new_writer(separate and derivation.source is None, derivation.write_url,
                                derivation.manifest(manifest), cfg.storage_options, rank=0, prune_stale=prune_stale,
                                run_id=run_id, threads=writer_threads(device))
            if hooks is not None:
                writer.on_commit = hooks.committed
        if world > 1:
            # also the barrier: every rank writes where rank 0 does and derives from the same source
            plan = share(derivation.plan if rank == 0 else None)
            if rank > 0:
                derivation = follow(url, plan, cfg.storage_options, manifest)
                writer = new_writer(separate and derivation.source is None, derivation.write_url, manifest,
                                    cfg.storage_options, rank=rank, run_id=run_id, threads=writer_threads(device))
        index = None
        if index_from is not None and rank == 0:
            index = load_index(index_from, regen_path, index_key(regen_path, EncodeRules.of(cfg), ident))
            log.info("cache: %s", f"the input's index kept at {index_from}" if index is not None else
                     f"no index of this input at {index_from}: indexing {regen_path}")
        if index_from is not None and world > 1:
            index = share(index)
        report = _build(writer, cfg, layers, regen_path, ident, tokenizer, target, pad_id, device,
                        rank, world, share, gather, derivation.source, hooks or FillHooks(), index)
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
        derive = derivation.report(report.pop("parts_computed"), report.pop("parts_derived"))
        if derive["source"] is not None:
            # the derive's own work: everything from choosing the source to the swap, less the target's
            derive["wall_s"] = round(time.time() - derivation.started - target.load_s
                                     - report["forward_s"], 2)
        report["derive"] = derive
        report["mode"] = "derived" if derive["parts_derived"] and not derive["parts_computed"] else \
            "derived+computed" if derive["parts_derived"] else "computed"
    return report


def plan_cache(cfg: CacheConfig, layers: list[int], regen_path: Path, target_dir: Path,
               device: torch.device | None = None, rank: int = 0, world: int = 1, gather=None,
               keep_index: Path | None = None) -> dict:
    """The cache stage when training fills the store (train.capture: read-through): the plan alone,
    computed as build_cache computes it (the regen file indexed by every rank, `gather` as there), and
    nothing read or written in any store. The report's `manifest` is planned_manifest's (plus `url`):
    what the read-through run checks its own plan against before it writes a part. `keep_index`: where
    rank 0 keeps the input's RowIndex (regen_rows.save_index), so that the read-through run plans
    without tokenising the whole input again."""
    device = device or torch.device("cpu")
    ident = load_identity(target_dir)
    check_layers(layers, ident["num_layers"])
    manifest = cache_manifest(cfg, layers, ident, compute_of(cfg, target_dir, device))
    index, shares = index_input(load_tokenizer(target_dir), regen_path, cfg, rank, world, gather)
    check_not_empty(index, regen_path)
    if keep_index is not None and rank == 0:
        save_index(index, keep_index, index_key(regen_path, EncodeRules.of(cfg), ident))
    plan = plan_store(index, part_tokens_for(cfg, ident["hidden_size"]))
    planned, _ = planned_manifest(manifest, index, plan)
    report = input_report(index, shares)
    report.update(parts=len(plan), mode="planned", manifest=dict(planned.to_dict(), url=store_url(cfg.url, manifest)))
    return report


def _build(writer: PartWriter, cfg: CacheConfig, layers: list[int], regen_path: Path, ident: dict,
           tokenizer, target: "OnDemand", pad_id: int, device: torch.device, rank: int, world: int, share, gather,
           source=None, hooks: FillHooks = FillHooks(), index: RowIndex | None = None) -> dict:
    """Write every planned part the store lacks: taken from `source` (deepspec.cache.build.derive) when it
    holds a part of the same content, else computed with the target; then list exactly the planned
    parts. `index`: the input's RowIndex when already known (else the ranks index the regen file)."""
    shares = []
    if index is None:
        index, shares = index_input(tokenizer, regen_path, cfg, rank, world, gather)
    plan = plan_store(index, part_tokens_for(cfg, ident["hidden_size"]))
    # the parts the store has, and those of the rest the source holds (derived, not computed)
    records = writer.committed_parts() if rank == 0 else {}
    have = set(records)
    derivable = {name for name, _ in plan if name not in have and name in source.by_name} \
        if rank == 0 and source is not None else set()
    if world > 1:
        # also the barrier: every rank plans from rank 0's snapshot of both (names, not records), before
        # any rank commits a part
        have, derivable = share((have, derivable))
    fingerprint = compute_fingerprint(device)
    # what computed each part the new manifest lists: kept parts keep the fingerprint they were computed under
    written_by = collections.Counter(str(records[name].get("computed_by", "unrecorded"))
                                     for name, _ in plan if name in records)
    other = sum(n for fp, n in written_by.items() if fp != fingerprint)
    if other:
        log.warning("cache: %d of the parts kept were computed under another software or hardware fingerprint "
                    "(%s); this run computes under %s. Each part's states are those a from-scratch build gives "
                    "under the fingerprint its commit record names (docs/cache-format.md §7)", other,
                    "; ".join(fp for fp in written_by if fp != fingerprint), fingerprint)
    todo = [(name, rows) for name, rows in plan if name not in have]
    cached = int(sum(len(rows) for name, rows in plan if name in have))
    check_not_empty(index, regen_path)
    hooks.inputs(index, plan, EncodeRules.of(cfg))
    order = hooks.planned(writer.url, *planned_manifest(writer.manifest.to_dict(), index, plan), set(have))
    if order is not None:
        position = {name: k for k, name in enumerate(order)}
        todo.sort(key=lambda t: position.get(t[0], len(position)))
    # derivable and computed parts are shared among the ranks each on its own (a contiguous range of
    # each), so a layer subset or dtype change under a multi-rank launcher spreads the derive over every
    # rank and takes no target forward, and no rank derives while another computes everything
    kinds = [t for t in todo if t[0] in derivable], [t for t in todo if t[0] not in derivable]
    mine = [t for kind in kinds for t in kind[rank * len(kind) // world:(rank + 1) * len(kind) // world]] \
        if order is None else todo[rank::world]  # a fill writes in the order its reader needs the parts
    log.info("cache: %d rows, %d usable, %d parts planned: %d already in the store (%d samples), %d to write "
             "(%d on this rank)", index.rows, len(index.lengths), len(plan), len(plan) - len(todo), cached,
             len(todo), len(mine))

    forward_s, computed, derived, mine_by, forwards, tokens = 0.0, 0, 0, collections.Counter(), 0, 0
    bar = progress(total=int(sum(index.lengths[rows].sum() for _, rows in mine)), unit="tok", desc=f"cache[{rank}]",
               dynamic_ncols=True, disable=rank != 0 and world > 1)
    try:
        for name, samples in part_samples(tokenizer, index, mine, EncodeRules.of(cfg)):
            hooks.before_part(name)
            part = source.part(name, samples) if source is not None else None
            if part is None:
                target.get()  # loaded before the forward time starts
                tf = time.time()
                part = compute_part(target.get(), name, samples, layers, cfg.batch_tokens, pad_id, device, cfg.dtype,
                                    writer=writer, computed_by=fingerprint)  # streamed: written as they come
                forward_s += time.time() - tf
                computed += 1
                forwards += len(length_batches(samples, cfg.batch_tokens))
                tokens += part.tokens
            else:
                writer.submit(part)
                derived += 1
            mine_by[part.computed_by or "unrecorded"] += 1
            del samples  # the next part's samples are tokenised before this name is rebound
            bar.update(part.tokens)
        writer.close(consolidate=False)  # rank 0 consolidates once, below, after every rank
        # a read-through fill waits here while training goes on: the target's memory is the trainer's
        target.drop()
        hooks.filled()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    counts = [(computed, derived, forward_s, mine_by, forwards, tokens)]
    counts = gather(counts[0]) if world > 1 else counts  # also the barrier
    computed, derived = sum(c[0] for c in counts), sum(c[1] for c in counts)
    forward_s = max(c[2] for c in counts)
    for c in counts:
        written_by.update(c[3])
    report = input_report(index, shares)
    report.update({"parts": len(plan), "parts_kept": len(plan) - len(todo), "samples_kept": cached,
                   "forward_s": round(forward_s, 2), "parts_computed": computed, "parts_derived": derived,
                   "target_forwards": sum(c[4] for c in counts), "tokens_computed": sum(c[5] for c in counts),
                   "computed_by": dict(sorted(written_by.items()))})
    if rank == 0:
        # the planned parts, in plan order (other ranks' parts too); the parts of an earlier input
        # leave the listing (and, locally, the store)
        report["manifest"] = writer.write_manifest([name for name, _ in plan], rescan=world > 1)
    return report
