"""The `regen` stage: re-generate every assistant turn with the target, crash-safe.

One request per user turn; the history is the regenerated answers so far. Results are journaled
as they complete (one JSON line per finished sample, flushed and fsync'd); a rerun reads the
journal, drops a torn last line, and only asks for what is missing, so after a kill at any point
the final file holds every id exactly once. The journal carries a fingerprint of everything that
shapes an answer (model identity incl. chat template, sampling, backend); a change sets it aside
(`journal-stale-<fingerprint>`), and params that switch back resume it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping
from typing import Callable

import numpy as np

from deepspec.config import RegenConfig, SamplingConfig, to_dict
from deepspec.data.template import encode_prompt
from deepspec.io import atomic_open, fingerprint, hash_unit, read_jsonl, write_json
from deepspec.progress import progress

log = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    def __init__(self, reason: str, detail: str = "", retryable: bool = True):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.retryable = retryable


class WorkerCrashed(RuntimeError):
    """A request worker failed with something other than a transport/server fault: a bug, so the
    stage stops (the cause and its traceback are chained) instead of counting the row as an error."""


class JournalError(ValueError):
    """The journal holds a line that is not a finished row (damaged, not a torn last write)."""


class ProbeError(RuntimeError):
    """No server answered the start-up probe."""


class ProbeRejected(ValueError):
    """A server refuses a field the sampling params need."""


# ---- request bodies ------------------------------------------------------------------------------

def request_seed(sampling: SamplingConfig, sample_id: str, turn: int) -> int:
    """Distinct per (sample, turn), reproducible across runs."""
    return (sampling.seed * 1_000_003 + int(hash_unit("regen-seed", sample_id, turn) * 2**31)) % 2**31


def build_request(backend: str, model: str, messages: list[dict], sampling: SamplingConfig,
                  seed: int, disable_thinking: bool = True, eos_token_id: int | list[int] | None = None) -> dict:
    """The exact JSON body for /v1/chat/completions on each backend."""
    body: dict = {"model": model, "messages": messages, "max_tokens": sampling.max_tokens,
                  "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed, "stream": False}
    if backend in ("sglang", "openai"):
        # extra top-level fields that sglang and vLLM read; sent even when "off", since a server left
        # to its own defaults may apply the model's generation_config (Qwen3's: top_k 20)
        body["top_k"] = sampling.top_k if sampling.top_k > 0 else -1  # sglang, vLLM: -1 = disabled
        body["min_p"] = sampling.min_p
        if disable_thinking:
            body["chat_template_kwargs"] = {"enable_thinking": False}
    elif backend == "transformers":
        # transformers serve rejects a top-level top_k; it reads sampling knobs from a
        # generation_config JSON string (and ignores temperature unless do_sample is on).
        gen = {"do_sample": sampling.temperature > 0, "max_new_tokens": sampling.max_tokens}
        if eos_token_id is not None:  # with continuous batching the server does not fill it in itself
            gen["eos_token_id"] = eos_token_id
        if sampling.temperature > 0:
            gen |= {"temperature": sampling.temperature, "top_p": sampling.top_p}
            if sampling.top_k > 0:
                gen["top_k"] = sampling.top_k
            if sampling.min_p > 0:
                gen["min_p"] = sampling.min_p
        body["generation_config"] = json.dumps(gen, sort_keys=True)
        if disable_thinking:
            body["chat_template_kwargs"] = {"enable_thinking": False}
    else:
        raise ValueError(f"unknown backend {backend!r}")
    return body


def parse_reply(status: int, text: str) -> tuple[str, str, int]:
    """(content, finish_reason, completion tokens) of an HTTP reply, or RequestFailed with a reason."""
    if status >= 500:
        raise RequestFailed("http_5xx", f"HTTP {status}: {text[:200]}")
    if status == 429:
        raise RequestFailed("http_429", text[:200])
    if status >= 400:
        raise RequestFailed("http_4xx", f"HTTP {status}: {text[:200]}", retryable=False)
    try:
        data = json.loads(text)
    except ValueError:
        raise RequestFailed("non_json", text[:200]) from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices:
        raise RequestFailed("empty_choices", json.dumps(data)[:200])
    choice = choices[0]
    content = (choice.get("message") or {}).get("content")
    if not isinstance(content, str):
        raise RequestFailed("no_content", json.dumps(choice)[:200])
    usage = data.get("usage") or {}
    try:
        tokens = int(usage.get("completion_tokens") or 0)
    except (TypeError, ValueError, AttributeError):
        raise RequestFailed("bad_response", f"usage: {json.dumps(usage)[:200]}") from None
    return content, str(choice.get("finish_reason")), tokens


# ---- one sample ----------------------------------------------------------------------------------

@dataclass
class Endpoint:
    url: str      # base URL without /v1
    model: str


# the body fields the openai SDK takes as arguments; the rest (top_k, min_p, chat_template_kwargs,
# generation_config) goes in its `extra_body`, sent as given
SDK_FIELDS = ("model", "messages", "max_tokens", "temperature", "top_p", "seed", "stream")


class Client:
    """Chat completions through the `openai` SDK, one client per endpoint (thread-safe). Retries are
    one layer, this one: the SDK's own are off (max_retries=0) because a reply can be a fault the SDK
    accepts (no choices, no content, not JSON, empty content) and every fault gets the same
    exponential backoff with jitter here."""

    def __init__(self, cfg: RegenConfig, sampling: SamplingConfig, api_key: str | None = None,
                 sleep: Callable[[float], None] = time.sleep, eos_token_id: int | list[int] | None = None):
        self.cfg = cfg
        self.eos_token_id = eos_token_id
        self.sampling = sampling
        self.sleep = sleep
        self.api_key = api_key
        self._clients: dict[str, object] = {}
        self._lock = threading.Lock()

    def _sdk(self, endpoint: Endpoint):
        import openai

        with self._lock:
            if endpoint.url not in self._clients:
                # a server without auth takes any key; the SDK refuses to start without one
                self._clients[endpoint.url] = openai.OpenAI(base_url=f"{endpoint.url}/v1", api_key=self.api_key or "none",
                                                            timeout=self.cfg.timeout_s, max_retries=0)
            return self._clients[endpoint.url]

    def complete(self, endpoint: Endpoint, body: dict) -> tuple[str, str, int]:
        """One chat completion, retried with exponential backoff and jitter on every transient fault."""
        def attempt() -> tuple[str, str, int]:
            content, finish, n = parse_reply(*self._post(endpoint, body))
            if not content.strip():
                raise RequestFailed("empty_content", f"finish_reason={finish}")
            return content, finish, n

        return self._with_retries(attempt)

    def status(self, endpoint: Endpoint, body: dict) -> tuple[int, str]:
        """(HTTP status, body text) of a request the server answered; transient faults are retried,
        and one that persists (no connection, timeouts, 5xx, not JSON) is a RequestFailed."""
        def attempt() -> tuple[int, str]:
            status, text = self._post(endpoint, body)
            if status >= 500:
                raise RequestFailed("http_5xx", f"HTTP {status}: {text[:200]}")
            if status == 429:
                raise RequestFailed("http_429", text[:200])
            if status < 400:
                try:  # any JSON answer: a 1-token reply may well have no content (a thinking model)
                    json.loads(text)
                except ValueError:
                    raise RequestFailed("non_json", text[:200]) from None
            return status, text

        return self._with_retries(attempt)

    def _post(self, endpoint: Endpoint, body: dict) -> tuple[int, str]:
        """(HTTP status, body text): the SDK's errors for transport faults become RequestFailed, an HTTP
        error status is returned like any other reply."""
        import openai

        known = {"model": endpoint.model, "messages": []} | {k: v for k, v in body.items() if k in SDK_FIELDS}
        extra = {k: v for k, v in body.items() if k not in SDK_FIELDS}
        try:
            raw = self._sdk(endpoint).chat.completions.with_raw_response.create(**known, extra_body=extra or None)
            return raw.http_response.status_code, raw.http_response.text
        except openai.APIStatusError as e:
            return e.status_code, e.response.text
        except openai.APITimeoutError as e:
            raise RequestFailed("timeout", str(e)[:200]) from None
        except openai.APIConnectionError as e:
            raise RequestFailed("connection", f"{e}: {e.__cause__}"[:200]) from None

    def _with_retries(self, attempt_once):
        last: RequestFailed | None = None
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                delay = self.cfg.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
                self.sleep(delay)
            try:
                return attempt_once()
            except RequestFailed as e:
                last = e
                if not e.retryable:
                    break
            log.debug("attempt %d failed: %s", attempt + 1, last)
        raise last

    def regenerate(self, endpoint: Endpoint, row: dict) -> dict:
        history: list[dict] = []
        finish_reasons, tokens = [], 0
        turns = row["conversations"]
        if turns and turns[0]["role"] == "system":
            history.append(dict(turns[0]))
        for t, turn in enumerate(x for x in turns if x["role"] == "user"):
            history.append({"role": "user", "content": turn["content"]})
            body = build_request(self.cfg.backend, endpoint.model, history, self.sampling,
                                 request_seed(self.sampling, row["id"], t), self.cfg.disable_thinking,
                                 self.eos_token_id)
            content, finish, n = self.complete(endpoint, body)
            history.append({"role": "assistant", "content": content})
            finish_reasons.append(finish)
            tokens += n
        return {"id": row["id"], "task": row.get("task"), "source": row.get("source"),
                "conversations": history, "finish_reasons": finish_reasons, "completion_tokens": tokens}


# ---- the journal -----------------------------------------------------------------------------------

class Journal:
    """Append-only JSONL of finished samples, valid for one fingerprint."""

    def __init__(self, directory: Path, fp: str):
        self.dir = directory
        self.rows_path = directory / "rows.jsonl"
        meta = directory / "meta.json"
        if directory.exists():
            old = json.loads(meta.read_text()).get("fingerprint") if meta.exists() else None
            if old != fp:
                aside = self.stale_dir(directory, old)
                if aside.exists():  # an older journal of the same fingerprint: keep both
                    aside = aside.with_name(f"{aside.name}-{time.strftime('%Y%m%dT%H%M%S')}")
                log.warning("regen journal fingerprint changed (%s -> %s): %s set aside as %s (delete it "
                            "to reclaim the space)", old, fp, directory, aside)
                directory.rename(aside)
        back = self.stale_dir(directory, fp)
        if not directory.exists() and back.is_dir():  # params switched back: its finished rows count again
            log.info("regen journal: resuming %s, set aside earlier under these params", back)
            back.rename(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if not meta.exists():
            write_json(meta, {"fingerprint": fp})
        self._offsets = RowOffsets()  # id -> byte offset of its row: all a run holds of the rows
        self._reader = None
        self.done = JournalRows(self)
        self._recover()
        self._f = open(self.rows_path, "ab")

    @staticmethod
    def stale_dir(directory: Path, fp: str | None) -> Path:
        """Where a journal of another fingerprint is set aside: a sibling, never inside an output."""
        return directory.with_name(f"{directory.name}-stale-{fp}")

    def _recover(self) -> None:
        """One pass over the file, line by line: each finished row's id and offset (the rows stay on disk)."""
        if not self.rows_path.exists():
            return
        offset, lineno = 0, 0
        with open(self.rows_path, "rb") as f:
            for line in f:
                lineno += 1
                if not line.endswith(b"\n"):  # a kill mid-write leaves at most one torn line at the end
                    log.warning("regen journal: dropping a torn last line (%d bytes)", len(line))
                    break
                self._check_line(line, lineno, offset)
                offset += len(line)
        if offset < self.rows_path.stat().st_size:
            with open(self.rows_path, "r+b") as f:
                f.truncate(offset)

    def _check_line(self, line: bytes, lineno: int, offset: int) -> None:
        # a newline-terminated line was written whole: if it does not parse, the file was damaged
        # after the fact. Stop and say where rather than re-request (or lose) it silently.
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and isinstance(row.get("id"), str)
        except (ValueError, UnicodeDecodeError) as e:
            ok, why = False, f"not JSON ({e})"
        else:
            why = "not a finished row (a JSON object with an \"id\")"
        if not ok:
            raise JournalError(
                f"{self.rows_path}:{lineno}: corrupt journal line, {why}: {line[:80]!r}. It ends with a "
                "newline, so it is not an interrupted write: the file was damaged. Delete that line to "
                "have its row regenerated, or delete the directory to regenerate everything.")
        self._offsets.setdefault(row["id"], offset)

    def append(self, row: dict) -> None:
        offset = self._f.tell()
        self._f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._offsets.setdefault(row["id"], offset)

    def read(self, row_id: str) -> dict:
        offset = self._offsets.get(row_id)
        if offset is None:
            raise KeyError(row_id)
        if self._reader is None:
            self._reader = open(self.rows_path, "rb")
        self._reader.seek(offset)
        return json.loads(self._reader.readline())

    def in_order(self, rows: Iterable[dict]) -> "FinishedRows":
        """The finished rows among `rows` (re-iterable), in their order."""
        return FinishedRows(self, rows)

    def close(self) -> None:
        self._f.close()
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _id_key(row_id: str) -> int:
    """A row id as a uint64: the 16 hex digits split ids are, else a hash of the string."""
    if len(row_id) == 16:
        try:
            return int(row_id, 16)
        except ValueError:
            pass
    import hashlib

    return int.from_bytes(hashlib.blake2b(row_id.encode(), digest_size=8).digest(), "big") | 1 << 63


class RowOffsets:
    """id -> byte offset for every finished row, in 16 bytes a row: sorted numpy arrays, plus a
    small dict of the rows added since the last merge (merged every MERGE rows: at 1.3 M rows about
    300 merges, seconds in all)."""

    MERGE = 4096

    def __init__(self):
        self._keys = np.zeros(0, dtype=np.uint64)
        self._offs = np.zeros(0, dtype=np.int64)
        self._new: dict[int, int] = {}
        self._order: list[str] | None = []  # ids in journal order while few (iteration, tests)

    def get(self, row_id: str) -> int | None:
        key = _id_key(row_id)
        if key in self._new:
            return self._new[key]
        i = int(np.searchsorted(self._keys, np.uint64(key)))
        return int(self._offs[i]) if i < len(self._keys) and int(self._keys[i]) == key else None

    def setdefault(self, row_id: str, offset: int) -> None:
        if self.get(row_id) is not None:
            return
        self._new[_id_key(row_id)] = offset
        if self._order is not None:
            self._order.append(row_id)
            if len(self._order) > self.MERGE:
                self._order = None
        if len(self._new) >= self.MERGE:
            self._merge()

    def _merge(self) -> None:
        keys = np.concatenate([self._keys, np.fromiter(self._new.keys(), np.uint64, len(self._new))])
        offs = np.concatenate([self._offs, np.fromiter(self._new.values(), np.int64, len(self._new))])
        order = np.argsort(keys, kind="stable")
        self._keys, self._offs, self._new = keys[order], offs[order], {}

    def __contains__(self, row_id) -> bool:
        return self.get(row_id) is not None

    def __len__(self) -> int:
        return len(self._keys) + len(self._new)

    def ids(self) -> list[str]:
        if self._order is None:
            raise RuntimeError("the journal holds too many rows to list their ids; look them up by id")
        return list(self._order)


class JournalRows(Mapping):
    """A journal's finished rows by id, each read from the file when asked for."""

    def __init__(self, journal: Journal):
        self._journal = journal

    def __getitem__(self, row_id: str) -> dict:
        if row_id not in self._journal._offsets:
            raise KeyError(row_id)
        return self._journal.read(row_id)

    def __contains__(self, row_id) -> bool:
        return row_id in self._journal._offsets

    def __iter__(self) -> Iterator[str]:
        return iter(self._journal._offsets.ids())

    def __len__(self) -> int:
        return len(self._journal._offsets)


class FinishedRows(Iterable):
    """The finished rows among `rows` (a re-iterable of input rows: a list, or a SplitRows), in
    their order, read from the journal as they are iterated: what the stage writes out without
    holding the corpus's answers."""

    def __init__(self, journal: Journal, rows: Iterable[dict]):
        self._journal, self._rows = journal, rows

    def _finished(self) -> Iterator[str]:
        return (r["id"] for r in self._rows if r["id"] in self._journal._offsets)

    def __len__(self) -> int:
        return sum(1 for _ in self._finished())

    def __getitem__(self, k: int) -> dict:
        return list(self)[k]

    def __iter__(self) -> Iterator[dict]:
        return (self._journal.read(i) for i in self._finished())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


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


def regen_fingerprint(cfg: RegenConfig, sampling: SamplingConfig, target_identity: dict | None) -> str:
    shape = {"target": target_identity, "sampling": to_dict(sampling), "backend": cfg.backend,
             "disable_thinking": cfg.disable_thinking, "model": cfg.model}
    if cfg.backend == "local":  # the batch plan decides the floats, so it shapes the answers too
        shape["batch"] = cfg.concurrency
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
              eos_token_id: int | list[int] | None = None) -> tuple[list[dict], list[dict]]:
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


def write_outputs(out_dir: Path, ordered: list[dict], errors: list[dict], sampling: SamplingConfig,
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


# ---- the start-up probe ------------------------------------------------------------------------------

# Fields every OpenAI-compatible server takes; anything else in a body is an extra some refuse.
BASE_FIELDS = frozenset({"model", "messages", "max_tokens", "temperature", "top_p", "seed", "stream"})
EXTRA_PARAMS = {"top_k": "sampling.top_k", "min_p": "sampling.min_p", "chat_template_kwargs": "regen.disable_thinking",
                "generation_config": "sampling (as transformers' generation_config)"}


def probe_endpoints(endpoints: list[Endpoint], cfg: RegenConfig, sampling: SamplingConfig,
                    api_key: str | None = None, eos_token_id: int | list[int] | None = None,
                    sleep: Callable[[float], None] = time.sleep) -> list[Endpoint]:
    """Send every server one short request carrying exactly the fields the real ones will. A server
    that refuses a field stops the stage (ProbeRejected names it: regenerating without it would sample
    otherwise than params.yaml says); one that does not answer is left out; none answering is a ProbeError."""
    client = Client(cfg, sampling, api_key, sleep=sleep, eos_token_id=eos_token_id)
    probe_sampling = dataclasses.replace(sampling, max_tokens=1)
    live, dead = [], []
    for ep in endpoints:
        body = build_request(cfg.backend, ep.model, [{"role": "user", "content": "Hello"}], probe_sampling, 0,
                             cfg.disable_thinking, eos_token_id)
        try:
            status, text = client.status(ep, body)
        except RequestFailed as e:
            log.warning("regen: %s did not answer the start-up probe (%s); leaving it out", ep.url, e)
            dead.append(f"{ep.url} ({e.reason}: {e.detail[:120]})")
            continue
        if status >= 400:
            raise ProbeRejected(_why_rejected(client, ep, body, status, text))
        live.append(ep)
    if not live:
        raise ProbeError("regen: no server answered the start-up probe: " + "; ".join(dead))
    if dead:
        log.warning("regen: sending every row to the %d live server(s) of %d", len(live), len(endpoints))
    return live


def _why_rejected(client: Client, ep: Endpoint, body: dict, status: int, text: str) -> str:
    """Find the extra field(s) the server refuses: the request without any extra, then with each alone."""
    extras = [k for k in body if k not in BASE_FIELDS]
    bare = {k: v for k, v in body.items() if k not in extras}
    if not extras or client.status(ep, bare)[0] >= 400:
        return f"regen: {ep.url} rejects the request itself (HTTP {status}: {text[:300]}); check regen.model, the URL " \
               f"and the API key (regen.api_key_env)"
    refused = []
    for k in extras:
        code, why = client.status(ep, bare | {k: body[k]})
        if code >= 400:
            refused.append(f"`{k}` (HTTP {code}: {why[:300]}), which carries {EXTRA_PARAMS.get(k, k)}")
    if not refused:  # only the combination is refused
        refused = [f"{', '.join(f'`{k}`' for k in extras)} together (HTTP {status}: {text[:300]})"]
    return (f"regen: {ep.url} rejects " + "; and ".join(refused) + ". Regenerating without it would sample "
            "otherwise than params.yaml says: use a server that accepts it (vLLM and sglang take top_k, min_p and "
            "chat_template_kwargs; for `transformers serve` set regen.backend: transformers)")
