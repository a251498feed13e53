"""Speculative decoding: lossless greedy, distribution-preserving sampling, metrics that can fail."""
import collections

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from deepspec.data.template import encode_prompt
from deepspec.evaluate.run import auroc, confidence_metrics, round_metrics
from deepspec.config import SamplingConfig
from deepspec.evaluate.specdec import BlockDrafter, Result, Round, SpecDecoder, Warp
from deepspec.models.draft import DraftConfig, DraftModel
from tests.conftest import SAMPLE_CONVERSATIONS


@pytest.fixture(autouse=True)
def one_thread():
    """These models are a few KB: a second intra-op thread only adds synchronisation, and on a busy
    machine (CI neighbours, parallel jobs) a spinning thread pool made the statistical tests ~25x
    slower (50 ms vs 1.3 s per decode measured)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def random_draft(target, layers, block=4, seed=0, markov=16) -> DraftModel:
    torch.manual_seed(seed)
    cfg = DraftConfig.for_target("dspark", target.config, layers, block, 1, markov, {})
    draft = DraftModel(cfg)
    draft.copy_target_embeddings(target)
    with torch.no_grad():  # make the random draft opinionated (a nonzero Markov bias too)
        draft.markov_out.weight.normal_(std=0.5)
    return draft.eval()


def prompts_of(tok, n=12):
    return [encode_prompt(tok, conv[:1]) for conv in SAMPLE_CONVERSATIONS[::7][:n]]


def test_greedy_speculative_equals_plain_greedy(trained_target):
    tok = AutoTokenizer.from_pretrained(trained_target)
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    for block in (2, 5):
        dec = SpecDecoder(target, random_draft(target, [0, 2], block), {tok.eos_token_id})
        for ids in prompts_of(tok):
            plain = dec.plain(ids, 30, Warp())
            spec = dec.speculative(ids, 30, Warp())
            assert spec.tokens == plain.tokens
            assert sum(r.acceptance_length for r in spec.rounds) + 1 == len(spec.tokens)


class OlderForward(torch.nn.Module):
    """A causal LM whose forward takes its KV cache as `past_key_values`, as transformers 5.20 to 5.2x
    spell it; like those forwards it files keywords it does not know among unused **kwargs."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.model = lm, lm.model

    def get_decoder(self):
        return self.lm.get_decoder()

    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
        return self.lm(input_ids=input_ids, cache=past_key_values, use_cache=use_cache)


class OwnCacheForward(OlderForward):
    """A forward that keeps a cache of its own whatever it is passed."""

    def forward(self, input_ids=None, use_cache=None, **kwargs):
        return self.lm(input_ids=input_ids, use_cache=use_cache)


def test_decoding_passes_the_cache_under_the_name_the_targets_forward_takes(trained_target):
    tok = AutoTokenizer.from_pretrained(trained_target)
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    draft = random_draft(target, [0, 2], 3)
    want = [SpecDecoder(target, draft, {tok.eos_token_id}).plain(ids, 16, Warp()).tokens for ids in prompts_of(tok, 3)]
    dec = SpecDecoder(OlderForward(target), draft, {tok.eos_token_id})
    assert dec.cache_kw == "past_key_values"
    for ids, tokens in zip(prompts_of(tok, 3), want):
        assert dec.plain(ids, 16, Warp()).tokens == tokens
        assert dec.speculative(ids, 16, Warp()).tokens == tokens
    # a forward that never fills the cache it is given fails at the prompt, naming the keyword
    lost = SpecDecoder(OwnCacheForward(target), draft, {tok.eos_token_id})
    for decode in (lost.plain, lost.speculative):
        with pytest.raises(RuntimeError, match="did not extend the KV cache passed as `past_key_values`"):
            decode(prompts_of(tok, 1)[0], 16, Warp())


def test_a_dflash_layout_draft_proposes_block_minus_one_and_stays_lossless(trained_target):
    """sample_from_anchor false: slot 0's output is unused, so a block of 4 proposes 3 drafts."""
    tok = AutoTokenizer.from_pretrained(trained_target)
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    torch.manual_seed(0)
    cfg = DraftConfig.for_target("dflash", target.config, [0, 2], 4, 1, 0, {}, mask_token_id=tok.mask_token_id,
                                 mask_token=tok.mask_token, sample_from_anchor=False)
    draft = DraftModel(cfg)
    draft.copy_target_embeddings(target)
    dec = SpecDecoder(target, draft.eval(), {tok.eos_token_id})
    for ids in prompts_of(tok, 4):
        spec = dec.speculative(ids, 20, Warp())
        assert spec.tokens == dec.plain(ids, 20, Warp()).tokens
        assert max(r.proposed for r in spec.rounds) == 3


def test_a_random_draft_gives_tau_near_one(trained_target):
    tok = AutoTokenizer.from_pretrained(trained_target)
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    dec = SpecDecoder(target, random_draft(target, [0, 2], 4, seed=3), {tok.eos_token_id})
    results = [dec.speculative(ids, 30, Warp()) for ids in prompts_of(tok)]
    assert round_metrics(results, 4)["tau"] < 1.3


def test_confidence_threshold_cuts_blocks_without_changing_the_output(trained_target):
    tok = AutoTokenizer.from_pretrained(trained_target)
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    draft = random_draft(target, [0, 2], 5)
    full = SpecDecoder(target, draft, {tok.eos_token_id})
    for ids in prompts_of(tok, 6):
        plain = full.plain(ids, 24, Warp())
        ref = full.speculative(ids, 24, Warp())
        assert all(len(r.confidence) == r.proposed for r in ref.rounds[:-1])  # uncut: every verified slot
        assert all(a >= b for r in ref.rounds for a, b in zip(r.confidence, r.confidence[1:]))  # a running product
        for threshold in (0.3, 1.0):
            spec = SpecDecoder(target, draft, {tok.eos_token_id}, confidence_threshold=threshold).speculative(ids, 24, Warp())
            assert spec.tokens == plain.tokens
            assert all(c >= threshold for r in spec.rounds for c in r.confidence)
            if threshold == 1.0:  # no slot is ever certain: every round is a plain target step
                assert all(r.proposed == 0 and r.acceptance_length <= 1 for r in spec.rounds)
    with pytest.raises(ValueError, match="confidence_threshold"):
        SpecDecoder(target, draft, {tok.eos_token_id}, confidence_threshold=1.5)


def test_confidence_calibration_metrics():
    res = Result(tokens=[1] * 6, seconds=1.0, rounds=[
        Round(proposed=3, accepted=1, bonus=True, confidence=[0.9, 0.6, 0.3]),
        Round(proposed=2, accepted=2, bonus=True, confidence=[0.8, 0.5])])
    assert res.rounds[0].prefix_accepted == [True, False, False]
    c = round_metrics([res], 3)["confidence"]
    assert c["slots"] == 5 and c["observed"] == pytest.approx(3 / 5) and c["pred_mean"] == pytest.approx(0.62)
    assert c["auc"] == pytest.approx(5 / 6, abs=1e-4)   # only the 0.6 negative outranks a positive (0.5)
    assert c["brier"] == pytest.approx((0.01 + 0.36 + 0.09 + 0.04 + 0.25) / 5, abs=1e-4)
    assert auroc(np.array([0.5, 0.5]), np.array([1, 0])) == 0.5 and auroc(np.array([0.2]), np.array([1])) is None
    perfect = confidence_metrics(np.array([0.0, 1.0, 1.0]), np.array([0, 1, 1]))
    assert perfect["ece"] == 0 and perfect["brier"] == 0 and perfect["auc"] == 1.0
    assert "confidence" not in round_metrics([Result([1], 1.0, [Round(2, 1, True)])], 2)  # DFlash: no head


def test_round_metrics_follow_the_reference_definitions():
    res = Result(tokens=list(range(12)), seconds=1.0, rounds=[
        Round(proposed=4, accepted=4, bonus=True), Round(proposed=4, accepted=1, bonus=True),
        Round(proposed=4, accepted=0, bonus=True), Round(proposed=2, accepted=2, bonus=False)])
    m = round_metrics([res], 4)
    assert m["tau"] == pytest.approx((5 + 2 + 1 + 2) / 4)
    assert m["accept_rate@0"] == pytest.approx(3 / 4)      # rounds with >0 accepted / rounds proposing >0
    assert m["accept_rate@1"] == pytest.approx(2 / 4)
    assert m["accept_rate@2"] == pytest.approx(1 / 3, abs=1e-4)  # the last round proposed only two tokens
    assert m["mean_proposal"] == pytest.approx(3.5)


def tiny_lm(vocab=8, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3)  # token-dependent next-token laws, top token ~0.4-0.5
    return model


def chi_square_pvalue(counts: dict, expected: dict) -> float:
    """Pearson's chi-square over cells merged until every expected count is >= 5."""
    cells = sorted(expected, key=lambda c: expected[c])
    obs, exp, stat, df = 0.0, 0.0, 0.0, -1
    for c in cells:
        obs += counts.get(c, 0)
        exp += expected[c]
        if exp >= 5:
            stat += (obs - exp) ** 2 / exp
            df += 1
            obs, exp = 0.0, 0.0
    if exp > 0:
        stat += (obs - exp) ** 2 / max(exp, 1e-9)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("warp", [Warp(temperature=1.0), Warp(temperature=0.8, top_k=5, top_p=0.9),
                                  Warp(temperature=1.0, top_k=7, top_p=0.97, min_p=0.13)])  # min_p cuts tokens top-k/top-p keep
def test_speculative_sampling_preserves_the_target_distribution(warp):
    """The joint law of the first three generated tokens, speculative vs the target's own (exact)."""
    target = tiny_lm()
    draft = random_draft(target, [0, 1], block=3, seed=1, markov=4)
    dec = SpecDecoder(target, draft, stop_ids=set())
    prompt = [1, 2, 3]
    n = 3000
    counts = collections.Counter(tuple(dec.speculative(prompt, 3, warp, seed=s).tokens) for s in range(n))
    # exact probabilities of every 3-token continuation under the warped target
    expected = {}
    with torch.no_grad():
        p1 = warp.probs(target(torch.tensor([prompt])).logits[0, -1])
        for a in range(8):
            if p1[a] == 0:
                continue
            p2 = warp.probs(target(torch.tensor([prompt + [a]])).logits[0, -1])
            for b in range(8):
                if p2[b] == 0:
                    continue
                p3 = warp.probs(target(torch.tensor([prompt + [a, b]])).logits[0, -1])
                for c in range(8):
                    if p3[c] > 0:
                        expected[(a, b, c)] = float(p1[a] * p2[b] * p3[c]) * n
    assert set(counts) <= set(expected)  # nothing the warped target could not produce
    assert chi_square_pvalue(counts, expected) > 1e-3
    # and the test has teeth: plain sampling from the *draft's* first-slot law is far from it
    rounds = [dec.speculative(prompt, 3, warp, seed=s).rounds for s in range(200)]
    assert any(r and r[0].accepted < r[0].proposed for r in rounds)


@pytest.mark.parametrize("warp", [Warp(0.8, 5, 0.9), Warp(0.7, 20, 0.8, 0.05), Warp(1.3, 0, 0.95, 0.1),
                                  Warp(0.6, 3, 1.0, 0.3), Warp(1.0, 0, 1.0, 0.2), Warp(0.5, 8, 0.7, 0.02)])
def test_warp_is_transformers_filter_chain(warp):
    """temperature -> top-k -> top-p -> min-p, exactly as transformers' generate (and sglang) apply them."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    chain = LogitsProcessorList([TemperatureLogitsWarper(warp.temperature)]
                                + ([TopKLogitsWarper(warp.top_k)] if warp.top_k else [])
                                + ([TopPLogitsWarper(warp.top_p)] if warp.top_p < 1 else [])
                                + ([MinPLogitsWarper(warp.min_p)] if warp.min_p else []))
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(warp.probs(logits), chain(None, logits.clone()).softmax(-1), atol=1e-6, rtol=1e-5)


def test_min_p_comes_after_top_p():
    """The order matters: min-p first (vLLM) would let top-p keep two tokens here, not three."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    probs = Warp(temperature=1.0, top_p=0.8, min_p=0.25).probs(p.log())
    assert (probs > 0).tolist() == [True, True, True, False, False]
    torch.testing.assert_close(probs[:3], p[:3] / p[:3].sum())
    assert Warp.from_sampling(SamplingConfig(min_p=0.25), greedy=False).min_p == 0.25


def test_the_draft_proposes_under_the_same_filters():
    class Recording(BlockDrafter):
        def propose(self, *args):
            prop = super().propose(*args)
            self.seen.append(prop)
            return prop

    target = tiny_lm(vocab=32)
    drafter = Recording(random_draft(target, [0, 1], block=3, seed=2, markov=4))
    drafter.seen = []
    warp = Warp(temperature=1.5, top_k=12, top_p=0.97, min_p=0.3)
    for s in range(5):
        SpecDecoder(target, drafter, set()).speculative([1, 2, 3], 12, warp, seed=s)
    q = torch.cat([p.q for p in drafter.seen])
    assert len(q) >= 10 and torch.allclose(q.sum(-1), torch.ones(len(q)))
    kept = q > 0
    assert (q.masked_fill(~kept, 1.0) >= 0.3 * q.amax(-1, keepdim=True) - 1e-6).all()  # min-p held on the draft
    assert kept.sum(-1).max() <= 12 and (kept.sum(-1) < 12).any()
    assert all(p.q[i, t] > 0 for p in drafter.seen for i, t in enumerate(p.tokens))


# ---- EAGLE-3: the chain drafter --------------------------------------------------------------------------

def random_eagle3(target, layers, steps=3, draft_vocab=None, seed=0):
    """A random EAGLE-3 draft whose reduced vocabulary leaves tokens out (the d2t map is exercised)."""
    from deepspec.models.eagle3 import Eagle3Model, vocab_map

    torch.manual_seed(seed)
    V = target.config.vocab_size
    Vd = draft_vocab or V // 2
    cfg = DraftConfig.for_target("eagle3", target.config, layers, 4, 1, 0, {}, ttt_steps=steps, draft_vocab_size=Vd)
    draft = Eagle3Model(cfg)
    draft.set_vocab(*vocab_map({t: V - t for t in range(1, V, 2)}, Vd, V))   # odd ids first: not a prefix of the vocab
    draft.copy_target_embeddings(target)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if p.requires_grad:
                p.normal_(mean=1.0 if "norm" in n else 0.0, std=0.3 if "norm" not in n else 0.1)
    return draft.eval()


def test_eagle3_greedy_speculative_equals_plain_greedy(trained_target):
    tok = AutoTokenizer.from_pretrained(trained_target)
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    for steps in (1, 4):
        dec = SpecDecoder(target, random_eagle3(target, [-1, 0, 2], steps), {tok.eos_token_id})
        for ids in prompts_of(tok, 6):
            spec = dec.speculative(ids, 30, Warp())
            assert spec.tokens == dec.plain(ids, 30, Warp()).tokens
            assert max(r.proposed for r in spec.rounds) == steps


def test_a_random_eagle3_draft_gives_tau_near_one(trained_target):
    tok = AutoTokenizer.from_pretrained(trained_target)
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    dec = SpecDecoder(target, random_eagle3(target, [-1, 0, 2], 4, seed=3), {tok.eos_token_id})
    results = [dec.speculative(ids, 30, Warp()) for ids in prompts_of(tok)]
    assert round_metrics(results, 4)["tau"] < 1.3


def test_the_chain_drafter_computes_what_training_unrolls(trained_target):
    """Decoding's chain (committed pairs cached, chain keys per round) equals the training-time test's
    unrolled forward on the same tokens: draft k of row t, fed the data's tokens, gives the same logits."""
    from deepspec.evaluate.specdec import ChainDrafter
    from deepspec.models.capture import capture_layers

    tok = AutoTokenizer.from_pretrained(trained_target)
    target = AutoModelForCausalLM.from_pretrained(trained_target).eval()
    draft = random_eagle3(target, [-1, 0, 2], 3, draft_vocab=target.config.vocab_size)  # full vocab: q is exact
    ids = torch.tensor([encode_prompt(tok, SAMPLE_CONVERSATIONS[-1][:3])])
    T = ids.shape[1]
    with torch.no_grad(), capture_layers(target, [-1, 0, 2]) as store:
        target(input_ids=ids)
    feats = torch.cat([store[i] for i in (-1, 0, 2)], dim=-1)[0]
    n = T - 1
    with torch.no_grad():  # the training path: every row at once, steps unrolled with the data's tokens
        h, past, want = draft.fc(feats[None, :n]), [], []
        causal, diag = torch.ones(n, n, dtype=torch.bool).tril(), torch.eye(n, dtype=torch.bool)
        for k in range(3):
            h, kv = draft.step(torch.nn.functional.pad(ids[:, 1 + k:], (0, k)), h, torch.arange(1, T)[None] + k,
                               torch.cat([causal] + [diag] * k, dim=1), past)
            past.append(kv)
            want.append(draft.logits(h[0]).softmax(-1))

    class Teacher(Warp):  # a plain softmax, and the data's next token as the "sample"
        def sample(self, probs, gen):
            return self.next.pop(0)

    for t0 in (4, 8, T - 7):   # a first round commits the pairs before c1, a second the pairs c1 .. t0
        drafter, warp, c1 = ChainDrafter(draft), Teacher(temperature=1.0), t0 - 3
        warp.next = ids[0, c1 + 1:c1 + 4].tolist()
        drafter.propose(feats[:c1], torch.arange(c1), ids[0, c1].item(), c1, warp, None, ids[0, :c1].tolist())
        warp.next = ids[0, t0 + 2:t0 + 5].tolist()
        prop = drafter.propose(feats[c1:t0 + 1], torch.arange(c1, t0 + 1), ids[0, t0 + 1].item(), t0 + 1, warp,
                               None, ids[0, c1:t0 + 1].tolist())
        for k in range(3):   # row t0 = the last committed feature's position; step k drafts token t0+2+k
            torch.testing.assert_close(prop.q[k], want[k][t0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("warp", [Warp(temperature=1.0), Warp(temperature=0.8, top_k=5, top_p=0.9)])
def test_eagle3_sampling_preserves_the_target_distribution_with_a_reduced_vocabulary(warp):
    """Tokens outside the draft vocabulary come only from the target's residual: still its exact law."""
    target = tiny_lm()
    draft = random_eagle3(target, [-1, 0, 1], 3, draft_vocab=5, seed=1)
    dec = SpecDecoder(target, draft, stop_ids=set())
    prompt, n = [1, 2, 3], 3000
    counts = collections.Counter(tuple(dec.speculative(prompt, 3, warp, seed=s).tokens) for s in range(n))
    expected = {}
    with torch.no_grad():
        p1 = warp.probs(target(torch.tensor([prompt])).logits[0, -1])
        for a in (a for a in range(8) if p1[a] > 0):
            p2 = warp.probs(target(torch.tensor([prompt + [a]])).logits[0, -1])
            for b in (b for b in range(8) if p2[b] > 0):
                p3 = warp.probs(target(torch.tensor([prompt + [a, b]])).logits[0, -1])
                for c in (c for c in range(8) if p3[c] > 0):
                    expected[(a, b, c)] = float(p1[a] * p2[b] * p3[c]) * n
    assert set(counts) <= set(expected)
    assert chi_square_pvalue(counts, expected) > 1e-3
    outside = set(range(8)) - set(draft.draft_ids().tolist())
    assert any(t in outside for seq in counts for t in seq)   # the residual did produce out-of-vocabulary tokens
