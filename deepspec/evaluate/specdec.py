"""Speculative decoding with a target and a block draft, and plain decoding for comparison.

Both keep transformers `DynamicCache`s. A round: the draft proposes its drafts (γ, or γ-1 in the
dflash slot layout) from one block anchored at the current token (its context is the target's
features of every committed token before it); the target scores [current, d1..dγ] in one forward; greedy accepts the longest prefix
that matches the target's argmax, sampling accepts d_i with probability min(1, p/q) and on the
first rejection resamples from norm(max(0, p - q)); either way the round adds one token from the
target (correction or bonus). The target cache is cropped back to the committed tokens.
Greedy speculative output is token-for-token the plain greedy output.

A draft with a confidence head also predicts, per slot, the probability that the slot is accepted
given the earlier ones; their running product is the predicted acceptance of the prefix. With a
`confidence_threshold` > 0 the block is cut before the first slot whose prefix prediction falls
below it (fewer wasted verify positions; the output is unchanged). Every round keeps the prefix
predictions of the slots it verified, so the head's calibration can be measured against outcomes.

The decoder owns the target, its cache and the verify/accept step; a *drafter* only proposes:
`propose(feats, positions, cur, cur_pos, warp, gen, tokens)` gets the target's features of the tokens
committed since its last call (at `positions`; `tokens` are those tokens) and the current token, and
returns a `Proposal` (k tokens, their distributions under the same warp, optional confidences).
`BlockDrafter` is the DSpark/DFlash one (one parallel block); `ChainDrafter` is EAGLE-3's (one token
at a time, each step reading the previous step's output).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from deepspec.config import SamplingConfig
from deepspec.devices import decoding, draw, generator
from deepspec.models.capture import capture_layers
from deepspec.models.target import cache_keyword


FILTER_ORDER = ("temperature", "top_k", "top_p", "min_p")


@dataclass
class Warp:
    """The sampling filters, applied identically to target and draft distributions, in the order
    of transformers' generate and sglang's sampler (`FILTER_ORDER`): logits / temperature, keep the
    top_k logits, softmax, keep the smallest set of tokens reaching top_p and renormalise, then drop
    tokens below min_p x the largest probability and renormalise (vLLM applies min_p before
    top-k/top-p instead; see docs/eval.md)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @classmethod
    def from_sampling(cls, s: SamplingConfig, greedy: bool) -> "Warp":
        return cls() if greedy else cls(s.temperature, s.top_k, s.top_p, s.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1.0:
            sorted_p, idx = probs.sort(-1, descending=True)
            cut = sorted_p.cumsum(-1) - sorted_p > self.top_p  # keep the smallest set reaching top_p
            sorted_p = sorted_p.masked_fill(cut, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
            probs = probs / probs.sum(-1, keepdim=True)
        if self.min_p > 0.0:  # the most likely token always survives, so renormalising is safe
            probs = probs.masked_fill(probs < self.min_p * probs.amax(-1, keepdim=True), 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def sample(self, probs: torch.Tensor, gen: torch.Generator | None) -> int:
        """A token from `probs`, drawn with `gen`, a generator on the probabilities' device."""
        if self.greedy:
            return int(probs.argmax(-1))
        return int(draw(probs, gen))


@dataclass
class Round:
    proposed: int
    accepted: int
    bonus: bool     # the round also committed the target's own token (not after an accepted stop)
    confidence: list[float] = field(default_factory=list)  # predicted prefix acceptance per verified slot

    @property
    def prefix_accepted(self) -> list[bool]:
        """Observed outcome for each slot in `confidence`: was the whole prefix up to it accepted."""
        return [i < self.accepted for i in range(len(self.confidence))]

    @property
    def acceptance_length(self) -> int:
        return self.accepted + int(self.bonus)


@dataclass
class Result:
    tokens: list[int]
    seconds: float
    rounds: list[Round] = field(default_factory=list)



@dataclass
class Proposal:
    tokens: list[int]
    q: torch.Tensor                         # [len(tokens), V]: each token's proposal distribution (same warp)
    confidence: list[float] | None = None   # predicted prefix acceptance per slot (a confidence head)


class BlockDrafter:
    """DSpark / DFlash: one block of γ slots (γ-1 drafts in the dflash layout) anchored at the
    current token, decoded in parallel (sequential only through the Markov head's previous token).
    Its context is the target's features of every committed token, kept in the draft's own KV cache."""

    def __init__(self, draft, device: torch.device | str = "cpu"):
        self.draft = draft.eval()
        self.device = torch.device(device)
        self.target_layers = list(draft.config.target_layers)
        self.cache = DynamicCache()

    def reset(self) -> None:
        self.cache = DynamicCache()

    @torch.no_grad()
    def propose(self, feats: torch.Tensor, positions: torch.Tensor, cur: int, cur_pos: int, warp: "Warp",
                gen: torch.Generator | None, tokens: list[int] | None = None) -> Proposal:
        d = self.draft
        ctx = d.context(feats.to(d.fc.weight.dtype))[None]
        h = d.drafts(d.block_states(torch.tensor([[cur]], device=self.device),
                                    torch.tensor([[cur_pos]], device=self.device),
                                    ctx, positions[None], mask=None, cache=self.cache)[0, 0])   # [num_drafts, H]
        base = d.lm_head(h).float()
        tokens, qs, conf, prev = [], [], [], cur
        for k in range(d.config.num_drafts):  # sequential only through the Markov head's previous token
            prev_t = torch.tensor([prev], device=self.device)
            bias = d.markov_bias(prev_t)
            q = warp.probs(base[k] + (bias[0].float() if bias is not None else 0.0))
            c = d.confidence(h[k:k + 1], prev_t)
            if c is not None:
                conf.append(float(torch.sigmoid(c[0])))
            tok = warp.sample(q, gen)
            tokens.append(tok)
            qs.append(q)
            prev = tok
        prefix = torch.tensor(conf, device="cpu").cumprod(0).tolist() if conf else None  # host floats
        return Proposal(tokens, torch.stack(qs), prefix)


class ChainDrafter:
    """EAGLE-3: the pair (token x_{p+1}, target feature g_p) of every committed position p runs once
    through the draft layer and its keys stay in the draft's cache; then the chain drafts one token per
    step from the last pair, each step reading the previous step's token and layer output (its keys
    live only for this round). The draft's logits cover its reduced vocabulary; proposals are placed in
    the target's (zero probability elsewhere), so rejection sampling stays exact."""

    def __init__(self, draft, device: torch.device | str = "cpu"):
        self.draft = draft.eval()
        self.device = torch.device(device)
        self.target_layers = list(draft.config.target_layers)
        self.draft_ids = draft.draft_ids().to(self.device)
        self.reset()

    def reset(self) -> None:
        self.past: tuple[torch.Tensor, torch.Tensor] | None = None  # committed pairs' (k, v)

    def _committed(self) -> list:
        return [] if self.past is None else [self.past]

    @torch.no_grad()
    def propose(self, feats: torch.Tensor, positions: torch.Tensor, cur: int, cur_pos: int, warp: "Warp",
                gen: torch.Generator | None, tokens: list[int] | None = None) -> Proposal:
        d = self.draft
        if tokens is None or len(tokens) != len(positions):
            raise ValueError("the chain drafter needs the committed tokens at the feature positions")
        pair = torch.tensor([[*tokens[1:], cur]], device=self.device)   # x_{p+1} for every new position p
        m = pair.shape[1]
        held = 0 if self.past is None else self.past[0].shape[2]
        mask = torch.cat([torch.ones(m, held, dtype=torch.bool, device=self.device),
                          torch.ones(m, m, dtype=torch.bool, device=self.device).tril()], dim=1)
        h, kv = d.step(pair, d.fc(feats.to(d.fc.weight.dtype))[None], (positions + 1)[None], mask, self._committed())
        self.past = kv if self.past is None else (torch.cat([self.past[0], kv[0]], 2), torch.cat([self.past[1], kv[1]], 2))
        h = h[:, -1:]
        chain: list = []                       # this round's chain keys (never committed)
        out_tokens, qs = [], []
        V = d.config.vocab_size
        for k in range(d.config.num_drafts):
            if k:
                h, kv = d.step(torch.tensor([[out_tokens[-1]]], device=self.device), h,
                               torch.tensor([[cur_pos + k]], device=self.device), None, [self.past, *chain])
                chain.append(kv)
            q = torch.zeros(V, device=self.device).index_put_((self.draft_ids,), warp.probs(d.logits(h[0, 0])))
            tok = warp.sample(q, gen)
            out_tokens.append(tok)
            qs.append(q)
        return Proposal(out_tokens, torch.stack(qs))


def drafter_for(draft, device: torch.device | str = "cpu"):
    """The drafter a draft model decodes with (a ready drafter passes through)."""
    if hasattr(draft, "propose"):
        return draft
    return ChainDrafter(draft, device) if draft.config.algorithm == "eagle3" else BlockDrafter(draft, device)


class SpecDecoder:
    """Verify/accept for any drafter; a draft model is wrapped in its drafter (`drafter_for`)."""

    def __init__(self, target, draft, stop_ids: set[int], device: torch.device | str = "cpu",
                 confidence_threshold: float = 0.0):
        if not 0.0 <= confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1], got {confidence_threshold}")
        self.confidence_threshold = confidence_threshold
        self.target = target.eval()
        self.cache_kw = cache_keyword(target)
        self.device = torch.device(device)
        self.drafter = drafter_for(draft, self.device)
        self.stop_ids = set(stop_ids)
        self.layers = list(self.drafter.target_layers)

    # ---- target -------------------------------------------------------------------------------
    @torch.no_grad()
    def _target(self, ids: list[int], cache: DynamicCache, capture: bool):
        x = torch.tensor([ids], device=self.device)
        held = cache.get_seq_length()
        kw = {self.cache_kw: cache, "use_cache": True}
        if not capture:
            logits, feats = self.target(input_ids=x, **kw).logits[0], None
        else:
            with capture_layers(self.target, self.layers) as store:
                logits = self.target(input_ids=x, **kw).logits[0]
            feats = torch.cat([store[i][0] for i in self.layers], dim=-1)
        if cache.get_seq_length() != held + len(ids):  # a forward that kept its own cache saw no context
            raise RuntimeError(f"the target's forward did not extend the KV cache passed as `{self.cache_kw}` "
                               f"({held} + {len(ids)} tokens, holds {cache.get_seq_length()}): this transformers "
                               f"version takes it under another name")
        return logits, feats

    # ---- plain decoding ------------------------------------------------------------------------
    def plain(self, prompt: list[int], max_new: int, warp: Warp, seed: int = 0) -> Result:
        with torch.no_grad(), decoding(self.device):
            return self._plain(prompt, max_new, warp, seed)

    def speculative(self, prompt: list[int], max_new: int, warp: Warp, seed: int = 0) -> Result:
        with torch.no_grad(), decoding(self.device):
            return self._speculative(prompt, max_new, warp, seed)

    def _plain(self, prompt: list[int], max_new: int, warp: Warp, seed: int) -> Result:
        gen = generator(self.device, seed)  # draws for the target's probabilities, on their device
        t0 = time.perf_counter()
        cache = DynamicCache()
        logits, _ = self._target(prompt, cache, capture=False)
        out: list[int] = []
        while True:
            tok = warp.sample(warp.probs(logits[-1]), gen)
            out.append(tok)
            if tok in self.stop_ids or len(out) >= max_new:
                break
            logits, _ = self._target([tok], cache, capture=False)
        return Result(out, time.perf_counter() - t0)

    def _speculative(self, prompt: list[int], max_new: int, warp: Warp, seed: int) -> Result:
        gen = generator(self.device, seed)  # draws for target and draft probabilities, on their device
        t0 = time.perf_counter()
        tcache = DynamicCache()
        self.drafter.reset()
        logits, feats = self._target(prompt, tcache, capture=True)
        cur = warp.sample(warp.probs(logits[-1]), gen)
        out = [cur]
        ctx_new, ctx_tok = feats, list(prompt)
        ctx_pos = torch.arange(len(prompt), device=self.device)
        result = Result(out, 0.0)
        while cur not in self.stop_ids and len(out) < max_new:
            cur_pos = len(prompt) + len(out) - 1
            prop = self.drafter.propose(ctx_new, ctx_pos, cur, cur_pos, warp, gen, ctx_tok)
            drafts, q, prefix = prop.tokens, prop.q, prop.confidence
            if prefix is not None and self.confidence_threshold > 0:
                drafts = drafts[:next((i for i, c in enumerate(prefix) if c < self.confidence_threshold), len(prefix))]
            drafts = drafts[:max_new - len(out)]  # never verify past the token budget
            logits, feats = self._target([cur, *drafts], tcache, capture=True)
            p = warp.probs(logits)                                                  # row j predicts token j+1
            accepted = 0
            for i, tok in enumerate(drafts):
                if warp.greedy:
                    ok = int(p[i].argmax()) == tok
                else:
                    ratio = (p[i, tok] / q[i, tok].clamp_min(1e-12)).clamp(max=1.0)
                    ok = bool(torch.rand((), generator=gen, device=ratio.device) < ratio)
                if not ok:
                    break
                accepted += 1
                if tok in self.stop_ids:
                    break
            kept = drafts[:accepted]
            if any(t in self.stop_ids for t in kept):
                nxt = None
            elif accepted < len(drafts):  # rejected: the target's correction
                if warp.greedy:
                    nxt = int(p[accepted].argmax())
                else:
                    residual = (p[accepted] - q[accepted]).clamp_min(0)
                    nxt = warp.sample(residual / residual.sum() if residual.sum() > 1e-12 else p[accepted], gen)
            else:  # every draft accepted: the bonus token
                nxt = warp.sample(p[len(drafts)], gen)
            out.extend(kept)
            committed = len(prompt) + len(out)          # cur and the accepted drafts now have features
            tcache.crop(committed - tcache.get_seq_length())  # negative: drop the rejected drafts' entries
            ctx_new, ctx_tok = feats[:accepted + 1], [cur, *kept]
            ctx_pos = torch.arange(cur_pos, cur_pos + accepted + 1, device=self.device)
            bonus = nxt is not None and len(out) < max_new
            # slots after an accepted stop token were never judged: no outcome to compare with
            judged = accepted if any(t in self.stop_ids for t in kept) else len(drafts)
            result.rounds.append(Round(len(drafts), accepted, bonus, (prefix or [])[:judged]))
            if not bonus:
                break
            out.append(nxt)
            cur = nxt
        result.tokens = out[:max_new]
        result.seconds = time.perf_counter() - t0
        return result
