"""Regeneration throughput: generated tokens/s at concurrency 1 vs N against the same server.

    python benchmarks/regen.py [--model data/target] [--requests 32] [--concurrency 8] [--url URL]

Starts `transformers serve` (continuous batching) on 127.0.0.1 unless --url is given, sends the
same prompts from data/split/train.jsonl once one at a time and once N at a time, and prints both
rates and their ratio (measured side by side in one run).
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deepspec.config import RegenConfig, SamplingConfig
from deepspec.data.regen import Client, Endpoint, build_request, model_eos, request_token_bound
from deepspec.data.servers import cb_budget, launch_transformers_serve


def run(client: Client, ep: Endpoint, prompts: list[str], sampling: SamplingConfig, concurrency: int) -> dict:
    eos = model_eos(Path(ep.model))

    def one(i_prompt):
        i, prompt = i_prompt
        body = build_request("transformers", ep.model, [{"role": "user", "content": prompt}], sampling, i,
                             eos_token_id=eos)
        return client.complete(ep, body)[2]

    t0 = time.time()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, enumerate(prompts)))
    wall = time.time() - t0
    return {"concurrency": concurrency, "requests": len(prompts), "tokens": tokens, "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1)}


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
        seq = run(client, ep, prompts, sampling, 1)
        par = run(client, ep, prompts, sampling, args.concurrency)
    finally:
        if server:
            server.stop()
    print(json.dumps({"sequential": seq, "concurrent": par,
                      "ratio_tokens_per_s": round(par["tokens_per_s"] / seq["tokens_per_s"], 2)}, indent=2))


if __name__ == "__main__":
    main()
