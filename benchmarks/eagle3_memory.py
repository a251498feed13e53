"""Peak memory of one EAGLE-3 training step at the reference vocabulary, target logits chunked vs whole.

    python benchmarks/eagle3_memory.py [--vocab 151936] [--hidden 256] [--tokens 2048,4096] [--steps 4]
                                       [--code DIR]

A synthetic EAGLE-3 draft (hidden --hidden, the target's head random at --vocab rows, a 32 k draft
vocabulary) and a synthetic batch of one sample of each --tokens length, every token a loss token;
each configuration runs one forward + backward of `eagle3_loss` in a fresh process, and the table
gives the peak RSS above the process's baseline (after the model and batch exist) for the target's
full-vocabulary distributions computed in chunks of `TARGET_CHUNK_ROWS` rows (what training does) and
one chunk of all rows, side by side, with their ratio; `--code DIR` adds the loss of another
checkout (e.g. `git worktree add DIR <commit before the chunking>`) as a third column.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def child(spec: dict) -> None:
    import gc

    import torch

    import deepspec.models.eagle3 as eagle3  # from PYTHONPATH: this checkout or --code
    from deepspec.models.draft import DraftConfig

    torch.manual_seed(0)
    torch.set_num_threads(2)
    H, V, T = spec["hidden"], spec["vocab"], spec["tokens"]
    cfg = DraftConfig(algorithm="eagle3", target_layers=[1, 2, 3], target_hidden_size=H, vocab_size=V,
                      block_size=spec["steps"], num_layers=1, hidden_size=H, num_heads=4, num_kv_heads=2,
                      head_dim=H // 4, intermediate_size=2 * H, ttt_steps=spec["steps"],
                      draft_vocab_size=spec["draft_vocab"])
    model = eagle3.Eagle3Model(cfg)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:spec["draft_vocab"]] = True
    model.set_vocab(torch.zeros(spec["draft_vocab"], dtype=torch.long), t2d)
    model.verifier_head = torch.randn(V, H) * 0.02
    batch = {"input_ids": torch.randint(0, V, (1, T)), "loss_mask": torch.ones(1, T, dtype=torch.long),
             "lengths": torch.tensor([T]), "hidden": torch.randn(1, T, 3 * H), "last_hidden": torch.randn(1, T, H)}
    if not spec["chunked"]:
        eagle3.TARGET_CHUNK_ROWS = 1 << 40
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = status_kb("VmRSS")
    out = eagle3.eagle3_loss(model, batch, 1.0, 1.0, 4.0)
    out.loss.backward()
    print(json.dumps({"baseline_kb": base, "peak_kb": status_kb("VmHWM"), "loss": float(out.loss)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--tokens", default="1024,2048,4096")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--code", help="another checkout whose eagle3_loss to measure beside")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    print(f"EAGLE-3 step (forward + backward), V = {args.vocab}, draft vocabulary {args.draft_vocab}, "
          f"H = {args.hidden}, ttt_steps {args.steps}: peak RSS above baseline, MB")
    runs = [("chunked", REPO, True), ("whole", REPO, False)] + ([("--code", Path(args.code), False)] if args.code else [])
    print(f"{'tokens':>7} " + " ".join(f"{name:>9}" for name, _, _ in runs) + f" {'ratio':>6} {'same loss':>10}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        res = {}
        for name, code, chunked in runs:
            spec = {"vocab": args.vocab, "hidden": args.hidden, "draft_vocab": args.draft_vocab, "tokens": tokens,
                    "steps": args.steps, "chunked": chunked}
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                  text=True, check=True, env=dict(os.environ, PYTHONPATH=str(code.resolve())))
            res[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        mb = {k: (r["peak_kb"] - r["baseline_kb"]) / 1024 for k, r in res.items()}
        last = runs[-1][0]
        same = all(abs(r["loss"] - res[last]["loss"]) <= 1e-5 * abs(res[last]["loss"]) for r in res.values())
        print(f"{tokens:>7} " + " ".join(f"{mb[name]:>9.0f}" for name, _, _ in runs)
              + f" {mb['chunked'] / mb[last]:>6.2f} {str(same):>10}")


if __name__ == "__main__":
    main()
