"""Peak memory of the regen server: `transformers serve --continuous-batching` with its KV cache sized
from the work (what the regen stage does) vs sized from free memory (the server's own default).

    python benchmarks/serve_memory.py [--model data/target] [--rows 32] [--concurrency 8] [--max-tokens 64]
                                      [--unsized]

Without --model it builds a random-weight target of the embedded default's shape (36 layers, width
128, builtin tokenizer) in a temp dir; random weights never stop early, so every answer is
max-tokens long (the worst case). Prompts are the packaged corpus's conversations. Prints the
server's peak resident set (VmHWM) for each run. --unsized also starts the server with no KV sizing:
it reserves 80-90% of the machine's free memory, so run that only where nobody else needs it.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from deepspec.config import RegenConfig, SamplingConfig, SplitConfig, TinyTargetConfig
from deepspec.data.chat_client import Endpoint
from deepspec.data.journal import Journal
from deepspec.data.regen import model_eos, request_token_bound, run_regen
from deepspec.data.servers import cb_budget, launch_transformers_serve
from deepspec.embedded.tiny import builtin_train_rows


def build_default_shaped_target(out: Path, rows: list[dict]) -> Path:
    import torch
    from transformers import Qwen3ForCausalLM

    from deepspec.models.target import default_generation_config
    from deepspec.embedded.tiny import build_config, build_tokenizer, conversation_text

    cfg = TinyTargetConfig()
    tok = build_tokenizer([conversation_text(r["conversations"]) for r in rows], cfg.vocab_size)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(build_config(cfg, tok))
    model.generation_config = default_generation_config(tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def measure(model: Path, rows: list[dict], cfg: RegenConfig, sampling: SamplingConfig, cb: dict | None,
            work: Path) -> dict:
    server = launch_transformers_serve(model, continuous_batching=True, cb=cb, log_dir=work, timeout=600)
    idle = status_bytes(server.proc.pid, "VmHWM")
    t0 = time.time()
    try:
        ordered, errors = run_regen(rows, [Endpoint(server.url, server.model)], cfg, sampling,
                                    Journal(work / f"journal-{bool(cb)}", "bench"), eos_token_id=model_eos(model))
        peak = status_bytes(server.proc.pid, "VmHWM")
    finally:
        server.stop()
    return {"kv_sizing": cb or "server default (free memory)", "rows": len(ordered), "errors": len(errors),
            "seconds": round(time.time() - t0, 1), "peak_rss_after_start_mib": round(idle / 2**20),
            "peak_rss_mib": round(peak / 2**20)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--unsized", action="store_true")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    corpus = builtin_train_rows(SplitConfig())
    work = Path(tempfile.mkdtemp(prefix="deepspec-serve-mem-"))
    model = Path(args.model) if args.model else build_default_shaped_target(work / "target", corpus)
    # the cache is sized for the longest row of the whole corpus (as the stage does for all its rows);
    # the requests are an even sample of it
    rows = corpus[:: max(1, len(corpus) // args.rows)][: args.rows]
    cfg = RegenConfig(backend="transformers", concurrency=args.concurrency, timeout_s=900)
    sampling = SamplingConfig(max_tokens=args.max_tokens)
    need = request_token_bound(AutoTokenizer.from_pretrained(model), corpus, sampling, cfg.disable_thinking)
    budget = cb_budget(need, args.concurrency)
    out = {"request_token_bound": need, "sized": measure(model, rows, cfg, sampling, budget, work)}
    if args.unsized:
        out["unsized"] = measure(model, rows, cfg, sampling, None, work)
        out["peak_ratio_unsized_over_sized"] = round(out["unsized"]["peak_rss_mib"] / out["sized"]["peak_rss_mib"], 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
