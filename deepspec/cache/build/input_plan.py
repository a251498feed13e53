"""The input side of the cache plan: the regen file indexed (on every rank of a launcher), refused when
it holds no sample, cut into content-named parts (`plan_store`), and the manifest of the planned store
before any part exists (`planned_manifest`, what a read-through run reads the store by). stage.py
builds the planned parts; fill.py fills them while training.
"""
from __future__ import annotations

import collections
from pathlib import Path

import numpy as np

from deepspec.cache.backends.base import PartRows, index_rows
from deepspec.cache.build.regen_rows import EncodeRules, RowIndex, index_share, line_ranges, merge_shares
from deepspec.cache.spec.format import CacheFormatError, part_name
from deepspec.cache.spec.manifest import Manifest, PartEntry
from deepspec.cache.spec.plan import part_ranges, store_order
from deepspec.config import CacheConfig


def plan_store(index: RowIndex, part_tokens: int) -> list[tuple[str, np.ndarray]]:
    """Every part of the store for this input, as (name, sample positions in store order): the
    samples cut into parts by content (plan.part_ranges), each part named by what it holds
    (format.part_name). A pure function of the input: a from-scratch build, a resumed one and an
    incremental one after any change of the input all plan the same parts."""
    out = []
    for a, b in part_ranges(index.lengths, index.keys, part_tokens):
        rows = store_order(np.arange(a, b, dtype=np.int64), index.lengths)
        out.append((part_name(index.keys[rows], index.sample_ids[rows]), rows))
    return out


def planned_manifest(content: dict, index: RowIndex, plan: list[tuple[str, np.ndarray]]) -> tuple[Manifest, np.ndarray]:
    """The manifest of the store `plan` describes before any of its parts exists (content fields,
    the planned parts in plan order, not consolidated: no index object yet) and its per-sample index
    rows (backends.base.index_rows): what a reader of a store being filled in plan order needs."""
    m = Manifest.from_dict({k: v for k, v in dict(content).items()
                            if k not in ("parts", "num_samples", "num_tokens", "consolidated", "index", "url")})
    m.parts = [PartEntry.of(name, len(rows), int(index.lengths[rows].sum())) for name, rows in plan]
    m.consolidated = False
    rows = index_rows(m.parts, {name: PartRows(index.lengths[r], index.sample_ids[r], index.keys[r])
                                for name, r in plan})
    return m, rows


class EmptyInput(CacheFormatError):
    """The stage's input holds no sample to cache: it fails rather than keep an earlier store."""


def index_input(tokenizer, regen_path: Path, cfg: CacheConfig, rank: int = 0, world: int = 1, gather=None):
    """(RowIndex of the whole regen file, the per-rank shares it was merged from). Each rank tokenises
    an equal byte share of the input; the gathered shares are the index of the whole input on every
    rank, and the plan a pure function of it (no rank waits on work done for all)."""
    rules = EncodeRules.of(cfg)
    if world > 1:
        start, end = line_ranges(regen_path, world)[rank]
        shares = gather(index_share(tokenizer, regen_path, rules, start, end))
    else:
        shares = [index_share(tokenizer, regen_path, rules)]
    return merge_shares(regen_path, shares), shares  # every rank raises the same error for an unreadable row


def check_not_empty(index: RowIndex, regen_path: Path) -> None:
    if not len(index.lengths):
        reasons = collections.Counter(d["reason"] for d in index.dropped)
        why = "it has no rows" if not index.rows else \
            f"all {index.rows} rows were dropped ({', '.join(f'{k}: {v}' for k, v in sorted(reasons.items()))})"
        raise EmptyInput(f"{regen_path}: nothing to cache: {why}; check the regen stage's output "
                         "(data/regen/train.jsonl and data/regen/errors.jsonl)")


def input_report(index: RowIndex, shares) -> dict:
    """The part of the stage report that describes the input (rows, samples, what was dropped or changed)."""
    return {"rows": index.rows, "samples": len(index.lengths), "dropped": index.dropped,
            "dropped_by_reason": dict(sorted(collections.Counter(d["reason"] for d in index.dropped).items())),
            "adjusted": index.adjusted, "rows_indexed_by_rank": [sh.index.rows for sh in shares]}
