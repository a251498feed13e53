"""Export: each supported (algorithm, format) pair loads with the engine library's own classes and
gives deepspec's logits on the same tokens; the library reads its target features from the target's
`output_hidden_states` through its own layer-id convention, so a wrong id shift fails."""
import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from deepspec.cli import main as cli
from deepspec.config import TrainConfig
from deepspec.evaluate.run import round_metrics
from deepspec.evaluate.specdec import SpecDecoder, Warp
from deepspec.export import ExportError, export_draft, layer_ids, verifier_reference
from deepspec.models.capture import capture_layers
from deepspec.models.draft import DraftConfig, DraftModel
from deepspec.models.objectives import Anchors, block_mask
from deepspec.train.run import run_training
from tests.conftest import REPO, SAMPLE_CONVERSATIONS, make_model_dir, project_env

TOL = 1e-4          # float32 on both sides: the same arithmetic up to summation order
ANCHORS = [2, 7, 11, 16]


@pytest.fixture(scope="module")
def target(trained_target):
    return AutoModelForCausalLM.from_pretrained(trained_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokens(trained_target):
    tok = AutoTokenizer.from_pretrained(trained_target)
    conv = SAMPLE_CONVERSATIONS[-1]
    ids = tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
    return torch.tensor([ids[:24]])


def opinionated_draft(target, tmp_path, algorithm, sample_from_anchor, layers, mask_token_id=3, name="draft",
                      identity=None):
    """A draft with random weights large enough that any misplaced tensor or id moves the logits."""
    torch.manual_seed(7)
    cfg = DraftConfig.for_target(algorithm, target.config, layers, 4, 1, 8, identity or {}, mask_token_id=mask_token_id,
                                 mask_token="<|MASK|>", sample_from_anchor=sample_from_anchor)
    draft = DraftModel(cfg)
    draft.copy_target_embeddings(target)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if p.requires_grad:
                p.normal_(mean=1.0 if "norm" in n else 0.0, std=0.3)
    draft.save(tmp_path / name)
    return draft.eval()


def deepspec_logits(draft, target, ids):
    """deepspec's own path: its forward hooks on the target, its block mask, its slot convention."""
    cfg = draft.config
    T = ids.shape[1]
    pos = torch.tensor(ANCHORS)
    with torch.no_grad(), capture_layers(target, cfg.target_layers) as store:
        target(input_ids=ids)
    hidden = torch.cat([store[i] for i in cfg.target_layers], dim=-1)
    mask = block_mask(Anchors(pos[None], torch.ones(1, len(pos), dtype=torch.bool)), torch.tensor([T]), T,
                      cfg.block_size)
    with torch.no_grad():
        h = draft.drafts(draft.block_states(ids[:, pos], pos[None], draft.context(hidden),
                                            torch.arange(T)[None], mask))[0]          # [N, D, H]
        prev = ids[0, pos[:, None] + torch.arange(cfg.num_drafts)]                   # draft j follows token a+j
        return draft.logits(h, prev), draft.confidence(h, prev)


def speculators_logits(export_dir, target, ids, monkeypatch):
    """speculators' own model class and forward, driven with SDPA and fixed anchors; its logits (and
    DSpark's confidence) are taken where its forward hands them to its loss."""
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = SpeculatorModel.from_pretrained(export_dir, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in model.config.aux_hidden_state_layer_ids], dim=-1)
    n, g = len(ANCHORS), config.block_size
    seen = {}

    def capture(*args, **kwargs):
        seen["args"] = args
        return torch.zeros(()), {}

    monkeypatch.setattr(dflash_core, "select_anchors",
                        lambda loss_mask, num, block: (torch.tensor(ANCHORS), torch.ones(num, dtype=torch.bool)))
    dspark = config.speculators_model_type == "dspark"
    monkeypatch.setattr(dspark_core if dspark else dflash_core, "compute_metrics", capture)
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, loss_mask=torch.ones_like(ids),
              verifier_last_hidden_states=out.hidden_states[-1], document_ids=torch.zeros_like(ids), max_anchors=n)
    first = 0 if config.sample_from_anchor else 1                  # slot 0's output is no draft in the dflash layout
    logits = seen["args"][0].view(n, g, -1)[:, first:]
    conf = seen["args"][2].view(n, g)[:, first:] if dspark else None
    return logits, conf


def dflash_logits(export_dir, target, ids):
    """The dflash package's DFlashDraftModel: context = its extract_context_feature of the target's hidden
    states before the anchor, block = [anchor, mask, ...] through the target's embedding, logits through
    the target's head (what dflash_generate does each round)."""
    from dflash.model import DFlashDraftModel, extract_context_feature

    model = DFlashDraftModel.from_pretrained(export_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        for a in ANCHORS:
            ctx = extract_context_feature([h[:, :a] for h in out.hidden_states], model.target_layer_ids)
            block = torch.full((1, model.block_size), model.mask_token_id)
            block[0, 0] = ids[0, a]
            h = model(target_hidden=ctx, noise_embedding=target.get_input_embeddings()(block),
                      position_ids=torch.arange(a + model.block_size)[None])
            rows.append(model.compute_logits(h[:, 1:], target.get_output_embeddings())[0])
    return torch.stack(rows)


def export(tmp_path, trained_target, formats, draft="draft", out="export", dtype="float32"):
    return export_draft(tmp_path / draft, tmp_path / out, formats, trained_target, str(trained_target), dtype)


# ---- layer ids --------------------------------------------------------------------------------------

def test_layer_id_conversions_are_pinned():
    assert layer_ids.to_speculators([-1, 0, 9, 33]) == [0, 1, 10, 34]        # a layer's input: id + 1
    assert layer_ids.from_speculators([0, 1, 10, 34]) == [-1, 0, 9, 33]
    assert layer_ids.to_dflash([0, 9, 33]) == [0, 9, 33]                     # layer outputs, like deepspec
    with pytest.raises(layer_ids.NoSuchLayerId, match="-1"):
        layer_ids.to_dflash([-1, 9])


def test_each_engine_reads_the_hidden_state_deepspec_cached(target, tokens):
    """The conventions above against the libraries' own readers and deepspec's hooks, on a real target."""
    from dflash.model import extract_context_feature

    with torch.no_grad(), capture_layers(target, [-1, 0, 2]) as store:
        out = target(input_ids=tokens, output_hidden_states=True)
    for i in (-1, 0, 2):
        assert torch.equal(out.hidden_states[layer_ids.to_speculators([i])[0]], store[i])  # speculators: hidden_states[id]
    for i in (0, 2):
        assert torch.equal(extract_context_feature(out.hidden_states, layer_ids.to_dflash([i])), store[i])


# ---- logits: every supported (algorithm, format) pair --------------------------------------------------

@pytest.mark.parametrize("algorithm,sample_from_anchor", [("dspark", True), ("dspark", False), ("dflash", False),
                                                          ("dflash", True)])
def test_speculators_export_gives_the_drafts_logits(tmp_path, trained_target, target, tokens, monkeypatch,
                                                    algorithm, sample_from_anchor):
    draft = opinionated_draft(target, tmp_path, algorithm, sample_from_anchor, [-1, 0, 2])
    report = export(tmp_path, trained_target, ["speculators"])
    assert report["formats"]["speculators"]["status"] == "exported"
    ours, our_conf = deepspec_logits(draft, target, tokens)
    theirs, their_conf = speculators_logits(tmp_path / "export" / "speculators", target, tokens, monkeypatch)
    assert theirs.shape == ours.shape == (len(ANCHORS), draft.config.num_drafts, draft.config.vocab_size)
    diff = (ours - theirs).abs().max().item()
    print(f"speculators {algorithm} sample_from_anchor={sample_from_anchor}: max |logit diff| {diff:.2e}")
    assert diff < TOL and ours.abs().max() > 0.5
    if algorithm == "dspark":
        assert (our_conf - their_conf).abs().max() < TOL


def test_dflash_export_gives_the_drafts_logits(tmp_path, trained_target, target, tokens):
    draft = opinionated_draft(target, tmp_path, "dflash", False, [0, 2])
    assert export(tmp_path, trained_target, ["dflash"])["formats"]["dflash"]["status"] == "exported"
    ours, _ = deepspec_logits(draft, target, tokens)
    theirs = dflash_logits(tmp_path / "export" / "dflash", target, tokens)
    diff = (ours - theirs).abs().max().item()
    print(f"dflash dflash: max |logit diff| {diff:.2e}")
    assert diff < TOL and ours.abs().max() > 0.5


def test_bfloat16_export_holds_the_drafts_weights_rounded_to_bf16(tmp_path, trained_target, target, tokens,
                                                                 monkeypatch):
    draft = opinionated_draft(target, tmp_path, "dspark", True, [-1, 0, 2])
    export(tmp_path, trained_target, ["speculators"], dtype="bfloat16")
    weights = load_file(tmp_path / "export" / "speculators" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    with torch.no_grad():  # deepspec's draft with its own weights rounded the same way gives the same logits
        for p in draft.parameters():  # (embeddings and head are the verifier's, read in full precision)
            if p.requires_grad:
                p.copy_(p.to(torch.bfloat16).float())
    ours, _ = deepspec_logits(draft, target, tokens)
    theirs, _ = speculators_logits(tmp_path / "export" / "speculators", target, tokens, monkeypatch)
    diff = (ours - theirs).abs().max().item()
    print(f"speculators dspark bf16 weights: max |logit diff| {diff:.2e}")
    assert diff < TOL


@pytest.mark.parametrize("fmt", ["speculators", "dflash"])
def test_a_wrong_layer_id_shift_fails_the_comparison(tmp_path, trained_target, target, tokens, monkeypatch, fmt):
    """The same export with each engine given deepspec's ids unconverted (speculators) or shifted as if
    they were speculators' (dflash): the library then reads other hidden states, and the logits move."""
    draft = opinionated_draft(target, tmp_path, "dflash", False, [0, 2])
    if fmt == "speculators":
        monkeypatch.setattr(layer_ids, "to_speculators", lambda ids: list(ids))
    else:
        monkeypatch.setattr(layer_ids, "to_dflash", lambda ids: [i + 1 for i in ids])
    export(tmp_path, trained_target, [fmt])
    monkeypatch.undo()
    ours, _ = deepspec_logits(draft, target, tokens)
    if fmt == "speculators":
        theirs, _ = speculators_logits(tmp_path / "export" / fmt, target, tokens, monkeypatch)
    else:
        theirs = dflash_logits(tmp_path / "export" / fmt, target, tokens)
    assert (ours - theirs).abs().max() > 100 * TOL


# ---- what is written, what is refused ----------------------------------------------------------------

def test_configs_come_from_the_draft_and_name_the_verifier(tmp_path, trained_target, target):
    opinionated_draft(target, tmp_path, "dflash", False, [0, 2])
    report = export_draft(tmp_path / "draft", tmp_path / "export", ["speculators", "dflash"], trained_target,
                          "Qwen/Qwen3-4B", "bfloat16")
    for fmt in ("speculators", "dflash"):
        assert sorted(p.name for p in (tmp_path / "export" / fmt).iterdir()) == ["config.json", "model.safetensors"]
    spec = json.loads((tmp_path / "export" / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "dflash" and spec["aux_hidden_state_layer_ids"] == [1, 3]
    assert spec["mask_token_id"] == 3 and spec["sample_from_anchor"] is False and spec["block_size"] == 4
    assert spec["speculators_config"]["verifier"] == {"name_or_path": "Qwen/Qwen3-4B",
                                                      "architectures": ["Qwen3ForCausalLM"]}
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    layer = spec["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["hidden_size"] == target.config.hidden_size
    assert layer["intermediate_size"] == target.config.intermediate_size  # the draft's own (= target width here)
    dfl = json.loads((tmp_path / "export" / "dflash" / "config.json").read_text())
    assert dfl["architectures"] == ["DFlashDraftModel"] and dfl["num_hidden_layers"] == 1
    assert dfl["dflash_config"] == {"block_size": 4, "target_layer_ids": [0, 2], "mask_token_id": 3,
                                    "mask_token": "<|MASK|>", "num_target_layers": 4}
    weights = load_file(tmp_path / "export" / "dflash" / "model.safetensors")
    assert "fc.weight" in weights and not any(k.startswith(("embed", "lm_head")) for k in weights)
    assert json.loads((tmp_path / "export" / "report.json").read_text()) == report


def test_verifier_reference():
    assert verifier_reference("hf:Qwen/Qwen3-4B@abc123", "data/target") == "Qwen/Qwen3-4B"
    assert verifier_reference("builtin:tiny", "data/target") == "data/target"
    assert verifier_reference("models/my-model", "data/target") == "data/target"
    assert verifier_reference("hf:Qwen/Qwen3-4B", "data/target", "/srv/qwen") == "/srv/qwen"


def test_unrepresentable_drafts_are_refused_with_the_reason(tmp_path, trained_target, target):
    opinionated_draft(target, tmp_path, "dspark", True, [-1, 0, 2], name="dspark")
    opinionated_draft(target, tmp_path, "dflash", True, [0, 2], name="anchor")
    opinionated_draft(target, tmp_path, "dflash", False, [-1, 2], name="embedding")
    opinionated_draft(target, tmp_path, "dflash", False, [0, 2], mask_token_id=-1, name="learned")
    fmts = ["speculators", "dflash"]
    r = export(tmp_path, trained_target, fmts, draft="dspark", out="a")["formats"]
    assert r["speculators"]["status"] == "exported"
    assert r["dflash"]["status"] == "refused" and "Markov" in r["dflash"]["reason"]
    r = export(tmp_path, trained_target, fmts, draft="anchor", out="b")["formats"]
    assert r["speculators"]["status"] == "exported" and "sample_from_anchor" in r["dflash"]["reason"]
    r = export(tmp_path, trained_target, fmts, draft="embedding", out="c")["formats"]
    assert r["speculators"]["aux_hidden_state_layer_ids"] == [0, 3] and "-1" in r["dflash"]["reason"]
    r = export(tmp_path, trained_target, fmts, draft="learned", out="d")["formats"]
    assert all(r[f]["status"] == "refused" and "learned mask" in r[f]["reason"] for f in fmts)
    assert not (tmp_path / "d" / "dflash").exists() and (tmp_path / "d" / "report.json").exists()


def test_bad_input_is_refused_before_writing(tmp_path, trained_target, target):
    opinionated_draft(target, tmp_path, "dspark", True, [0, 2])
    with pytest.raises(ExportError, match="unknown export format 'vllm'"):
        export(tmp_path, trained_target, ["vllm"])
    wide = make_model_dir(tmp_path / "wide", hidden=48)
    with pytest.raises(ExportError, match="width 32 .* has 48"):          # another target's shape
        export_draft(tmp_path / "draft", tmp_path / "x", ["speculators"], wide, str(wide))
    opinionated_draft(target, tmp_path, "dspark", True, [0, 2], identity={"id": "0123456789abcdef"}, name="other")
    with pytest.raises(ExportError, match="trained against target 0123456789abcdef"):
        export(tmp_path, trained_target, ["speculators"], draft="other")
    assert not (tmp_path / "x").exists() and not (tmp_path / "export").exists()
    export(tmp_path, trained_target, ["speculators"])
    before = (tmp_path / "export" / "speculators" / "model.safetensors").read_bytes()
    with pytest.raises(ExportError, match="already exists"):
        export(tmp_path, trained_target, ["speculators"])
    assert (tmp_path / "export" / "speculators" / "model.safetensors").read_bytes() == before


def test_cli_export(tmp_path, trained_target, target, capsys):
    opinionated_draft(target, tmp_path, "dspark", True, [-1, 0, 2])
    rc = cli(["export", str(tmp_path / "draft"), "--format", "speculators", "--format", "dflash",
              "--out", str(tmp_path / "out"), "--target", str(trained_target)])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["speculators"]["status"] == "exported" and printed["dflash"]["status"] == "refused"
    cfg = json.loads((tmp_path / "out" / "speculators" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(trained_target)
    assert cli(["export", str(tmp_path / "draft"), "--format", "speculators", "--out", str(tmp_path / "out"),
                "--target", str(trained_target)]) == 1
    assert "already exists" in capsys.readouterr().err


def test_export_stage_writes_formats_and_the_report(tmp_path, trained_target, target):
    import yaml

    work = tmp_path / "work"
    shutil.copytree(trained_target, work / "data" / "target")
    ident = json.loads((trained_target / "identity.json").read_text())
    opinionated_draft(target, work / "data", "dspark", True, [-1, 0, 2], identity=ident)
    (work / "data" / "export" / "stale").mkdir(parents=True)       # a previous run's leftovers
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["layers"] = [-1, 0, 2]
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    proc = subprocess.run([sys.executable, str(REPO / "stages" / "export.py")], cwd=work, env=project_env(REPO),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"speculators": "exported", "dflash": "refused",
                                                                "sglang-eagle3": "refused"}
    report = json.loads((work / "data" / "export" / "report.json").read_text())
    assert report["verifier"] == "data/target" and report["draft"]["target_id"] == ident["id"]
    assert sorted(p.name for p in (work / "data" / "export").iterdir()) == ["report.json", "speculators"]
    params["target"]["source"] = "hf:Qwen/Qwen3-4B@main"
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    subprocess.run([sys.executable, str(REPO / "stages" / "export.py")], cwd=work, env=project_env(REPO),
                   check=True, capture_output=True)
    cfg = json.loads((work / "data" / "export" / "speculators" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-4B"
    assert cfg["dtype"] == "bfloat16"


# ---- dflash's own speculative decoding with an exported draft ------------------------------------------

@pytest.fixture(scope="module")
def trained_dflash(tmp_path_factory, small_cache, trained_target):
    """A DFlash draft in the dflash layout, trained on the small fixtures long enough that τ > 1."""
    root = tmp_path_factory.mktemp("trained_dflash")
    cfg = TrainConfig(algorithm="dflash", sample_from_anchor=False, block_size=4, draft_layers=1,
                      anchors_per_sample=8, batch_size=8, steps=300, lr=5e-3, warmup_steps=10,
                      checkpoint_every=300, seed=0)
    run_training(cfg, [0, 2], str(small_cache), trained_target, root / "draft", root / "train", root / "state")
    return root / "draft"


@pytest.mark.slow  # trains a draft for 300 steps
def test_dflash_generate_with_the_export_is_lossless_and_accepts_like_eval(tmp_path, trained_dflash,
                                                                           trained_target, monkeypatch):
    from dflash import model as dflash_model

    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)   # it times with CUDA syncs
    export_draft(trained_dflash, tmp_path / "export", ["dflash"], trained_target, str(trained_target), "float32")
    exported = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "export" / "dflash", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(trained_target)
    target = AutoModelForCausalLM.from_pretrained(trained_target, dtype=torch.float32).eval()
    dec = SpecDecoder(target, DraftModel.load(trained_dflash), {tok.eos_token_id})
    ours, theirs = [], []
    for conv in SAMPLE_CONVERSATIONS[::5]:
        ids = tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        plain = dec.plain(ids, 24, Warp())
        ours.append(dec.speculative(ids, 24, Warp()))
        out = dflash_model.dflash_generate(exported, target, torch.tensor([ids]), 24, [tok.eos_token_id],
                                           return_stats=True)
        assert out.output_ids[0, len(ids):].tolist() == plain.tokens
        theirs.extend(out.acceptance_lengths)
    tau = round_metrics(ours, 4)["tau"]
    tau_dflash = sum(theirs) / len(theirs)
    print(f"τ deepspec eval {tau:.3f}, dflash_generate mean acceptance {tau_dflash:.3f}")
    assert tau > 1.5
    assert abs(tau_dflash - tau) <= 0.10 * tau
