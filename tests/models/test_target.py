import json
import shutil

import pytest

from deepspec.config import ConfigError, TargetConfig, TinyTargetConfig
from deepspec.models.prepare import parse_source, prepare_target
from deepspec.models.target import TargetError, check_layers, identity, validate_model_dir
from tests.conftest import SAMPLE_CONVERSATIONS, make_model_dir


def corpus():
    """The builtin:tiny trainer prepare_target takes (only that source calls it), on the test conversations."""
    from deepspec.embedded.tiny import trainer_on

    return trainer_on([{"id": f"r{i}", "conversations": conv} for i, conv in enumerate(SAMPLE_CONVERSATIONS)])


def assert_sampling_defaults(gen):
    """A model's own generation_config agrees with params.yaml's sampling defaults."""
    from deepspec.config import SamplingConfig

    s = SamplingConfig()
    assert (gen.temperature, gen.top_p, gen.top_k) == (s.temperature, s.top_p, s.top_k)
    assert (gen.min_p or 0.0) == s.min_p


def test_test_targets_sample_like_the_defaults(small_model_dir):
    from transformers import GenerationConfig

    assert_sampling_defaults(GenerationConfig.from_pretrained(small_model_dir))


def test_unknown_scheme_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown source 'builtin:huge'"):
        parse_source("builtin:huge")
    with pytest.raises(ConfigError, match="unknown source 'gs://bucket/model'"):
        parse_source("gs://bucket/model")
    assert parse_source("hf:Qwen/Qwen3-4B@main") == ("hf", "Qwen/Qwen3-4B@main")


def test_layer_ids_exclude_the_final_layer():
    check_layers([-1, 1, 9, 17, 25, 33, 34], 36)
    with pytest.raises(ConfigError, match=r"layers: \[35\] out of range .* 36 decoder layers"):
        check_layers([9, 35], 36)
    with pytest.raises(ConfigError, match=r"\[-2\]"):
        check_layers([-2], 36)


def test_local_directory_source_is_copied_with_identity(tmp_path, small_model_dir):
    out = tmp_path / "target"
    ident = prepare_target(TargetConfig(source=str(small_model_dir)), [0, 1, 2], corpus(), out)
    assert ident["num_layers"] == 4 and ident["hidden_size"] == 32
    assert json.loads((out / "identity.json").read_text()) == ident
    assert (out / "model.safetensors").read_bytes() == (small_model_dir / "model.safetensors").read_bytes()
    again = prepare_target(TargetConfig(source=str(small_model_dir)), [0], corpus(), tmp_path / "t2")
    assert again == ident  # identity is stable across runs and copies


def test_identity_changes_with_weights_and_template(tmp_path, small_model_dir):
    base = identity(small_model_dir)
    other = make_model_dir(tmp_path / "other", seed=1)
    assert identity(other)["weights_sha256"] != base["weights_sha256"]
    assert identity(other)["tokenizer_sha256"] == base["tokenizer_sha256"]
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    tmpl = other / "chat_template.jinja"
    if tmpl.exists():
        tmpl.write_text(tmpl.read_text() + " ")
    else:
        cfg["chat_template"] += " "
        (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert identity(other)["chat_template_sha256"] != base["chat_template_sha256"]


def test_bad_local_directories(tmp_path, small_model_dir):
    split = corpus()
    with pytest.raises(ConfigError, match=r"\[4\] out of range .* 4 decoder layers"):
        prepare_target(TargetConfig(source=str(small_model_dir)), [4], split, tmp_path / "o1")
    not_lm = tmp_path / "bert"
    shutil.copytree(small_model_dir, not_lm)
    cfg = json.loads((not_lm / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForSequenceClassification"]
    (not_lm / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetError, match="is not a causal LM"):
        validate_model_dir(not_lm)
    no_template = tmp_path / "notemplate"
    shutil.copytree(small_model_dir, no_template)
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((no_template / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(TargetError, match="no chat template"):
        prepare_target(TargetConfig(source=str(no_template)), [0], split, tmp_path / "o2")
    assert not (tmp_path / "o2").exists()
    with pytest.raises(TargetError, match="not a directory"):
        prepare_target(TargetConfig(source=str(tmp_path / "missing")), [0], split, tmp_path / "o3")


def test_hub_source_offline_from_a_local_hub_cache(tmp_path, small_model_dir, monkeypatch):
    """The hf: path runs the real huggingface_hub code against a hub cache laid out on disk."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = cache / "models--acme--tiny" / "snapshots" / commit
    shutil.copytree(small_model_dir, snap)
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    ident = prepare_target(TargetConfig(source="hf:acme/tiny"), [1], corpus(), tmp_path / "t")
    assert ident == identity(small_model_dir)
    with pytest.raises(TargetError, match="hf:acme/absent: cannot fetch"):
        prepare_target(TargetConfig(source="hf:acme/absent"), [1], corpus(), tmp_path / "t2")


def test_builtin_tiny_trains_and_saves_a_loadable_model(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny = TinyTargetConfig(vocab_size=600, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                            head_dim=16, intermediate_size=64, seq_len=64, batch_size=4, steps=30,
                            warmup_steps=3, lr=1e-2, heldout_fraction=0.2)
    out = tmp_path / "target"
    with pytest.raises(ConfigError, match=r"\[2\] out of range"):
        prepare_target(TargetConfig(tiny=tiny), [1, 2], corpus(), out)
    ident = prepare_target(TargetConfig(tiny=tiny), [-1, 0, 1], corpus(), out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heldout_loss"] < metrics["uniform_loss"] - 1.0
    assert ident["num_layers"] == 3 and ident["architecture"] == "Qwen3ForCausalLM"
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.do_sample is True
    assert tok.convert_ids_to_tokens(model.generation_config.eos_token_id) == "<|im_end|>"
    assert_sampling_defaults(model.generation_config)
    # a reserved mask token for block drafts: a special token no text encodes to
    assert tok.mask_token == "<|MASK|>" and tok.mask_token_id < len(tok)
    assert tok.mask_token_id not in tok("<|MASK |> MASK mask <|im_start|>", add_special_tokens=False).input_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # no injected system turn
    with torch.no_grad():
        assert model(**tok(prompt, return_tensors="pt")).logits.shape[-1] == len(tok)
    # same seed, same data -> same weights (the stage is deterministic)
    ident2 = prepare_target(TargetConfig(tiny=tiny), [0], corpus(), tmp_path / "again")
    assert ident2 == ident


@pytest.mark.slow
def test_smollm2_from_the_packaged_gguf(tmp_path):
    pytest.importorskip("gguf")
    out = tmp_path / "smol"
    ident = prepare_target(TargetConfig(source="builtin:smollm2-135m"), [1, 9, 17, 25], corpus(), out)
    assert ident["num_layers"] == 30 and ident["architecture"] == "LlamaForCausalLM"
    validate_model_dir(out)
