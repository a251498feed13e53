"""A draft built from any HF causal-LM config sees what the target's own modules give: its RoPE
(type, theta, scaling; Gemma 3's global one), its scaled embeddings, and the target runs with the
attention kernel that computes what eager does."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen3Config

from deepspec.export.base import Refused, TargetRef
from deepspec.export.speculators import Speculators
from deepspec.models.draft import DraftConfig, DraftModel, target_rope
from deepspec.models.target import attention_implementation, embedding_weights

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def save_model(config, path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    return model


def draft_for(config, **kw) -> DraftModel:
    return DraftModel(DraftConfig.for_target("dspark", config, [0], 4, 1, 8, {}, mask_token_id=5, **kw))


def test_the_drafts_rope_is_the_targets_with_its_scaling():
    llama = LlamaConfig(**SMALL, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
                        rope_theta=500000.0)
    draft = draft_for(llama)
    assert draft.config.rope_parameters["rope_type"] == "llama3" and draft.config.rope_theta == 500000.0
    assert draft.config.max_position_embeddings == 4096
    theirs = AutoModelForCausalLM.from_config(llama).model.rotary_emb
    x, pos = torch.zeros(1, 3000, 64), torch.arange(3000)[None]
    for a, b in zip(draft.rotary(x, pos), theirs(x, pos)):
        assert torch.equal(a, b)
    plain = draft_for(LlamaConfig(**SMALL))
    assert not torch.allclose(plain.rotary(x, pos)[0], theirs(x, pos)[0])  # the scaling matters here


def test_a_target_with_a_rope_per_attention_type_gives_the_global_one():
    gemma = Gemma3TextConfig(**SMALL, sliding_window=16)
    assert set(gemma.rope_parameters) == {"full_attention", "sliding_attention"}
    assert target_rope(gemma)["rope_theta"] == gemma.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert target_rope(Qwen3Config(**SMALL, rope_theta=12345.0)) == {"rope_type": "default", "rope_theta": 12345.0}


def test_scaled_embeddings_are_read_from_the_weights_and_applied_as_the_target_applies_them(tmp_path, monkeypatch):
    gemma = Gemma3TextConfig(**SMALL, sliding_window=16)
    target = save_model(gemma, tmp_path / "gemma")
    # only the two tensors are read, by name, from the safetensors: the model is never loaded whole
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded the model"))
    embed, head, scale = embedding_weights(tmp_path / "gemma")
    assert scale == pytest.approx(64 ** 0.5)
    assert torch.equal(embed, target.get_input_embeddings().weight) and torch.equal(head, embed)  # tied
    draft = draft_for(gemma, embed_scale=scale)
    draft.set_target_embeddings(embed, head)
    tokens = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        assert torch.equal(draft.embed(tokens), target.get_input_embeddings()(tokens))
        for dtype in (torch.bfloat16,):  # in the weights' dtype, as Gemma's module does it
            assert torch.equal(draft.to(dtype).embed(tokens), target.to(dtype).get_input_embeddings()(tokens))
        draft.float()
        assert torch.equal(draft.mask_vector(), target.float().get_input_embeddings()(torch.tensor(5)))


def test_untied_heads_are_read_separately(tmp_path):
    llama = LlamaConfig(**SMALL, tie_word_embeddings=False)
    target = save_model(llama, tmp_path / "llama")
    embed, head, scale = embedding_weights(tmp_path / "llama")
    assert scale == 1.0 and not torch.equal(embed, head)
    assert torch.equal(head, target.get_output_embeddings().weight)


def test_attention_kernel_is_eager_where_sdpa_computes_something_else(tmp_path):
    for name, config, want in [("qwen3", Qwen3Config(**SMALL), "sdpa"),
                               ("gemma2", Gemma2Config(**SMALL, attn_logit_softcapping=50.0), "eager")]:
        config.architectures = [type(AutoModelForCausalLM.from_config(config)).__name__]
        config.save_pretrained(tmp_path / name)
        assert attention_implementation(tmp_path / name) == want


def test_speculators_refuses_a_draft_trained_on_scaled_embeddings():
    draft = draft_for(Gemma3TextConfig(**SMALL, sliding_window=16), embed_scale=8.0)
    with pytest.raises(Refused, match="scales its input embeddings by 8"):
        Speculators().build(draft, TargetRef("t", ["Gemma3ForCausalLM"], 2, 64, 300), "float32")


@pytest.mark.parametrize("algorithm", ["dspark", "eagle3"])
def test_a_draft_loaded_in_bf16_keeps_the_rope_a_target_loaded_in_bf16_has(tmp_path, algorithm):
    """Eval loads the draft in the target's compute dtype (bf16 on a GPU): its weights are cast, its
    RoPE frequencies are not, so its angles stay those it trained with, as transformers' target's do."""
    from deepspec.models.draft import save_draft
    from deepspec.models.eagle3 import Eagle3Model
    from deepspec.models.registry import load_draft

    qwen = Qwen3Config(**SMALL)
    save_model(qwen, tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.bfloat16)
    dspark = algorithm == "dspark"
    config = DraftConfig.for_target(algorithm, qwen, [0, 1] if dspark else [-1, 0, 1], 4, 1, 8 if dspark else 0, {},
                                    ttt_steps=2, draft_vocab_size=0 if dspark else 32)
    save_draft((DraftModel if dspark else Eagle3Model)(config), tmp_path / "draft")
    draft = load_draft(tmp_path / "draft", dtype=torch.bfloat16)
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    assert all(b.dtype in (torch.bfloat16, torch.long, torch.bool) for b in draft.state_dict().values())
    x, pos = torch.zeros(1, 4000, 64, dtype=torch.bfloat16), torch.arange(4000)[None]
    for ours, theirs in zip(draft.rotary(x, pos), target.model.rotary_emb(x, pos)):
        assert torch.equal(ours, theirs)
    rounded = load_draft(tmp_path / "draft").to(torch.bfloat16)  # what Module.to alone gives
    assert not torch.equal(rounded.rotary(x, pos)[0], target.model.rotary_emb(x, pos)[0])
