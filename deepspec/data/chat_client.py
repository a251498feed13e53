"""Talking to an OpenAI-compatible chat server: the request body each backend reads, the reply's
parts, and one retry layer over the `openai` SDK; the start-up probe that checks a server takes
every field the sampling params need before any row is sent.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

from deepspec.config import RegenConfig, SamplingConfig
from deepspec.io import hash_unit

log = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    def __init__(self, reason: str, detail: str = "", retryable: bool = True):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.retryable = retryable


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

    @property
    def shown(self) -> str:
        """The URL for logs and errors: without user info (a password in it must not reach a log)."""
        return redact_url(self.url)


def redact_url(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


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
            log.warning("regen: %s did not answer the start-up probe (%s); leaving it out", ep.shown, e)
            dead.append(f"{ep.shown} ({e.reason}: {e.detail[:120]})")
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
        return f"regen: {ep.shown} rejects the request itself (HTTP {status}: {text[:300]}); check regen.model, the URL " \
               f"and the API key (regen.api_key_env)"
    refused = []
    for k in extras:
        code, why = client.status(ep, bare | {k: body[k]})
        if code >= 400:
            refused.append(f"`{k}` (HTTP {code}: {why[:300]}), which carries {EXTRA_PARAMS.get(k, k)}")
    if not refused:  # only the combination is refused
        refused = [f"{', '.join(f'`{k}`' for k in extras)} together (HTTP {status}: {text[:300]})"]
    return (f"regen: {ep.shown} rejects " + "; and ".join(refused) + ". Regenerating without it would sample "
            "otherwise than params.yaml says: use a server that accepts it (vLLM and sglang take top_k, min_p and "
            "chat_template_kwargs; for `transformers serve` set regen.backend: transformers)")
