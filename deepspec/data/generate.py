"""In-process generation for the regen stage (`regen.backend: local`): the same params give the same
answers, run to run.

A served backend answers a request with whatever else is in flight: its batch composition changes
the floating-point results, and `transformers serve` with continuous batching does not honour
per-request seeds. Here both are fixed by the rows themselves:
- rows are grouped, in input order, into batches cut by content (`batch_ranges`): a batch ends after
  a row whose id hashes below 1 / `regen.concurrency`, or at twice that many rows, so adding,
  removing or changing a row changes the composition of its own batch (and, rarely, the next);
- every row samples from its own generator, seeded per (row, turn) with the seed a served request
  would carry (`regen.request_seed`), so a row's draws never depend on its batch mates.
Same params, the same machine and thread count: the same answers.

Sampling applies temperature, top-k, top-p and min-p in that order (transformers' own order) and
draws the token itself; `generate` then runs greedy over the result, which leaves it one choice.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from deepspec.config import RegenConfig, SamplingConfig
from deepspec.data.chat_client import request_seed
from deepspec.devices import decoding, draw, generator, local_device
from deepspec.io import hash_unit
from deepspec.progress import progress

log = logging.getLogger(__name__)


def batch_ranges(ids: list[str], size: int) -> list[tuple[int, int]]:
    """Consecutive ranges [a, b) of the rows that are generated together: a cut after a row whose id
    hashes below 1 / size (a batch of `size` rows on average) or when a batch reaches 2 x size."""
    out, start = [], 0
    for batch in iter_batches(({"id": i} for i in ids), size):
        out.append((start, start + len(batch)))
        start += len(batch)
    return out


class RowSampler:
    """A logits processor that draws each row's next token from that row's own generator and
    returns scores whose only finite entry is the drawn token. The generators are made at the first
    call, on the device of the scores they draw for."""

    def __init__(self, sampling: SamplingConfig, seeds: list[int]):
        self.sampling = sampling
        self.seeds = list(seeds)
        self.generators: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        if s.temperature == 0:
            return scores
        logits = scores.float() / s.temperature
        if 0 < s.top_k < logits.shape[-1]:
            kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if s.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
            p = sorted_logits.softmax(-1)
            drop = p.cumsum(-1) - p >= s.top_p  # keep the smallest set whose mass reaches top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
        probs = logits.softmax(-1)
        if s.min_p > 0:
            probs = probs.masked_fill(probs < s.min_p * probs.max(-1, keepdim=True).values, 0.0)
        if self.generators is None:
            self.generators = [generator(probs.device, s) for s in self.seeds]
        out = torch.full_like(scores, float("-inf"))
        for i, g in enumerate(self.generators):
            out[i, draw(probs[i], g)] = 0.0
        return out


class LocalGenerator:
    """The target, in this process, answering batches of conversations turn by turn, on `device`
    (default: this process's accelerator, else the CPU). `load_model(device)` returns the target
    in eval mode on that device (the stage passes models.target.load_causal_lm: bfloat16 on a GPU,
    float32 on a CPU, as every stage runs it)."""

    def __init__(self, model_dir: Path, cfg: RegenConfig, sampling: SamplingConfig,
                 load_model: Callable[[torch.device], object], eos_token_id: int | list[int] | None = None,
                 device: torch.device | None = None):
        from transformers import AutoTokenizer, GenerationConfig

        self.cfg, self.sampling = cfg, sampling
        self.device = device or local_device()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = load_model(self.device)
        eos = eos_token_id if eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos)
        self.pad = pad
        # only what is set here applies: the model's generation_config (penalties, its own sampling
        # defaults), which `generate` would merge into any config passed, is replaced by it
        self.gen = GenerationConfig(do_sample=False, max_new_tokens=sampling.max_tokens,
                                    eos_token_id=sorted(self.eos), pad_token_id=pad)
        self.model.generation_config = self.gen

    def prompt(self, history: list[dict]) -> list[int]:
        from deepspec.data.template import encode_prompt

        kwargs = {"enable_thinking": False} if self.cfg.disable_thinking else {}
        return encode_prompt(self.tokenizer, history, **kwargs)

    def answer(self, prompts: list[list[int]], seeds: list[int]) -> list[tuple[str, str, int]]:
        """(content, finish_reason, completion tokens) for each prompt: one batch, or with
        `regen.batch_tokens` the groups `token_groups` cuts from it."""
        out: list = [None] * len(prompts)
        for group in token_groups([len(p) for p in prompts], self.sampling.max_tokens, self.cfg.batch_tokens):
            for k, answer in zip(group, self._generate([prompts[k] for k in group], [seeds[k] for k in group])):
                out[k] = answer
        return out

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], seeds: list[int]) -> list[tuple[str, str, int]]:
        longest = max(len(p) for p in prompts)
        # left padding: every row's next token is at the end
        ids = torch.tensor([[self.pad] * (longest - len(p)) + p for p in prompts], dtype=torch.long, device=self.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long,
                            device=self.device)
        try:
            with decoding(self.device):
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=self.gen,
                                          logits_processor=[RowSampler(self.sampling, seeds)])
        except torch.OutOfMemoryError as e:  # the same batch comes back on a rerun: say how to cut it
            raise RuntimeError(
                f"regen: out of device memory generating {len(prompts)} rows with prompts of up to {longest} "
                f"tokens ({len(prompts) * (longest + self.sampling.max_tokens)} rows x (prompt + max_tokens) "
                f"tokens); set regen.batch_tokens below that to cut batches by tokens, or lower "
                f"regen.concurrency") from e
        answers = []
        for row in out[:, longest:].tolist():
            stop = next((k for k, t in enumerate(row) if t in self.eos), None)
            tokens = row if stop is None else row[:stop]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            answers.append((text, "length" if stop is None else "stop", len(tokens) + (stop is not None)))
        return answers

    def regenerate(self, rows: list[dict], seed_of) -> tuple[list[dict], list[dict]]:
        """Every row of one batch, turn by turn; returns (finished rows, errors)."""
        state = []
        for row in rows:
            turns = row["conversations"]
            history = [dict(turns[0])] if turns and turns[0]["role"] == "system" else []
            users = [t["content"] for t in turns if t["role"] == "user"]
            state.append({"row": row, "history": history, "users": users, "finish": [], "tokens": 0})
        errors: dict[str, dict] = {}
        for t in range(max(len(s["users"]) for s in state)):
            active = [s for s in state if t < len(s["users"]) and s["row"]["id"] not in errors]
            prompts = []
            for s in list(active):
                s["history"].append({"role": "user", "content": s["users"][t]})
                try:
                    prompts.append(self.prompt(s["history"]))
                except Exception as e:  # the template refuses this conversation: a row error
                    errors[s["row"]["id"]] = {"id": s["row"]["id"], "reason": "template",
                                              "detail": f"{type(e).__name__}: {e}"[:200]}
                    active.remove(s)
            if not active:
                continue
            for s, (text, finish, n) in zip(active, self.answer(prompts, [seed_of(s["row"]["id"], t) for s in active])):
                if not text.strip():
                    errors[s["row"]["id"]] = {"id": s["row"]["id"], "reason": "empty_content",
                                              "detail": f"finish_reason={finish}"}
                    continue
                s["history"].append({"role": "assistant", "content": text})
                s["finish"].append(finish)
                s["tokens"] += n
        done = [{"id": s["row"]["id"], "task": s["row"].get("task"), "source": s["row"].get("source"),
                 "conversations": s["history"], "finish_reasons": s["finish"], "completion_tokens": s["tokens"]}
                for s in state if s["row"]["id"] not in errors]
        return done, list(errors.values())


def token_groups(lengths: list[int], max_new: int, budget: int | None) -> list[list[int]]:
    """The indices of one turn's prompts in the groups generated together: all of them, or with a
    budget, cut (shortest prompts first, so that a group pads little) where a group's rows x (longest
    prompt + max_new) would pass it; a prompt longer than the budget alone is a group of one. A pure
    function of the lengths: a resumed batch is cut as its first run cut it."""
    if budget is None:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda k: (lengths[k], k))
    groups: list[list[int]] = []
    for k in order:
        if groups and (len(groups[-1]) + 1) * (lengths[k] + max_new) <= budget:
            groups[-1].append(k)
        else:
            groups.append([k])
    return groups


def iter_batches(rows: Iterable[dict], size: int) -> Iterator[list[dict]]:
    """`rows` in the batches `batch_ranges` cuts, read as they go."""
    batch: list[dict] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= 2 * size or hash_unit("regen-batch", row["id"]) < 1.0 / size:
            yield batch
            batch = []
    if batch:
        yield batch


def run_local(rows: Iterable[dict], model_dir: Path, cfg: RegenConfig, sampling: SamplingConfig, journal,
              load_model: Callable[[torch.device], object], eos_token_id: int | list[int] | None = None,
              device: torch.device | None = None):
    """Regenerate every batch that holds a row not in the journal; returns (rows in input order,
    errors). A batch is always generated whole, so a row resumed after a crash gets the answer an
    uninterrupted run gives it. `rows` is iterated three times and held one batch at a time."""
    total = todo = 0
    for r in rows:
        total += 1
        todo += r["id"] not in journal.done
    errors: list[dict] = []
    if todo:
        gen = LocalGenerator(model_dir, cfg, sampling, load_model, eos_token_id, device)
        log.info("regen: %d rows, %d to generate (in their whole batches)", total, todo)
        bar = progress(total=total, initial=total - todo, unit="sample", desc="regen")
        for batch in iter_batches(rows, cfg.concurrency):
            missing = sum(r["id"] not in journal.done for r in batch)
            if not missing:
                continue
            done, failed = gen.regenerate(batch, lambda row_id, t: request_seed(sampling, row_id, t))
            for row in done:
                if row["id"] not in journal.done:
                    journal.append(row)
            errors += failed
            bar.update(missing)
        bar.close()
    return journal.in_order(rows), errors
