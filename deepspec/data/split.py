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
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from deepspec.config import SplitConfig
from deepspec.data.conversation import (RowRejected, conversation_id, normalize_conversation,
                                        normalize_prompt, system_prompt, user_turns)
from deepspec.data.sources import TruncatedSource, iter_source
from deepspec.io import IdIndex, fsync_path, hash_unit, write_json

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
class SplitSummary:
    """What a pass over the source found, in counts: all the report, the checks and the log need, so
    the rows themselves can stream to their files."""
    read: int = 0
    train: int = 0
    eval: int = 0
    rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by reason
    first_rejected: list[dict] = dataclasses.field(default_factory=list)  # the first SHOW_REJECTED
    tasks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    adjusted: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # rows kept after a change
    truncated: str | None = None  # where the source file was cut, when its rows before it were kept

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def report(self, source: str) -> dict:
        return {
            "source": source,
            "read": self.read,
            "kept": self.train + self.eval,
            "train": self.train,
            "eval": self.eval,
            "rejected": dict(sorted(self.rejected.items())),
            "rejected_total": self.rejected_total,
            "adjusted": dict(sorted(self.adjusted.items())),
            "tasks": dict(sorted(self.tasks.items())),
            **({"truncated_source": self.truncated} if self.truncated else {}),
        }


@dataclass
class SplitResult:
    """A split held in memory (a small corpus: the embedded default's, a test's)."""
    train: list[dict]
    eval: list[dict]
    rejected: list[dict]
    summary: SplitSummary


def classify_rows(cfg: SplitConfig, summary: SplitSummary) -> Iterator[tuple[str, dict]]:
    """("train" | "eval" | "rejected", row) for each source row, in source order, counted into
    `summary`. Holds one row at a time; the ids seen so far (duplicates are rejected) live on disk."""
    seen = IdIndex()
    default_source = cfg.source if ":" in cfg.source else Path(cfg.source).name
    try:
        for raw in _rows(cfg, summary):
            summary.read += 1
            try:
                if raw.reason:
                    raise RowRejected(raw.reason, raw.detail)
                row_notes: list[str] = []
                turns = normalize_conversation(raw.row, cfg.leading_assistant, row_notes)
                row_id = conversation_id(turns)
                if not seen.add(row_id, summary.read):
                    raise RowRejected("duplicate", f"same content as an earlier row (id {row_id})")
            except RowRejected as e:
                rejected = {"where": raw.where, "reason": e.reason, "detail": e.detail}
                summary.rejected[e.reason] += 1
                if len(summary.first_rejected) < SHOW_REJECTED:
                    summary.first_rejected.append(rejected)
                yield "rejected", rejected
                continue
            summary.adjusted.update(row_notes)
            task = str(raw.row.get("task") or raw.row.get("category") or "unknown")
            summary.tasks[task] += 1
            source = str(raw.row.get("source") or default_source)
            if is_eval(turns, cfg):
                row = {"id": row_id, "task": task, "source": source, "turns": user_turns(turns)}
                if (sp := system_prompt(turns)) is not None:
                    row["system"] = sp
                summary.eval += 1
                yield "eval", row
            else:
                summary.train += 1
                yield "train", {"id": row_id, "task": task, "source": source, "conversations": turns}
    finally:
        seen.close()


def split_rows(cfg: SplitConfig) -> SplitResult:
    """The whole split in memory (see run_split for a corpus of any size)."""
    summary = SplitSummary()
    out: dict[str, list[dict]] = {"train": [], "eval": [], "rejected": []}
    for kind, row in classify_rows(cfg, summary):
        out[kind].append(row)
    return SplitResult(out["train"], out["eval"], out["rejected"], summary)


def _rows(cfg: SplitConfig, summary: SplitSummary):
    """The source's rows; with `split.truncated_source: keep` a file cut part-way ends where it was cut
    (the message goes into the summary) instead of failing."""
    try:
        yield from iter_source(cfg.source, cfg.hf_split)
    except TruncatedSource as e:
        if cfg.truncated_source != "keep":
            raise
        message = str(e).split(TruncatedSource.KEEP_HINT)[0]
        log.warning("%s: keeping the rows before the cut (split.truncated_source: keep)", message)
        summary.truncated = message


def rejection_summary(summary: SplitSummary) -> str:
    """Counts by reason and the first few rejected rows (file:line), for a log line or an error."""
    lines = [f"{summary.read} rows read, {summary.rejected_total} rejected ("
             + ", ".join(f"{reason}: {n}" for reason, n in summary.rejected.most_common()) + ")"]
    lines += [f"  {r['where']}: {r['reason']} {r['detail']}".rstrip() for r in summary.first_rejected]
    if summary.rejected_total > SHOW_REJECTED:
        lines.append(f"  ... {summary.rejected_total - SHOW_REJECTED} more in rejected.jsonl")
    return "\n".join(lines)


def check_summary(summary: SplitSummary, cfg: SplitConfig) -> None:
    kept = summary.train + summary.eval
    if summary.read == 0:
        raise SplitError(f"{cfg.source}: the source holds no rows")
    if kept == 0:
        raise SplitError(f"{cfg.source}: no row is usable\n{rejection_summary(summary)}")
    fraction = summary.rejected_total / summary.read
    if fraction > cfg.max_reject_fraction:
        raise SplitError(f"{cfg.source}: {fraction:.0%} of rows rejected, more than "
                         f"split.max_reject_fraction = {cfg.max_reject_fraction}\n"
                         f"{rejection_summary(summary)}")
    if not summary.train:
        raise SplitError(f"{cfg.source}: every kept row fell on the eval side "
                         f"(split.test_fraction = {cfg.test_fraction}); no train rows")


OUTPUTS = ("train", "eval", "rejected")


def run_split(cfg: SplitConfig, out_dir: str | Path = "data/split") -> dict:
    """Stream the source's rows into new files beside `out_dir`; only a split that passes its checks
    replaces the outputs (a bad source leaves the previous ones, or none, in place)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    for debris in out.parent.glob(f".{out.name}.*"):  # the new files of a run that was killed
        if debris.is_dir():
            shutil.rmtree(debris, ignore_errors=True)
    summary = SplitSummary()
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        files = {kind: open(Path(tmp) / f"{kind}.jsonl", "w", encoding="utf-8") for kind in OUTPUTS}
        try:
            for kind, row in classify_rows(cfg, summary):
                files[kind].write(json.dumps(row, ensure_ascii=False) + "\n")
            for f in files.values():
                f.flush()
                os.fsync(f.fileno())
        finally:
            for f in files.values():
                f.close()
        check_summary(summary, cfg)
        if summary.rejected_total:
            log.warning("%s", rejection_summary(summary))
        out.mkdir(exist_ok=True)
        for kind in OUTPUTS:
            os.replace(Path(tmp) / f"{kind}.jsonl", out / f"{kind}.jsonl")
        fsync_path(out)
    report = summary.report(cfg.source)
    write_json(out / "report.json", report)
    return report
