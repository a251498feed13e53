"""Regeneration throughput: generated tokens/s at concurrency 1 vs N against the same server, and
the in-process backend (`regen.backend: local`) at batch N on the same prompts.

    python benchmarks/regen.py [--model data/target] [--requests 32] [--concurrency 8] [--url URL]

Starts `transformers serve` (continuous batching) on 127.0.0.1 unless --url is given, sends the
same prompts from data/split/train.jsonl once one at a time and twice N at a time, then generates
them twice in-process in batches of N, and prints every rate, the ratios, and for each backend how
many answers differ between its two runs (measured side by side in one run).
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deepspec.config import RegenConfig, SamplingConfig
from deepspec.data.chat_client import Client, Endpoint, build_request
from deepspec.data.regen import model_eos, request_token_bound
from deepspec.data.servers import cb_budget, launch_transformers_serve


def run(client: Client, ep: Endpoint, prompts: list[str], sampling: SamplingConfig,
        concurrency: int) -> tuple[dict, list[str]]:
    """(rates, answers) of the prompts sent `concurrency` at a time."""
    eos = model_eos(Path(ep.model))

    def one(i_prompt):
        i, prompt = i_prompt
        body = build_request("transformers", ep.model, [{"role": "user", "content": prompt}], sampling, i,
                             eos_token_id=eos)
        return client.complete(ep, body)

    t0 = time.time()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, enumerate(prompts)))
    wall = time.time() - t0
    tokens = sum(n for _, _, n in done)
    return {"concurrency": concurrency, "requests": len(prompts), "tokens": tokens, "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1)}, [text for text, _, _ in done]


def run_local(model: str, prompts: list[str], sampling: SamplingConfig, batch: int) -> tuple[dict, list[str]]:
    from deepspec.data.generate import LocalGenerator
    from deepspec.models.target import load_causal_lm

    gen = LocalGenerator(Path(model), RegenConfig(backend="local", concurrency=batch), sampling,
                         lambda device: load_causal_lm(model, device), model_eos(Path(model)))
    t0, tokens, texts = time.time(), 0, []
    for a in range(0, len(prompts), batch):
        chunk = [gen.prompt([{"role": "user", "content": p}]) for p in prompts[a:a + batch]]
        for text, _, n in gen.answer(chunk, list(range(a, a + len(chunk)))):
            texts.append(text)
            tokens += n
    wall = time.time() - t0
    return {"batch": batch, "requests": len(prompts), "tokens": tokens, "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1)}, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="data/target")
    ap.add_argument("--url", default="")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    rows = [json.loads(line) for line in open("data/split/train.jsonl")][: args.requests]
    prompts = [next(t["content"] for t in r["conversations"] if t["role"] == "user") for r in rows]
    sampling = SamplingConfig(max_tokens=args.max_tokens)
    client = Client(RegenConfig(backend="transformers", timeout_s=600), sampling)
    server = None
    if args.url:
        ep = Endpoint(args.url, args.model)
    else:
        from transformers import AutoTokenizer

        # the KV cache the regen stage would give it (the server's own default takes most of the RAM)
        single = [{"conversations": [{"role": "user", "content": p}]} for p in prompts]
        need = request_token_bound(AutoTokenizer.from_pretrained(args.model), single, sampling, True)
        server = launch_transformers_serve(Path(args.model), continuous_batching=True,
                                           cb=cb_budget(need, args.concurrency))
        ep = Endpoint(server.url, server.model)
    try:
        run(client, ep, prompts[:2], sampling, 2)  # warm-up (paged cache init)
        seq, _ = run(client, ep, prompts, sampling, 1)
        par, once = run(client, ep, prompts, sampling, args.concurrency)
        served = [once, run(client, ep, prompts, sampling, args.concurrency)[1]]
    finally:
        if server:
            server.stop()
    local, first = run_local(args.model, prompts, sampling, args.concurrency)
    _, second = run_local(args.model, prompts, sampling, args.concurrency)
    print(json.dumps({"sequential": seq, "concurrent": par, "local": local,
                      "ratio_tokens_per_s": round(par["tokens_per_s"] / seq["tokens_per_s"], 2),
                      "ratio_local_to_concurrent": round(local["tokens_per_s"] / par["tokens_per_s"], 2),
                      "answers_differing_between_two_runs": {
                          "served": sum(a != b for a, b in zip(*served)),
                          "local": sum(a != b for a, b in zip(first, second))}}, indent=2))


if __name__ == "__main__":
    main()
