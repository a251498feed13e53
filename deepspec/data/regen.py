"""The `regen` stage: re-generate every assistant turn with the target, crash-safe.

One request per user turn; the history is the regenerated answers so far. Rows are sent to the
servers in input order by a pool of worker threads and journaled as they complete
(`deepspec.data.journal`); the output is written by streaming the finished rows in input order, so a
run holds the rows in flight, not the corpus.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from deepspec.config import RegenConfig, SamplingConfig, to_dict
from deepspec.data.chat_client import Client, Endpoint, RequestFailed
from deepspec.data.journal import FinishedRows, Journal
from deepspec.data.template import encode_prompt
from deepspec.io import atomic_open, fingerprint, hash_unit, read_jsonl
from deepspec.progress import progress

log = logging.getLogger(__name__)


class WorkerCrashed(RuntimeError):
    """A request worker failed with something other than a transport/server fault: a bug, so the
    stage stops (the cause and its traceback are chained) instead of counting the row as an error."""


# ---- the stage ---------------------------------------------------------------------------------------

def selected(row: dict, cfg: RegenConfig) -> bool:
    """A hash-based subset: growing the source never drops or swaps an already selected row."""
    return cfg.fraction >= 1.0 or hash_unit("regen", row["id"]) < cfg.fraction


def select_rows(rows: list[dict], cfg: RegenConfig) -> list[dict]:
    return [r for r in rows if selected(r, cfg)]


class SplitRows:
    """The selected rows of the split's train file, read again on every iteration: a pass over the
    file instead of the corpus in memory."""

    def __init__(self, path: Path, cfg: RegenConfig):
        self.path, self.cfg = Path(path), cfg

    def __iter__(self) -> Iterator[dict]:
        return (r for r in read_jsonl(self.path) if selected(r, self.cfg))


def request_token_bound(tokenizer, rows: list[dict], sampling: SamplingConfig, disable_thinking: bool) -> int:
    """The most tokens one request for these rows can occupy in a server's KV cache: the prompt of a
    row's last user turn, with every earlier answer at its `max_tokens` bound, plus `max_tokens`."""
    kwargs = {"enable_thinking": False} if disable_thinking else {}
    longest = 0
    for row in rows:
        history, answers = [], 0
        for turn in row["conversations"]:
            if turn["role"] == "system":
                history.append({"role": "system", "content": turn["content"]})
            elif turn["role"] == "user":
                if history and history[-1]["role"] == "user":  # an earlier user turn: its answer comes first
                    history.append({"role": "assistant", "content": ""})
                    answers += 1
                history.append({"role": "user", "content": turn["content"]})
        if history:
            longest = max(longest, len(encode_prompt(tokenizer, history, **kwargs)) + answers * sampling.max_tokens)
    return longest + sampling.max_tokens


def regen_fingerprint(cfg: RegenConfig, sampling: SamplingConfig, target_identity: dict | None,
                      compute: dict | None = None) -> str:
    """`compute`: how a local backend runs the target beyond what its identity says (the dtype of the
    device it runs on), which decides its floats as much as the batch plan does."""
    shape = {"target": target_identity, "sampling": to_dict(sampling), "backend": cfg.backend,
             "disable_thinking": cfg.disable_thinking, "model": cfg.model}
    if cfg.backend == "local":  # the batch plan decides the floats, so it shapes the answers too
        shape["batch"] = cfg.concurrency
        if cfg.batch_tokens is not None:
            shape["batch_tokens"] = cfg.batch_tokens
        if compute is not None:
            shape["compute"] = compute
    return fingerprint(shape)


def _journal_finished(results: queue.Queue, journal: Journal) -> None:
    """Keep the answers that were already back when the run stops (no work is thrown away)."""
    while True:
        try:
            kind, payload = results.get_nowait()
        except queue.Empty:
            return
        if kind == "ok":
            journal.append(payload)


def run_regen(rows: Iterable[dict], endpoints: list[Endpoint], cfg: RegenConfig, sampling: SamplingConfig,
              journal: Journal, api_key: str | None = None,
              eos_token_id: int | list[int] | None = None) -> tuple[FinishedRows, list[dict]]:
    """Regenerate every row not in the journal; returns (rows in input order, errors). `rows` is
    iterated three times (a list, or SplitRows reading its file each time)."""
    client = Client(cfg, sampling, api_key, eos_token_id=eos_token_id)
    total = todo = 0
    for r in rows:  # a counting pass: the rows themselves are read once more, as they are sent
        total += 1
        todo += r["id"] not in journal.done
    pending = (r for r in rows if r["id"] not in journal.done)
    lock = threading.Lock()
    results: queue.Queue = queue.Queue()
    stop = threading.Event()

    def worker(endpoint: Endpoint) -> None:
        while not stop.is_set():
            with lock:
                row = next(pending, None)
            if row is None:
                return
            try:
                results.put(("ok", client.regenerate(endpoint, row)))
            except RequestFailed as e:
                results.put(("error", {"id": row["id"], "reason": e.reason, "detail": e.detail}))
            except Exception as e:  # a bug: stop the run (the main thread re-raises it), never a row error
                results.put(("crash", (row.get("id"), e)))
                stop.set()

    threads = [threading.Thread(target=worker, args=(ep,), daemon=True, name=f"regen-{i}-{k}")
               for i, ep in enumerate(endpoints) for k in range(cfg.concurrency)]
    errors: list[dict] = []
    t0, gen_tokens = time.time(), 0
    bar = progress(total=total, initial=total - todo, unit="sample", desc="regen")
    for th in threads:
        th.start()
    try:
        for _ in range(todo):
            kind, payload = results.get()
            if kind == "ok":
                journal.append(payload)
                gen_tokens += payload["completion_tokens"]
            elif kind == "crash":
                row_id, exc = payload
                _journal_finished(results, journal)
                raise WorkerCrashed(f"regen: request worker crashed on row {row_id}: "
                                    f"{type(exc).__name__}: {exc}") from exc
            else:
                errors.append(payload)
                log.warning("regen %s failed: %s %s", payload["id"], payload["reason"], payload["detail"])
            bar.update(1)
            elapsed = max(time.time() - t0, 1e-6)
            bar.set_postfix(tok_s=f"{gen_tokens / elapsed:.0f}", errors=len(errors))
    finally:
        stop.set()
        bar.close()
    for th in threads:
        th.join(timeout=1)
    return journal.in_order(rows), errors


def write_outputs(out_dir: Path, ordered: Iterable[dict], errors: list[dict], sampling: SamplingConfig,
                  model_id: str | None) -> None:
    with atomic_open(out_dir / "train.jsonl") as f:
        for row in ordered:
            out = {k: v for k, v in row.items() if k != "completion_tokens"}
            out |= {"sampling": to_dict(sampling), "target": model_id}
            f.write(json.dumps(out, ensure_ascii=False) + "\n")
    with atomic_open(out_dir / "errors.jsonl") as f:
        for e in errors:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")


def reproducibility(cfg: RegenConfig, sampling: SamplingConfig) -> dict:
    """Whether the same params give the same answers on this backend, and why (for the regen report:
    a backend that is not reproducible makes every forced rerun a new dataset, and the cache below
    it is recomputed for every changed answer)."""
    if cfg.backend == "local":
        return {"reproducible": True, "why": "in-process: batches fixed by the rows (cut by content), "
                "one generator per row and turn; same machine and thread count, same answers"}
    if cfg.backend == "sglang" and cfg.urls:
        return {"reproducible": False, "why": "sglang servers given by URL: whether they run with "
                "--enable-deterministic-inference is not known here"}
    if cfg.backend == "sglang":
        return {"reproducible": cfg.deterministic,
                "why": "sglang launched with --enable-deterministic-inference (batch-invariant kernels, "
                       "per-request seeds)" if cfg.deterministic else "regen.deterministic is false"}
    if cfg.backend == "transformers":
        if cfg.concurrency > 1:
            return {"reproducible": False, "why": "transformers serve with continuous batching does not "
                    "reproduce per-request seeds, and an answer depends on what shares its batch"}
        return {"reproducible": sampling.temperature == 0,
                "why": "one request at a time: greedy answers repeat; sampled ones depend on the "
                       "server's global generator" if sampling.temperature else "greedy, one request at a time"}
    return {"reproducible": False, "why": "an OpenAI-compatible URL: per-request seeds and batch "
            "invariance are not guaranteed (vLLM honours seeds, but batch composition still changes floats)"}


def model_eos(model_dir: Path) -> int | list[int] | None:
    """End-of-turn id(s) from the model's generation_config.json (what `generate` would stop on)."""
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()).get("eos_token_id") if path.exists() else None


