"""The `eval` stage: speculative vs plain decoding on held-out prompts, reference metrics.

    tau              mean over verify rounds of (accepted draft tokens + 1), the +1 being the
                     target's own token (not counted after an accepted stop token)
    accept_rate@k    #{rounds with more than k accepted} / #{rounds that proposed more than k}
    mean_proposal    mean number of draft tokens verified per round
    speedup          tokens/s of speculative decoding / tokens/s of plain decoding (greedy)
    confidence       (drafts with a confidence head) the predicted prefix acceptance of every
                     verified slot against the outcome: mean prediction, observed rate, Brier
                     score, expected calibration error (10 bins) and AUROC
Per-prompt rows keep the numbers of every prompt; `per_task` groups tau by the split's task.
"""
from __future__ import annotations

import collections
import json
import logging
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from deepspec.config import EvalConfig, SamplingConfig
from deepspec.data.conversation import normalize_prompt
from deepspec.data.template import encode_prompt
from deepspec.evaluate.specdec import Result, SpecDecoder, Warp

log = logging.getLogger(__name__)


class PromptError(ValueError):
    pass


def load_prompts(path: Path, limit: int) -> list[dict]:
    """Rows with `turns` (our split's eval file or the reference's eval JSONL); first turn is used.
    A prompt repeated in the file (same system prompt and same first turn up to case and
    whitespace) is evaluated once, so it does not weigh twice in the metrics."""
    rows, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{lineno}: not valid JSON: {e.msg}") from None
            turns = row.get("turns") if isinstance(row, dict) else None
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
                raise PromptError(f"{path}:{lineno}: field 'turns' must be a non-empty list of strings")
            key = (row.get("system"), normalize_prompt(turns[0]))
            if key in seen:
                continue
            seen.add(key)
            rows.append({"id": str(row.get("id", lineno)), "task": str(row.get("task", "unknown")),
                         "system": row.get("system"), "prompt": turns[0]})
    if not rows:
        raise PromptError(f"{path}: no prompts")
    return interleave_tasks(rows)[:limit]


def interleave_tasks(rows: list[dict]) -> list[dict]:
    """Round-robin over tasks in file order, so a prefix of the list covers every task."""
    by_task: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r)
    queues = [by_task[t] for t in sorted(by_task)]
    out = []
    for i in range(max(len(q) for q in queues)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def round_metrics(results: list[Result], block: int) -> dict:
    rounds = [r for res in results for r in res.rounds]
    if not rounds:
        return {"tau": 0.0, "rounds": 0}
    out = {
        "tau": round(sum(r.acceptance_length for r in rounds) / len(rounds), 4),
        "rounds": len(rounds),
        "mean_proposal": round(sum(r.proposed for r in rounds) / len(rounds), 4),
        "tokens": sum(len(res.tokens) for res in results),
    }
    for k in range(block):
        proposed = sum(r.proposed > k for r in rounds)
        if proposed:
            out[f"accept_rate@{k}"] = round(sum(r.accepted > k for r in rounds) / proposed, 4)
    pred = [c for r in rounds for c in r.confidence]
    if pred:
        out["confidence"] = confidence_metrics(np.array(pred), np.array([y for r in rounds for y in r.prefix_accepted]))
    return out


def confidence_metrics(pred: np.ndarray, label: np.ndarray, bins: int = 10) -> dict:
    """Calibration of predicted probabilities against 0/1 outcomes."""
    label = label.astype(np.float64)
    which = np.minimum((pred * bins).astype(int), bins - 1)
    ece = sum(abs(pred[which == b].mean() - label[which == b].mean()) * (which == b).sum()
              for b in range(bins) if (which == b).any()) / len(pred)
    return {"slots": int(len(pred)), "pred_mean": round(float(pred.mean()), 4),
            "observed": round(float(label.mean()), 4), "brier": round(float(((pred - label) ** 2).mean()), 4),
            "ece": round(float(ece), 4), "auc": auroc(pred, label)}


def auroc(score: np.ndarray, label: np.ndarray) -> float | None:
    """P(score of a random positive > score of a random negative), ties counting half (Mann-Whitney)."""
    pos, neg = int(label.sum()), int(len(label) - label.sum())
    if not pos or not neg:
        return None
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    ranks = (np.bincount(inverse, ranks) / counts)[inverse]  # average rank within ties
    return round(float((ranks[label == 1].sum() - pos * (pos + 1) / 2) / (pos * neg)), 4)


def load_models(target_dir: Path, draft_dir: Path, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepspec.models.draft import DraftModel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation="sdpa").to(device)
    draft = DraftModel.load(draft_dir, device).to(dtype)
    eos = target.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None:
        stop.add(tok.eos_token_id)
    return tok, target, draft, stop


def evaluate(target_dir: Path, draft_dir: Path, prompts: list[dict], cfg: EvalConfig, sampling: SamplingConfig,
             device: torch.device | None = None) -> tuple[dict, list[dict]]:
    device = device or torch.device("cpu")
    tok, target, draft, stop = load_models(target_dir, draft_dir, device)
    if draft.config.target.get("id") and draft.config.target != json.loads((target_dir / "identity.json").read_text()):
        raise PromptError(f"{draft_dir}: the draft was trained against another target "
                          f"({draft.config.target.get('id')})")
    dec = SpecDecoder(target, draft, stop, device, confidence_threshold=cfg.confidence_threshold)
    greedy = Warp()
    sampled = Warp.from_sampling(sampling, greedy=False)
    do_sample = cfg.sample and not sampled.greedy
    rows, spec_g, plain_g, spec_s = [], [], [], []
    for i, p in enumerate(tqdm(prompts, desc="eval", unit="prompt", dynamic_ncols=True)):
        turns = ([{"role": "system", "content": p["system"]}] if p.get("system") else []) + \
                [{"role": "user", "content": p["prompt"]}]
        ids = encode_prompt(tok, turns, enable_thinking=False)
        plain = dec.plain(ids, cfg.max_new_tokens, greedy)
        spec = dec.speculative(ids, cfg.max_new_tokens, greedy)
        row = {"id": p["id"], "task": p["task"], "prompt_tokens": len(ids), "new_tokens": len(spec.tokens),
               "greedy_match": spec.tokens == plain.tokens,
               "tau": round_metrics([spec], draft.config.block_size)["tau"],
               "spec_s": round(spec.seconds, 4), "plain_s": round(plain.seconds, 4)}
        plain_g.append(plain)
        spec_g.append(spec)
        if do_sample:
            s = dec.speculative(ids, cfg.max_new_tokens, sampled, seed=sampling.seed + i)
            spec_s.append(s)
            row["tau_sample"] = round_metrics([s], draft.config.block_size)["tau"]
        rows.append(row)

    block = draft.config.block_size
    g = round_metrics(spec_g, block)
    spec_rate = sum(len(r.tokens) for r in spec_g) / max(sum(r.seconds for r in spec_g), 1e-9)
    plain_rate = sum(len(r.tokens) for r in plain_g) / max(sum(r.seconds for r in plain_g), 1e-9)
    g |= {"tokens_per_s": round(spec_rate, 2), "plain_tokens_per_s": round(plain_rate, 2),
          "speedup": round(spec_rate / plain_rate, 4),
          "greedy_match": round(sum(r["greedy_match"] for r in rows) / len(rows), 4)}
    per_task = collections.defaultdict(list)
    for row, res in zip(rows, spec_g):
        per_task[row["task"]].append(res)
    metrics = {"tau": g["tau"], "speedup": g["speedup"], "prompts": len(rows), "greedy": g,
               "per_task": {t: round_metrics(r, block)["tau"] for t, r in sorted(per_task.items())}}
    if do_sample:
        metrics["sample"] = round_metrics(spec_s, block) | {"temperature": sampling.temperature,
                                                            "top_p": sampling.top_p, "top_k": sampling.top_k}
        metrics["tau_sample"] = metrics["sample"]["tau"]
    return metrics, rows
