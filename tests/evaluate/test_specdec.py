"""Speculative decoding: lossless greedy, distribution-preserving sampling, metrics that can fail."""
import collections
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from deepspec.config import EvalConfig, SamplingConfig
from deepspec.data.template import encode_prompt
from deepspec.evaluate.run import PromptError, auroc, confidence_metrics, evaluate, load_prompts, round_metrics
from deepspec.evaluate.specdec import Result, Round, SpecDecoder, Warp
from deepspec.models.draft import DraftConfig, DraftModel
from tests.conftest import SAMPLE_CONVERSATIONS


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


@pytest.mark.parametrize("warp", [Warp(temperature=1.0), Warp(temperature=0.8, top_k=5, top_p=0.9)])
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


def test_prompts_file_errors_name_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": ["hi"]}\n{"turns": []}\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2: field 'turns'"):
        load_prompts(f, 10)
    f.write_text('{"turns": ["a"], "task": "x"}\n{"turns": ["b"], "task": "y"}\n{"turns": ["c"], "task": "x"}\n')
    assert [p["prompt"] for p in load_prompts(f, 10)] == ["a", "b", "c"]
    assert [p["task"] for p in load_prompts(f, 2)] == ["x", "y"]  # a prefix covers every task
    f.write_text('{"turns": ["Hi  there"], "id": "1"}\n{"turns": ["hi there", "more"], "id": "2"}\n'
                 '{"turns": ["hi there"], "system": "Be brief.", "id": "3"}\n')
    assert [p["id"] for p in load_prompts(f, 10)] == ["1", "3"]  # a repeated prompt counts once


def test_evaluate_writes_reference_metrics(tmp_path, trained_target):
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    draft = random_draft(target, [0, 2])
    draft.config.target = json.loads((trained_target / "identity.json").read_text())
    draft.save(tmp_path / "draft")
    f = tmp_path / "eval.jsonl"
    f.write_text("".join(json.dumps({"id": str(i), "task": "math", "turns": [c[0]["content"]]}) + "\n"
                         for i, c in enumerate(SAMPLE_CONVERSATIONS[:5])))
    metrics, rows = evaluate(trained_target, tmp_path / "draft", load_prompts(f, 5),
                             EvalConfig(max_new_tokens=12), SamplingConfig(temperature=0.7))
    assert metrics["greedy"]["greedy_match"] == 1.0 and len(rows) == 5
    assert set(metrics["per_task"]) == {"math"} and "tau_sample" in metrics
    assert metrics["greedy"]["plain_tokens_per_s"] > 0 and metrics["speedup"] > 0
