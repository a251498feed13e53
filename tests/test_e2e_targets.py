"""The pipeline on real targets from PyPI packages: SmolLM2-135M-Instruct (Llama architecture, 30
layers, a template that injects a default system prompt) and Gemma-3-270M (18 layers, 262 k
vocabulary, sliding-window attention, scaled embeddings, a template that renames the assistant role,
trims contents and folds the system prompt into the first user turn).

Each runs `dvc repro` once (module fixture) in a throwaway clone with the default params apart from
`target.source`, `layers` and the sizing keys in SIZE (how much runs, not how it runs), then checks
what a user of that model relies on: the cache holds the model's own hidden states, the loss covers
exactly the regenerated answers and their end of turn, speculative decoding is lossless, the export
loads in speculators' own code (or the report says why it is refused), and τ is reported.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import clone_project, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

# per target: the cached layers (its lowest, middle and highest cacheable ones) and its end-of-turn token
TARGETS = {
    "smollm2-135m": {"layers": [1, 14, 28], "end_of_turn": "<|im_end|>"},
    "gemma3-270m": {"layers": [1, 8, 16], "end_of_turn": "<end_of_turn>"},
}
# sizing only, so that each target runs in a few minutes on 2 cores (262 k-vocabulary steps are slow)
SIZE = {
    "regen": {"fraction": 0.004},
    "sampling": {"max_tokens": 32},
    "train": {"steps": 10, "batch_size": 2, "warmup_steps": 2},
    "eval": {"suites": [{"source": "heldout", "max_prompts": 3}], "max_new_tokens": 16},
}
TIMINGS: dict[str, float] = {}


@pytest.fixture(autouse=True)
def report_timings(request):
    yield
    request.node.user_properties.append(("e2e_timings", dict(TIMINGS)))


@pytest.fixture(scope="module", params=list(TARGETS))
def pipeline(request, tmp_path_factory):
    name = request.param
    repo = clone_project(tmp_path_factory.mktemp(name) / "repo")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["target"]["source"] = f"builtin:{name}"
    params["layers"] = TARGETS[name]["layers"]
    for section, values in SIZE.items():
        params[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    t0 = time.time()
    out = run(["dvc", "repro"], repo, timeout=3000).stdout
    TIMINGS[f"dvc repro {name}"] = time.time() - t0
    for stage in ("split", "target", "regen", "cache", "train", "eval", "export"):
        assert f"Running stage '{stage}'" in out
    metrics = json.loads((repo / "data/train/metrics.json").read_text())
    TIMINGS[f"train step s {name}"] = metrics["wall_s"] / params["train"]["steps"]
    TIMINGS[f"target stage s {name}"] = json.loads((repo / "data/target/metrics.json").read_text())["wall_time_s"]
    TIMINGS[f"cache stage s {name}"] = json.loads((repo / "data/cache/metrics.json").read_text())["wall_s"]
    draft = json.loads((repo / "data/draft/config.json").read_text())
    TIMINGS[f"mask token {name}"] = f"{draft['mask_token']} ({draft['mask_token_id']})"
    return name, repo


def load_target(repo: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = repo / "data/target"
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def cached_samples(repo: Path, layers: list[int]) -> list[dict]:
    from deepspec.loader.dataset import TargetCacheDataset

    manifest = json.loads((repo / "data/cache/manifest.json").read_text())
    ds = TargetCacheDataset(str(repo / "data/cache.zarr"), layers=layers, manifest=manifest)
    return [ds[i] for i in range(len(ds))]


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of 1s."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_cached_states_are_the_models_own_hidden_states(pipeline):
    name, repo = pipeline
    layers = TARGETS[name]["layers"]
    _, model = load_target(repo)
    samples = cached_samples(repo, layers)
    assert samples
    worst, exact, total, abs_diff = 0.0, 0, 0, 0.0
    for s in samples:
        with torch.no_grad():
            hs = model(input_ids=s["input_ids"][None].long(), output_hidden_states=True).hidden_states
        # layer i = hidden_states[i + 1]; the last = hidden_states[-1], after the final norm
        for got, want in [*((s["hidden"][k], hs[i + 1][0]) for k, i in enumerate(layers)),
                          (s["last_hidden"], hs[-1][0])]:
            got = got.float()
            exact += int((got == want.bfloat16().float()).sum())
            total += got.numel()
            # bf16 rounding (one step at most: the cache's batched forward may land a value on the other
            # side of a rounding boundary) plus float32 noise of a batched, padded forward, relative to
            # the token's scale
            rms = want.pow(2).mean(-1, keepdim=True).sqrt()
            worst = max(worst, ((got - want).abs() - 2 ** -7 * want.abs()).div(rms).max().item())
            abs_diff = max(abs_diff, (got - want).abs().max().item())
    TIMINGS[f"states equal to bf16 of the model's {name}"] = exact / total
    TIMINGS[f"states max abs diff {name}"] = abs_diff
    assert worst <= 1e-4 and exact / total > 0.99, (worst, exact / total)


def test_every_masked_run_is_a_regenerated_answer_and_its_end_of_turn(pipeline):
    name, repo = pipeline
    tok, _ = load_target(repo)
    eot = TARGETS[name]["end_of_turn"]
    rows = {r["id"]: r for r in map(json.loads, (repo / "data/regen/train.jsonl").read_text().splitlines())}
    samples = cached_samples(repo, [])
    assert len(samples) == len(rows) > 0
    ended = 0
    for s in samples:
        row = rows[f"{s['sample_id']:016x}"]
        answers = [t["content"].strip() for t in row["conversations"] if t["role"] == "assistant"]
        finish = row.get("finish_reasons") or ["stop"] * len(answers)
        ids, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
        got = [tok.decode(ids[a:b]) for a, b in runs(mask)]
        want = [a + ("" if f == "length" else eot) for a, f in zip(answers, finish)]
        assert got == want[:len(got)] and len(got) == len(want), (row["id"], got, want)
        ended += sum(f != "length" for f in finish)
    TIMINGS[f"answers ended by the model {name}"] = ended
    TIMINGS[f"masked runs checked {name}"] = sum(len(runs(s["loss_mask"].tolist())) for s in samples)


def test_greedy_speculative_decoding_equals_plain_and_tau_is_reported(pipeline):
    name, repo = pipeline
    rows = [json.loads(line) for line in (repo / "data/eval/prompts.jsonl").read_text().splitlines()]
    assert len(rows) >= 3 and all(r["greedy_match"] for r in rows), [r for r in rows if not r["greedy_match"]][:2]
    metrics = json.loads((repo / "data/eval/metrics.json").read_text())
    tau = metrics["heldout"]["tau"]
    TIMINGS[f"tau {name}"] = tau
    assert tau >= 1.0


def test_the_speculators_export_runs_in_speculators_own_code_or_is_refused_with_the_reason(pipeline, monkeypatch):
    name, repo = pipeline
    report = json.loads((repo / "data/export/report.json").read_text())
    spec = report["formats"]["speculators"]
    from deepspec.models.draft import DraftModel

    draft = DraftModel.load(repo / "data/draft").eval()
    if draft.config.embed_scale != 1.0:  # Gemma: speculators' drafts embed with the verifier's unscaled rows
        assert spec["status"] == "refused" and "scales its input embeddings" in spec["reason"], spec
        return
    assert spec["status"] == "exported", spec
    from tests.export.test_export import ANCHORS, deepspec_logits, speculators_logits

    monkeypatch.chdir(repo)  # the export names its verifier as the project names it: data/target
    tok, target = load_target(repo)
    ids = cached_samples(repo, [])[0]["input_ids"][None].long()
    assert ids.shape[1] > max(ANCHORS) + draft.config.block_size
    assert report["dtype"] == "bfloat16"  # the export's weights are ours rounded to bf16: compare those
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.copy_(p.to(torch.bfloat16).float())
    ours, _ = deepspec_logits(draft, target, ids[:, :max(ANCHORS) + draft.config.block_size + 1])
    theirs, _ = speculators_logits(repo / "data/export/speculators", target,
                                   ids[:, :max(ANCHORS) + draft.config.block_size + 1], monkeypatch)
    diff = (ours - theirs).abs().max().item()
    TIMINGS[f"speculators max logit diff {name}"] = diff
    assert ours.abs().max() > 0.5 and theirs.shape == ours.shape
    assert diff < 1e-4 * max(1.0, ours.abs().max().item())  # float32 on both sides, summation order aside
