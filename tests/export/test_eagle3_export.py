"""EAGLE-3 exports: speculators' own Eagle3 model class gives deepspec's logits (taking its features from the
target's output_hidden_states through speculators' ids and its own batch shift), and the sglang-eagle3
directory maps onto sglang's LlamaForCausalLMEagle3 as its loader reads it (sglang itself needs a GPU and is
not installed: its loader rules are transcribed below from sglang 0.5.23's srt/models/llama_eagle3.py and
srt/models/llama.py / qwen3.py, and the forward is run by speculators' Llama EAGLE-3 layer, the same
cnets.py-derived layer)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from deepspec.export import export_draft, layer_ids
from deepspec.models.capture import capture_layers
from deepspec.models.draft import DraftConfig
from deepspec.models.eagle3 import Eagle3Model, vocab_map
from tests.export.test_export import target, tokens  # noqa: F401  (module fixtures)

TOL = 1e-4
STEPS = 3


def eagle3_draft(target, tmp_path, layers=(-1, 0, 2), name="draft", draft_vocab=200, identity=None):
    """Random weights large enough that a misplaced tensor or id moves the logits; a draft vocabulary that
    is not a prefix of the target's, so a wrong d2t/t2d reading shows."""
    torch.manual_seed(11)
    V = target.config.vocab_size
    cfg = DraftConfig.for_target("eagle3", target.config, list(layers), 4, 1, 0, identity or {}, ttt_steps=STEPS,
                                 draft_vocab_size=draft_vocab)
    draft = Eagle3Model(cfg)
    draft.set_vocab(*vocab_map({t: (t * 7919) % 101 + 1 for t in range(V)}, draft_vocab, V))
    draft.copy_target_embeddings(target)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if p.requires_grad:
                p.normal_(mean=1.0 if "norm" in n else 0.0, std=0.3 if "norm" not in n else 0.1)
    draft.save(tmp_path / name)
    return draft.eval()


def deepspec_eagle3_logits(draft, target, ids):
    """deepspec's own path: its forward hooks, the training-time test unrolled with the data's tokens.
    Returns [STEPS, T-1, draft vocab]: step k of row t predicts token t+2+k."""
    T = ids.shape[1]
    n = T - 1
    with torch.no_grad(), capture_layers(target, draft.config.target_layers) as store:
        target(input_ids=ids)
    feats = torch.cat([store[i] for i in draft.config.target_layers], dim=-1)
    out, past = [], []
    causal, diag = torch.ones(n, n, dtype=torch.bool).tril(), torch.eye(n, dtype=torch.bool)
    with torch.no_grad():
        h = draft.fc(feats[:, :n])
        for k in range(STEPS):
            h, kv = draft.step(torch.nn.functional.pad(ids[:, 1 + k:], (0, k)), h, torch.arange(1, T)[None] + k,
                               torch.cat([causal] + [diag] * k, dim=1), past)
            past.append(kv)
            out.append(draft.logits(h[0]))
    return torch.stack(out)


def speculators_eagle3_logits(export_dir, target, ids, monkeypatch, config=None, weights=None):
    """speculators' Eagle3DraftModel forward (SDPA), its inputs made by its own `shift_batch` from the target's
    output_hidden_states at its own ids; the logits of each TTT step taken where it hands them to its loss."""
    import speculators.models.eagle3.core as core
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from speculators.models.eagle3.data import shift_batch

    config = config or SpeculatorModelConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "sdpa"
    if weights is None:
        model = SpeculatorModel.from_pretrained(export_dir, config=config, dtype=torch.float32).eval()
        # speculators 0.9.0 under transformers 5 leaves the unsaved embedding uninitialised rather than NaN,
        # so its own "copy from the verifier if NaN" check may skip it: run its verifier loader explicitly
        model._load_verifier_weights(overwrite_embed_tokens=True)
    else:   # weights given under speculators' names (the sglang check below)
        model = core.Eagle3DraftModel(config).eval()
        model.load_state_dict(weights, strict=False)
        model.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in model.config.eagle_aux_hidden_state_layer_ids], dim=-1)
    T = ids.shape[1]
    batch = shift_batch({"input_ids": ids[0], "hidden_states": aux[0], "verifier_last_hidden_states": out.hidden_states[-1][0],
                         "loss_mask": torch.ones(T, dtype=torch.bool), "lengths": torch.tensor([T]),
                         "position_ids": torch.arange(T)})
    seen = []

    def capture(logits, *args, **kwargs):
        seen.append(logits[0])
        return torch.zeros(()), {}

    monkeypatch.setattr(core, "compute_metrics", capture)
    with torch.no_grad():
        model(hidden_states=batch["hidden_states"][None], input_ids=batch["input_ids"][None],
              document_ids=torch.zeros(1, T - 1, dtype=torch.long), loss_mask=batch["loss_mask"][None],
              position_ids=batch["position_ids"][None], verifier_last_hidden_states=batch["verifier_last_hidden_states"][None],
              ttt_steps=STEPS)
    return torch.stack(seen), model


def export(tmp_path, trained_target, formats, draft="draft", out="export", dtype="float32"):
    return export_draft(tmp_path / draft, tmp_path / out, formats, trained_target, str(trained_target), dtype)


def test_eagle3_layer_id_conversions_are_pinned(target, tokens):
    assert layer_ids.to_speculators([1, 17, 33]) == [2, 18, 34]           # speculators: a layer's input, id + 1
    assert layer_ids.to_sglang_eagle3([1, 17, 33]) == [1, 17, 33]         # sglang: layer outputs (it adds 1 itself)
    assert layer_ids.from_sglang_eagle3([1, 17, 33]) == [1, 17, 33]
    with pytest.raises(layer_ids.NoSuchLayerId, match="-1"):
        layer_ids.to_sglang_eagle3([-1, 9, 17])
    # sglang's target captures the input of layer id+1 (`layers_to_capture = [val + 1 ...]`), i.e. HF's
    # output_hidden_states[id + 1]: the state deepspec's hooks cache for id
    with torch.no_grad(), capture_layers(target, [0, 1, 2]) as store:
        out = target(input_ids=tokens, output_hidden_states=True)
    for i in (0, 1, 2):
        assert torch.equal(out.hidden_states[layer_ids.to_sglang_eagle3([i])[0] + 1], store[i])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculators_eagle3_export_gives_the_drafts_logits(tmp_path, trained_target, target, tokens, monkeypatch, dtype):
    draft = eagle3_draft(target, tmp_path)
    report = export(tmp_path, trained_target, ["speculators"], dtype=dtype)["formats"]["speculators"]
    assert report["status"] == "exported" and report["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    if dtype == "bfloat16":   # deepspec's draft with its weights rounded the same way
        with torch.no_grad():
            for p in draft.parameters():
                if p.requires_grad:
                    p.copy_(p.to(torch.bfloat16).float())
    ours = deepspec_eagle3_logits(draft, target, tokens)
    theirs, model = speculators_eagle3_logits(tmp_path / "export" / "speculators", target, tokens, monkeypatch)
    assert theirs.shape == ours.shape == (STEPS, tokens.shape[1] - 1, 200)
    diff = (ours - theirs).abs().max().item()
    print(f"speculators eagle3 {dtype}: max |logit diff| {diff:.2e}")
    assert diff < TOL and ours.abs().max() > 0.5
    assert torch.equal(model.d2t, draft.d2t) and torch.equal(model.t2d, draft.t2d)   # the vocabulary map
    assert torch.equal(torch.arange(200) + model.d2t, draft.draft_ids())


# ---- sglang-eagle3: checked against sglang's loader as written, without running sglang ------------------

STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]    # LlamaForCausalLMEagle3.load_weights


def sglang_parameters(config: dict) -> dict[str, tuple]:
    """The parameters LlamaForCausalLMEagle3 builds from a config (shapes at TP 1), as its __init__ reads it:
    fc from target_hidden_size x len(eagle_config ids); layer 0's qkv from 2 x hidden; lm_head of
    draft_vocab_size (untied)."""
    H, hd = config["hidden_size"], config["head_dim"]
    nh, nkv, inter = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    assert config["tie_word_embeddings"] is False and config["draft_vocab_size"] is not None
    p = "model.layers.0."
    return {"model.embed_tokens.weight": (config["vocab_size"], H),
            "model.fc.weight": (H, config["target_hidden_size"] * aux),
            p + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, 2 * H),
            p + "self_attn.o_proj.weight": (H, nh * hd),
            p + "mlp.gate_up_proj.weight": (2 * inter, H),
            p + "mlp.down_proj.weight": (H, inter),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "hidden_norm.weight": (H,),
            "model.norm.weight": (H,),
            "lm_head.weight": (config["draft_vocab_size"], H)}


def sglang_load(weights: dict, params: dict):
    """sglang's load_weights name mapping: (parameter -> {shard: tensor}, hot_token_id, names it drops)."""
    loaded, hot, dropped = {}, None, []
    for name, w in weights.items():
        if "d2t" in name:
            hot = w + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            continue
        for param, weight_name, shard in STACKED:
            if weight_name in name:
                name = name.replace(weight_name, param)
                break
        else:
            shard = None
        pname = name if name in params else f"model.{name}"
        if pname in params:
            loaded.setdefault(pname, {})[shard] = w
        else:
            dropped.append(name)   # sglang skips a name it does not know, silently
    return loaded, hot, dropped


def sglang_side_logits(out, loaded, target, tokens, monkeypatch):
    """The forward: speculators' Llama EAGLE-3 layer configured only from the config keys sglang reads, its
    weights split back out of sglang's stacked parameters, its features at sglang's capture (the input of
    layer id + 1 = output_hidden_states[id + 1])."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    config = json.loads((out / "config.json").read_text())
    # split back out of sglang's stacked parameters, its features at sglang's capture (input of layer id+1)
    sp = {"fc.weight": loaded["model.fc.weight"][None], "norm.weight": loaded["model.norm.weight"][None],
          "lm_head.weight": loaded["lm_head.weight"][None]}
    for name, shards in loaded.items():
        if name.startswith("model.layers.0."):
            rest = name.removeprefix("model.")
            if "qkv_proj" in rest:
                for s, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
                    sp[rest.replace("qkv_proj", proj)] = shards[s]
            elif "gate_up_proj" in rest:
                sp[rest.replace("gate_up_proj", "gate_proj")], sp[rest.replace("gate_up_proj", "up_proj")] = shards[0], shards[1]
            else:
                sp[rest] = shards[None]
    layer = {k: config[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                                    "rope_parameters", "max_position_embeddings", "hidden_act", "tie_word_embeddings")}
    sglang_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    spec_cfg = Eagle3SpeculatorConfig(transformer_layer_config=layer, draft_vocab_size=config["draft_vocab_size"],
                                      target_hidden_size=config["target_hidden_size"],
                                      eagle_aux_hidden_state_layer_ids=[i + 1 for i in sglang_ids])  # sglang's +1
    theirs, _ = speculators_eagle3_logits(None, target, tokens, monkeypatch, config=spec_cfg, weights=sp)
    return theirs


def test_sglang_eagle3_export_maps_onto_llamaforcausallmeagle3_and_gives_the_drafts_logits(
        tmp_path, trained_target, target, tokens, monkeypatch):
    draft = eagle3_draft(target, tmp_path, layers=(0, 1, 2))
    report = export_draft(tmp_path / "draft", tmp_path / "export", ["sglang-eagle3"], trained_target, "Qwen/Qwen3-4B",
                          "float32")["formats"]["sglang-eagle3"]
    assert report["status"] == "exported"
    out = tmp_path / "export" / "sglang-eagle3"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]   # layer outputs, as deepspec
    weights = load_file(out / "model.safetensors")
    params = sglang_parameters(config)
    loaded, hot, dropped = sglang_load(weights, params)
    assert dropped == []                                                   # every tensor lands on a parameter
    assert set(loaded) == set(params) - {"model.embed_tokens.weight"}      # every parameter but the shared embedding
    H = config["hidden_size"]
    for name, shards in loaded.items():
        full = torch.cat([shards[s] for s in sorted(shards, key=str)], 0) if len(shards) > 1 else shards[None]
        if name.endswith("qkv_proj.weight"):
            assert set(shards) == {"q", "k", "v"}
            full = torch.cat([shards["q"], shards["k"], shards["v"]], 0)
        if name.endswith("gate_up_proj.weight"):
            assert set(shards) == {0, 1}
            full = torch.cat([shards[0], shards[1]], 0)
        assert tuple(full.shape) == params[name], name
    assert torch.equal(hot, draft.draft_ids())                             # sglang's hot-token ids = d2t + arange
    theirs = sglang_side_logits(out, loaded, target, tokens, monkeypatch)
    ours = deepspec_eagle3_logits(draft, target, tokens)
    diff = (ours - theirs).abs().max().item()
    print(f"sglang-eagle3 (sglang's loader mapping, speculators' layer): max |logit diff| {diff:.2e}")
    assert diff < TOL and ours.abs().max() > 0.5
    assert (hot[theirs.argmax(-1)] == draft.draft_ids()[ours.argmax(-1)]).all()   # same target tokens proposed


@pytest.mark.parametrize("fmt", ["speculators", "sglang-eagle3"])
def test_a_wrong_eagle3_layer_id_shift_fails_the_comparison(tmp_path, trained_target, target, tokens, monkeypatch, fmt):
    """Exported with deepspec's ids unconverted (speculators reads layer inputs) or shifted as if they were
    speculators' (sglang adds 1 itself): the library side reads other hidden states and its logits move."""
    draft = eagle3_draft(target, tmp_path, layers=(0, 1, 2))
    if fmt == "speculators":
        monkeypatch.setattr(layer_ids, "to_speculators", lambda ids: list(ids))
    else:
        monkeypatch.setattr(layer_ids, "to_sglang_eagle3", lambda ids: [i + 1 for i in ids])
    export(tmp_path, trained_target, [fmt])
    monkeypatch.undo()
    ours = deepspec_eagle3_logits(draft, target, tokens)
    out = tmp_path / "export" / fmt
    if fmt == "speculators":
        theirs, _ = speculators_eagle3_logits(out, target, tokens, monkeypatch)
    else:
        params = sglang_parameters(json.loads((out / "config.json").read_text()))
        theirs = sglang_side_logits(out, sglang_load(load_file(out / "model.safetensors"), params)[0], target, tokens,
                                    monkeypatch)
    assert (ours - theirs).abs().max() > 100 * TOL


def test_sglang_eagle3_ids_and_refusals(tmp_path, trained_target, target):
    eagle3_draft(target, tmp_path, layers=(0, 1, 2))
    r = export(tmp_path, trained_target, ["speculators", "dflash", "sglang-eagle3"])["formats"]
    assert r["sglang-eagle3"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert r["speculators"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert r["dflash"]["status"] == "refused" and "chain" in r["dflash"]["reason"]
    cfg = json.loads((tmp_path / "export" / "sglang-eagle3" / "config.json").read_text())
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["vocab_size"]) == (200, 32, target.config.vocab_size)
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    assert cfg["num_hidden_layers"] == 1 and "q_norm" not in str(load_file(tmp_path / "export" / "sglang-eagle3" /
                                                                           "model.safetensors").keys())
    eagle3_draft(target, tmp_path, layers=(-1, 0, 2), name="emb")
    r = export(tmp_path, trained_target, ["speculators", "sglang-eagle3"], draft="emb", out="b")["formats"]
    assert r["speculators"]["status"] == "exported" and "-1" in r["sglang-eagle3"]["reason"]
    from tests.export.test_export import opinionated_draft

    opinionated_draft(target, tmp_path, "dspark", True, [-1, 0, 2], name="dspark")
    r = export(tmp_path, trained_target, ["sglang-eagle3"], draft="dspark", out="c")["formats"]
    assert r["sglang-eagle3"]["status"] == "refused" and "EAGLE-3 drafts only" in r["sglang-eagle3"]["reason"]
