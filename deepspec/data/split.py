"""The `split` stage: normalise a source, reject bad rows with reasons, split train/eval by hash.

A row's side (train or eval) depends only on its opening user message and `split.seed`, so growing
the source never moves an existing row, and conversations that open with the same prompt (real
corpora repeat prompts with different answers) land on the same side: no eval prompt is also a
train prompt. Outputs keep source order, so new rows land at the end.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from deepspec.config import SplitConfig
from deepspec.data.conversation import (RowRejected, conversation_id, normalize_conversation,
                                        normalize_prompt, system_prompt, user_turns)
from deepspec.data.sources import TruncatedSource, iter_source
from deepspec.io import atomic_open, hash_unit, write_json

log = logging.getLogger(__name__)

SHOW_REJECTED = 5   # rejected rows named in the log and in an error; all of them are in rejected.jsonl


class SplitError(RuntimeError):
    """The source yielded no usable row, or too many rows were rejected: nothing is written."""


def prompt_key(turns: list[dict]) -> str:
    """The opening user message, case- and whitespace-normalised: the unit the split assigns."""
    return normalize_prompt(next(t["content"] for t in turns if t["role"] == "user"))


def is_eval(turns: list[dict], cfg: SplitConfig) -> bool:
    return hash_unit("split", cfg.seed, prompt_key(turns)) < cfg.test_fraction


@dataclass
class SplitResult:
    train: list[dict]
    eval: list[dict]
    rejected: list[dict]
    read: int
    adjusted: dict = dataclasses.field(default_factory=dict)  # rows kept after a change, by kind
    truncated: str | None = None  # where the source file was cut, when its rows before it were kept

    def report(self, source: str) -> dict:
        by_reason = collections.Counter(r["reason"] for r in self.rejected)
        tasks = collections.Counter(r["task"] for r in self.train + self.eval)
        return {
            "source": source,
            "read": self.read,
            "kept": len(self.train) + len(self.eval),
            "train": len(self.train),
            "eval": len(self.eval),
            "rejected": dict(sorted(by_reason.items())),
            "rejected_total": len(self.rejected),
            "adjusted": dict(sorted(self.adjusted.items())),
            "tasks": dict(sorted(tasks.items())),
            **({"truncated_source": self.truncated} if self.truncated else {}),
        }


def split_rows(cfg: SplitConfig) -> SplitResult:
    train, evals, rejected, notes = [], [], [], []
    seen: set[str] = set()
    read = 0
    default_source = cfg.source if ":" in cfg.source else Path(cfg.source).name
    for raw in _rows(cfg, truncated := []):
        read += 1
        try:
            if raw.reason:
                raise RowRejected(raw.reason, raw.detail)
            row_notes: list[str] = []
            turns = normalize_conversation(raw.row, cfg.leading_assistant, row_notes)
            row_id = conversation_id(turns)
            if row_id in seen:
                raise RowRejected("duplicate", f"same content as an earlier row (id {row_id})")
        except RowRejected as e:
            rejected.append({"where": raw.where, "reason": e.reason, "detail": e.detail})
            continue
        seen.add(row_id)
        notes.extend(row_notes)
        task = str(raw.row.get("task") or raw.row.get("category") or "unknown")
        source = str(raw.row.get("source") or default_source)
        if is_eval(turns, cfg):
            row = {"id": row_id, "task": task, "source": source, "turns": user_turns(turns)}
            if (sp := system_prompt(turns)) is not None:
                row["system"] = sp
            evals.append(row)
        else:
            train.append({"id": row_id, "task": task, "source": source, "conversations": turns})
    return SplitResult(train, evals, rejected, read, dict(collections.Counter(notes)), truncated[0] if truncated else None)


def _rows(cfg: SplitConfig, truncated: list):
    """The source's rows; with `split.truncated_source: keep` a file cut part-way ends where it was cut
    (the message goes into `truncated`) instead of failing."""
    try:
        yield from iter_source(cfg.source, cfg.hf_split)
    except TruncatedSource as e:
        if cfg.truncated_source != "keep":
            raise
        message = str(e).split(TruncatedSource.KEEP_HINT)[0]
        log.warning("%s: keeping the rows before the cut (split.truncated_source: keep)", message)
        truncated.append(message)


def rejection_summary(result: SplitResult) -> str:
    """Counts by reason and the first few rejected rows (file:line), for a log line or an error."""
    counts = collections.Counter(r["reason"] for r in result.rejected)
    lines = [f"{result.read} rows read, {len(result.rejected)} rejected ("
             + ", ".join(f"{reason}: {n}" for reason, n in counts.most_common()) + ")"]
    lines += [f"  {r['where']}: {r['reason']} {r['detail']}".rstrip()
              for r in result.rejected[:SHOW_REJECTED]]
    if len(result.rejected) > SHOW_REJECTED:
        lines.append(f"  ... {len(result.rejected) - SHOW_REJECTED} more in rejected.jsonl")
    return "\n".join(lines)


def check_result(result: SplitResult, cfg: SplitConfig) -> None:
    kept = len(result.train) + len(result.eval)
    if result.read == 0:
        raise SplitError(f"{cfg.source}: the source holds no rows")
    if kept == 0:
        raise SplitError(f"{cfg.source}: no row is usable\n{rejection_summary(result)}")
    fraction = len(result.rejected) / result.read
    if fraction > cfg.max_reject_fraction:
        raise SplitError(f"{cfg.source}: {fraction:.0%} of rows rejected, more than "
                         f"split.max_reject_fraction = {cfg.max_reject_fraction}\n"
                         f"{rejection_summary(result)}")
    if not result.train:
        raise SplitError(f"{cfg.source}: every kept row fell on the eval side "
                         f"(split.test_fraction = {cfg.test_fraction}); no train rows")


def run_split(cfg: SplitConfig, out_dir: str | Path = "data/split") -> dict:
    """Read the whole source first, then write every output atomically: a bad source leaves none."""
    result = split_rows(cfg)
    check_result(result, cfg)
    if result.rejected:
        log.warning("%s", rejection_summary(result))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", result.train), ("eval.jsonl", result.eval),
                       ("rejected.jsonl", result.rejected)):
        with atomic_open(out / name) as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    report = result.report(cfg.source)
    write_json(out / "report.json", report)
    return report
