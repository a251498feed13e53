"""EAGLE-3's loss, forward and backward, with each chunk's target distribution kept for backward
against recomputed there (models.eagle3.keeps_target_terms decides which the trainer does), side by
side in interleaved rounds on one random draft and batch.

    python benchmarks/eagle3_loss.py [--cpu] [--rounds 3] [--tokens N] [--vocab V] [--hidden H]

The draft has a target of Qwen3-4B's width (H 2,560, I 9,728, V 151,936: its [rows, V] head product
is the loss's largest) and the default 2,048-token draft vocabulary, random weights; the batch is one
sample of `--tokens` tokens, every one supervised. On a GPU the loss runs under bf16 autocast as the
trainer runs it, and the peak memory of each way is printed beside its time. Both ways must give the
same loss bits, and the script fails if they do not.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import deepspec.models.eagle3 as eagle3
from deepspec.devices import local_device
from deepspec.models.draft import DraftConfig


def build(hidden: int, inter: int, vocab: int, draft_vocab: int, ttt: int, device) -> eagle3.Eagle3Model:
    torch.manual_seed(0)
    heads = max(1, hidden // 128)
    cfg = DraftConfig(algorithm="eagle3", target_layers=[0, 1, 2], target_hidden_size=hidden, vocab_size=vocab,
                      block_size=ttt, hidden_size=hidden, num_heads=heads, num_kv_heads=max(1, heads // 4),
                      head_dim=128 if hidden >= 128 else hidden, intermediate_size=inter, ttt_steps=ttt,
                      draft_vocab_size=draft_vocab)
    model = eagle3.Eagle3Model(cfg)
    model.set_vocab(*eagle3.vocab_map({i: 1 for i in range(draft_vocab)}, draft_vocab, vocab))
    model.set_target_embeddings(torch.randn(vocab, hidden, device="cpu") * 0.02,
                                torch.randn(vocab, hidden, device="cpu") * 0.02)
    return model.to(device)


def batch_of(tokens: int, hidden: int, vocab: int, device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(1)
    return {k: v.to(device) for k, v in {
        "input_ids": torch.randint(0, vocab, (1, tokens), generator=g, device="cpu"),
        "loss_mask": torch.ones(1, tokens, dtype=torch.uint8, device="cpu"),
        "lengths": torch.full((1,), tokens, device="cpu"),
        "hidden": torch.randn(1, tokens, 3 * hidden, generator=g, device="cpu").to(torch.bfloat16),
        "last_hidden": torch.randn(1, tokens, hidden, generator=g, device="cpu").to(torch.bfloat16)}.items()}


def one(model, batch, keep: bool, device) -> tuple[float, float, torch.Tensor]:
    """Seconds and peak GiB (CUDA; 0 on the CPU) of one forward and backward, and the loss."""
    eagle3.keeps_target_terms = lambda vd, i: keep
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = eagle3.eagle3_loss(model, batch, 1.0, 1.0, 4.0)
    out.loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return time.perf_counter() - t, peak, out.loss.detach().cpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, help="default: 8,192 on a GPU, 256 on the CPU")
    ap.add_argument("--ttt", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--intermediate", type=int, default=9728)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    args = ap.parse_args()
    device = torch.device("cpu") if args.cpu else local_device()
    tokens = args.tokens or (8192 if device.type == "cuda" else 256)
    real = eagle3.keeps_target_terms
    chosen = real(args.draft_vocab, args.intermediate)
    model = build(args.hidden, args.intermediate, args.vocab, args.draft_vocab, args.ttt, device)
    batch = batch_of(tokens, args.hidden, args.vocab, device)
    one(model, batch, True, device)  # warm-up: kernels, the head cast once
    out: dict = {"kept": [], "recomputed": []}
    peaks, losses = {}, {}
    for _ in range(args.rounds):
        for name, keep in (("kept", True), ("recomputed", False)):
            s, peak, loss = one(model, batch, keep, device)
            out[name].append(s)
            peaks[name], losses[name] = peak, loss
    eagle3.keeps_target_terms = real
    same = torch.equal(losses["kept"], losses["recomputed"])
    res = {"device": str(device), "tokens": tokens, "ttt_steps": args.ttt, "hidden": args.hidden,
           "vocab": args.vocab, "draft_vocab": args.draft_vocab, "trainer_keeps": chosen,
           "kept_s": round(statistics.median(out["kept"]), 3),
           "recomputed_s": round(statistics.median(out["recomputed"]), 3),
           "peak_gib": {k: round(v, 2) for k, v in peaks.items()}, "same_loss": same}
    res["kept_vs_recomputed"] = round(res["kept_s"] / res["recomputed_s"], 3)
    print(f"EAGLE-3 loss fwd+bwd, {tokens} tokens x {args.ttt} steps, H {args.hidden}, V {args.vocab}, "
          f"Vd {args.draft_vocab} on {device}: kept {res['kept_s']} s, recomputed {res['recomputed_s']} s "
          f"(ratio {res['kept_vs_recomputed']}); the trainer {'keeps' if chosen else 'recomputes'}")
    print(f"FIGURE eagle3_loss.kept_vs_recomputed = {res['kept_vs_recomputed']}")
    print(json.dumps(res, indent=1))
    if not same:
        raise SystemExit("the kept and recomputed target distributions gave different losses")


if __name__ == "__main__":
    main()
