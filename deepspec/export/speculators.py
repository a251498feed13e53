"""The `speculators` format (what vLLM loads): DSpark, DFlash and EAGLE-3 drafts.

config.json is a speculators model config: `speculators_model_type` (dspark | dflash), the draft's
decoder layers as `transformer_layer_config`, `aux_hidden_state_layer_ids` in speculators' convention
(a layer's input: deepspec id + 1), `mask_token_id`, `sample_from_anchor`, `block_size`, the DSpark
heads' settings, and `speculators_config` (greedy proposal of `num_drafts` tokens, the verifier).
Weights: the backbone under deepspec's own names plus `markov_head.markov_w1/w2` and
`confidence_head.proj`; like speculators' own checkpoints, no embeddings or lm_head (full
vocabulary: the engine takes them, and the final norm, from the verifier).
EAGLE-3 (`speculators_model_type: eagle3`, speculators' Eagle3DraftModel with a Llama layer):
`transformer_layer_config` is a Llama config, `draft_vocab_size`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids` (id + 1), `norm_before_residual` false; weights `fc`, `layers.0.*`
(with `hidden_norm`), `norm`, the draft-vocabulary `lm_head` and the maps `d2t` (offsets) and `t2d`.
"""
from __future__ import annotations

from deepspec.export import layer_ids
from deepspec.export.base import (Exported, TargetRef, backbone_tensors, eagle3_tensors, llama_layer_config,
                                  qwen3_layer_config, require_mask_token, require_plain_embeddings,
                                  require_target_width)
from deepspec.models.draft import DraftModel

# the speculators release whose format this writes (config key `speculators_version`)
SPECULATORS_VERSION = "0.9.0"
ARCHITECTURES = {"dspark": "DSparkSpeculator", "dflash": "DFlashSpeculator", "eagle3": "Eagle3Speculator"}


def speculators_config(kind: str, drafts: int, target: TargetRef) -> dict:
    return {"algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafts, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target.name_or_path, "architectures": target.architectures}}


class Speculators:
    name = "speculators"

    def build(self, draft: DraftModel, target: TargetRef, dtype: str) -> Exported:
        cfg = draft.config
        require_plain_embeddings(cfg, "speculators")
        if cfg.algorithm == "eagle3":
            return self.eagle3(draft, target, dtype)
        require_mask_token(cfg)
        require_target_width(cfg)
        kind = "dspark" if cfg.algorithm == "dspark" else "dflash"
        aux = layer_ids.to_speculators(cfg.target_layers)
        config = {
            "architectures": [ARCHITECTURES[kind]],
            "speculators_model_type": kind,
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": qwen3_layer_config(cfg, dtype),
            "draft_vocab_size": cfg.vocab_size,
            "block_size": cfg.block_size,
            "target_hidden_size": cfg.target_hidden_size,
            "aux_hidden_state_layer_ids": aux,
            "mask_token_id": cfg.mask_token_id,
            "sliding_window_non_causal": False,
            "sample_from_anchor": cfg.sample_from_anchor,
            "speculators_config": speculators_config(kind, cfg.num_drafts, target),
            "tie_word_embeddings": False,
            "dtype": dtype,
            "torch_dtype": dtype,
        }
        tensors = backbone_tensors(draft)
        if kind == "dspark":
            config |= {"markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
                       "enable_confidence_head": cfg.confidence, "confidence_head_with_markov": cfg.confidence}
            tensors["markov_head.markov_w1.weight"] = draft.markov_in.weight
            tensors["markov_head.markov_w2.weight"] = draft.markov_out.weight
            if draft.confidence_head is not None:
                tensors["confidence_head.proj.weight"] = draft.confidence_head.weight
                tensors["confidence_head.proj.bias"] = draft.confidence_head.bias
        return Exported(config, tensors, {"speculators_model_type": kind, "aux_hidden_state_layer_ids": aux,
                                          "speculative_tokens": cfg.num_drafts})

    def eagle3(self, draft, target: TargetRef, dtype: str) -> Exported:
        cfg = draft.config
        require_target_width(cfg)
        aux = layer_ids.to_speculators(cfg.target_layers)
        config = {
            "architectures": [ARCHITECTURES["eagle3"]],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": llama_layer_config(cfg, dtype),
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": aux,
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "embed_requires_grad": False,
            "speculators_config": speculators_config("eagle3", cfg.num_drafts, target),
            "tie_word_embeddings": False,
            "dtype": dtype,
            "torch_dtype": dtype,
        }
        return Exported(config, eagle3_tensors(draft), {"speculators_model_type": "eagle3",
                                                         "eagle_aux_hidden_state_layer_ids": aux,
                                                         "draft_vocab_size": cfg.draft_vocab_size,
                                                         "speculative_tokens": cfg.num_drafts})
