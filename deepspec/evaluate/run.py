"""The `eval` stage: speculative vs plain decoding on named prompt suites, reference metrics.

Every user turn of a prompt is asked in order, with the target's own greedy answers as the
assistant history (the way MT-Bench is run); greedy plain, greedy speculative and (optionally)
sampled speculative decoding all continue the same history. Per suite, pooled over every verify
round of every turn:

    tau              mean over verify rounds of (accepted draft tokens + 1), the +1 being the
                     target's own token (not counted after an accepted stop token, nor when the
                     round already filled max_new_tokens)
    accept_rate@k    #{rounds with more than k accepted} / #{rounds that proposed more than k}
    mean_proposal    mean number of draft tokens verified per round
    speedup          tokens/s of speculative decoding / tokens/s of plain decoding (greedy)
    greedy_match     fraction of turns whose greedy speculative output equals plain decoding
    confidence       (drafts with a confidence head) the predicted prefix acceptance of every
                     verified slot against the outcome: mean prediction, observed rate, Brier
                     score, expected calibration error (10 bins) and AUROC
Per-turn rows keep the numbers (and the answer) of every turn; `per_task` groups tau by task.
The protocol (template, thinking, sampling filters, block size, budget) travels with the metrics.
"""
from __future__ import annotations

import collections
import json
import logging
from pathlib import Path

import numpy as np
import torch

from deepspec.config import EvalConfig, SamplingConfig
from deepspec.data.template import encode_prompt
from deepspec.evaluate.specdec import FILTER_ORDER, Result, SpecDecoder, Warp
from deepspec.evaluate.suites import PromptError
from deepspec.progress import progress

log = logging.getLogger(__name__)

__all__ = ["PromptError", "evaluate", "compact_metrics", "plot_rows", "round_metrics"]


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


def load_models(target_dir: Path, draft_dir: Path, device: torch.device, load=None):
    """Tokenizer, target, draft and stop ids; `load()`, when given, loads the target (a sharded one)."""
    from transformers import AutoTokenizer

    from deepspec.models.registry import load_draft
    from deepspec.models.target import compute_settings, load_causal_lm

    compute = compute_settings(target_dir, device)
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = load() if load is not None else load_causal_lm(target_dir, device, compute)
    draft = load_draft(draft_dir, device, getattr(torch, compute["dtype"]))
    eos = target.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None:
        stop.add(tok.eos_token_id)
    return tok, target, draft, stop


class Session:
    """Target + draft loaded once; asks the turns of one prompt at a time."""

    def __init__(self, target_dir: Path, draft_dir: Path, cfg: EvalConfig, sampling: SamplingConfig,
                 device: torch.device | None = None, load=None):
        self.device = device or torch.device("cpu")
        self.tok, target, draft, self.stop = load_models(target_dir, draft_dir, self.device, load)
        self.identity = json.loads((target_dir / "identity.json").read_text())
        if draft.config.target.get("id") and draft.config.target != self.identity:
            raise PromptError(f"{draft_dir}: the draft was trained against another target "
                              f"({draft.config.target.get('id')})")
        self.block = draft.config.block_size
        self.dec = SpecDecoder(target, draft, self.stop, self.device, confidence_threshold=cfg.confidence_threshold)
        self.cfg, self.sampling = cfg, sampling
        self.greedy = Warp()
        self.sampled = Warp.from_sampling(sampling, greedy=False)
        self.do_sample = cfg.sample and not self.sampled.greedy

    def warm_up(self) -> None:
        """Each kind of decode once, untimed, on a short prompt: the first decode in a process pays the
        device's lazy start-up (kernel loading, cuBLAS handles), which would land on the first prompt's
        plain decode and inflate the speedup."""
        ids = encode_prompt(self.tok, [{"role": "user", "content": "Hi"}], enable_thinking=self.cfg.thinking)
        self.dec.plain(ids, 2, self.greedy)
        self.dec.speculative(ids, 2, self.greedy)
        if self.do_sample:
            self.dec.speculative(ids, 2, self.sampled)

    def answer_text(self, tokens: list[int]) -> str:
        """The assistant turn that goes into the history: the answer without its stop token."""
        return self.tok.decode([t for t in tokens if t not in self.stop], skip_special_tokens=True)

    def ask(self, prompt: dict, seed: int) -> list[dict]:
        """Every user turn in order; returns one row per turn with its Results under `_results`."""
        history = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
        rows = []
        for t, user in enumerate(prompt["turns"]):
            history.append({"role": "user", "content": user})
            ids = encode_prompt(self.tok, history, enable_thinking=self.cfg.thinking)
            plain = self.dec.plain(ids, self.cfg.max_new_tokens, self.greedy)
            spec = self.dec.speculative(ids, self.cfg.max_new_tokens, self.greedy)
            answer = self.answer_text(plain.tokens)
            row = {"id": prompt["id"], "task": prompt["task"], "turn": t, "prompt_tokens": len(ids),
                   "new_tokens": len(spec.tokens), "greedy_match": spec.tokens == plain.tokens,
                   "tau": round_metrics([spec], self.block)["tau"], "rounds": len(spec.rounds),
                   "spec_s": round(spec.seconds, 4), "plain_s": round(plain.seconds, 4), "answer": answer,
                   "_results": {"plain": plain, "spec": spec}}
            if self.do_sample:
                s = self.dec.speculative(ids, self.cfg.max_new_tokens, self.sampled, seed=seed * 1000 + t)
                row["tau_sample"] = round_metrics([s], self.block)["tau"]
                row["_results"]["sample"] = s
            rows.append(row)
            history.append({"role": "assistant", "content": answer})
        return rows

    def protocol(self) -> dict:
        s = self.sampling
        return {"chat_template_sha256": str(self.identity.get("chat_template_sha256", ""))[:16],
                "thinking": self.cfg.thinking, "history": "target greedy answers",
                "greedy": True, "sampled": self.do_sample,
                "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
                "filter_order": ",".join(FILTER_ORDER), "block_size": self.block,
                "max_new_tokens": self.cfg.max_new_tokens, "tau_counts_bonus": True}


def suite_metrics(rows: list[dict], block: int, do_sample: bool) -> dict:
    """Pooled over every verify round of every turn of the suite."""
    spec = [r["_results"]["spec"] for r in rows]
    plain = [r["_results"]["plain"] for r in rows]
    g = round_metrics(spec, block)
    spec_rate = sum(len(r.tokens) for r in spec) / max(sum(r.seconds for r in spec), 1e-9)
    plain_rate = sum(len(r.tokens) for r in plain) / max(sum(r.seconds for r in plain), 1e-9)
    g |= {"tokens_per_s": round(spec_rate, 2), "plain_tokens_per_s": round(plain_rate, 2),
          "speedup": round(spec_rate / plain_rate, 4),
          "greedy_match": round(sum(r["greedy_match"] for r in rows) / len(rows), 4)}
    per_task = collections.defaultdict(list)
    for r in rows:
        per_task[r["task"]].append(r["_results"]["spec"])
    out = {"tau": g["tau"], "speedup": g["speedup"], "greedy_match": g["greedy_match"],
           "prompts": sum(r["turn"] == 0 for r in rows), "turns": len(rows), "greedy": g,
           "per_task": {t: round_metrics(r, block)["tau"] for t, r in sorted(per_task.items())}}
    if do_sample:
        out["sample"] = round_metrics([r["_results"]["sample"] for r in rows], block)
        out["tau_sample"] = out["sample"]["tau"]
    return out


def evaluate(target_dir: Path, draft_dir: Path, suites: dict[str, list[dict]], cfg: EvalConfig,
             sampling: SamplingConfig, device: torch.device | None = None, load=None) -> tuple[dict, list[dict]]:
    """The full report {protocol, suites: {name: metrics}} and one row per (suite, prompt, turn). `load`:
    how the target is loaded (a tensor-parallel group's sharded target: every rank of the group runs
    this whole loop, and each forward of the target is a collective of the group)."""
    sess = Session(target_dir, draft_dir, cfg, sampling, device, load)
    sess.warm_up()
    report, all_rows = {"protocol": sess.protocol(), "suites": {}}, []
    for name, prompts in suites.items():
        rows = []
        for i, p in enumerate(progress(prompts, desc=f"eval {name}", unit="prompt")):
            rows.extend(sess.ask(p, seed=sampling.seed + i))
        if not rows:
            raise PromptError(f"suite {name}: no prompts")
        report["suites"][name] = suite_metrics(rows, sess.block, sess.do_sample)
        all_rows.extend({"suite": name, **{k: v for k, v in r.items() if k != "_results"}} for r in rows)
    return report, all_rows


def compact_metrics(report: dict) -> dict:
    """metrics.json: a few flat keys per suite (the columns of `dvc exp show`) and the protocol."""
    keys = ("tau", "tau_sample", "speedup", "greedy_match", "prompts", "turns")
    out = {name: {k: m[k] for k in keys if k in m} for name, m in report["suites"].items()}
    return out | {"protocol": report["protocol"]}


def plot_rows(report: dict) -> list[dict]:
    """Rows of the per-suite bar chart (dvc.yaml `plots`)."""
    rows = []
    for name, m in report["suites"].items():
        rows.append({"suite": name, "decoding": "greedy", "tau": m["tau"]})
        if "tau_sample" in m:
            rows.append({"suite": name, "decoding": "sampled", "tau": m["tau_sample"]})
    return rows
