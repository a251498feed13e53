"""The eval loop: multi-turn history, suites reported separately, the protocol in the metrics."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deepspec.config import EvalConfig, SamplingConfig, SuiteConfig
from deepspec.evaluate.run import compact_metrics, evaluate, plot_rows
from deepspec.evaluate.suites import load_suite
from tests.conftest import SAMPLE_CONVERSATIONS
from tests.evaluate.test_specdec import random_draft


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, trained_target):
    target = AutoModelForCausalLM.from_pretrained(trained_target)
    draft = random_draft(target, [0, 2])
    draft.config.target = json.loads((trained_target / "identity.json").read_text())
    out = tmp_path_factory.mktemp("draft") / "draft"
    draft.save(out)
    return out


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


TWO_TURNS = [{"id": "a", "turns": ["Hello there", "Tell me a joke"]},
             {"id": "b", "system": "Be brief.", "turns": ["What is 3 plus 4?", "What is 5 plus 6?"]}]


SAMPLING = SamplingConfig(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, trained_target, draft_dir):
    """One eval run over a one-turn and a two-turn suite (greedy and sampled)."""
    root = tmp_path_factory.mktemp("suites")
    one = write(root / "one.jsonl", [{"id": str(i), "task": "math", "turns": [c[0]["content"]]}
                                     for i, c in enumerate(SAMPLE_CONVERSATIONS[:3])])
    two = write(root / "two.jsonl", TWO_TURNS)
    suites = {s.name: load_suite(s, root / "none") for s in (SuiteConfig(str(one)), SuiteConfig(str(two)))}
    return evaluate(trained_target, draft_dir, suites, EvalConfig(max_new_tokens=12), SAMPLING)


def test_two_turns_equal_asking_the_target_turn_by_turn(trained_target, evaluated):
    rows = [r for r in evaluated[1] if r["suite"] == "two"]
    assert [(r["id"], r["turn"]) for r in rows] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]

    tok = AutoTokenizer.from_pretrained(trained_target)
    target = AutoModelForCausalLM.from_pretrained(trained_target).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for p in TWO_TURNS:
        messages = [{"role": "system", "content": p["system"]}] if "system" in p else []
        for t, user in enumerate(p["turns"]):
            messages.append({"role": "user", "content": user})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            with torch.no_grad():
                out = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                                      pad_token_id=tok.pad_token_id, top_k=None, top_p=None, temperature=None)
            new = out[0, ids.shape[1]:].tolist()
            answer = tok.decode([x for x in new if x != eos], skip_special_tokens=True)
            row = next(r for r in rows if r["id"] == p["id"] and r["turn"] == t)
            assert (row["prompt_tokens"], row["new_tokens"], row["answer"]) == (ids.shape[1], len(new), answer)
            assert row["greedy_match"]
            messages.append({"role": "assistant", "content": answer})
    # the second turn really carries the first question and answer
    first, second = rows[0], rows[1]
    alone = len(tok.apply_chat_template([{"role": "user", "content": "Tell me a joke"}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"])
    assert second["prompt_tokens"] > alone + first["prompt_tokens"] // 2


def test_suites_are_reported_separately_with_the_protocol(evaluated):
    report, rows = evaluated
    assert list(report["suites"]) == ["one", "two"]
    for name, turns in (("one", 3), ("two", 4)):
        m = report["suites"][name]
        mine = [r for r in rows if r["suite"] == name]
        assert (m["prompts"], m["turns"], len(mine)) == (turns if name == "one" else 2, turns, turns)
        assert m["greedy_match"] == 1.0 and all(r["greedy_match"] for r in mine)
        # pooled over every verify round of every turn, not a mean of per-turn τ
        assert m["tau"] == pytest.approx(sum(r["tau"] * r["rounds"] for r in mine) / sum(r["rounds"] for r in mine),
                                         abs=1e-3)
        assert m["greedy"]["rounds"] == sum(r["rounds"] for r in mine) and "tau_sample" in m
    metrics = compact_metrics(report)
    assert set(metrics) == {"one", "two", "protocol"}
    assert set(metrics["two"]) == {"tau", "tau_sample", "speedup", "greedy_match", "prompts", "turns"}
    proto = metrics["protocol"]
    assert (proto["temperature"], proto["top_p"], proto["top_k"], proto["min_p"]) == (0.7, 0.8, 20, 0.05)
    assert proto["filter_order"] == "temperature,top_k,top_p,min_p" and proto["block_size"] == 4
    assert proto["thinking"] is False and proto["max_new_tokens"] == 12 and proto["tau_counts_bonus"] is True
    assert len(proto["chat_template_sha256"]) == 16
    assert plot_rows(report) == [{"suite": s, "decoding": d, "tau": report["suites"][s]["tau" if d == "greedy" else "tau_sample"]}
                                 for s in ("one", "two") for d in ("greedy", "sampled")]


def test_every_kind_of_decode_runs_once_untimed_before_the_first_prompt(tmp_path, trained_target, draft_dir,
                                                                       monkeypatch):
    """The first decode in a process pays the device's start-up; none of the suite's timings may."""
    from deepspec.evaluate.specdec import SpecDecoder

    calls = []
    for kind in ("plain", "speculative"):
        real = getattr(SpecDecoder, kind)
        monkeypatch.setattr(SpecDecoder, kind, lambda self, prompt, max_new, warp, seed=0, real=real, kind=kind:
                            calls.append((kind, max_new, warp.greedy)) or real(self, prompt, max_new, warp, seed))
    one = write(tmp_path / "one.jsonl", [{"id": "0", "task": "math", "turns": ["What is 3 plus 4?"]}])
    evaluate(trained_target, draft_dir, {"one": load_suite(SuiteConfig(str(one)), tmp_path / "none")},
             EvalConfig(max_new_tokens=5), SAMPLING)
    assert calls == [("plain", 2, True), ("speculative", 2, True), ("speculative", 2, False),
                     ("plain", 5, True), ("speculative", 5, True), ("speculative", 5, False)]
