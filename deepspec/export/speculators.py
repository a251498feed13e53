"""The `speculators` format (what vLLM loads): DSpark and DFlash drafts.

config.json is a speculators model config: `speculators_model_type` (dspark | dflash), the draft's
decoder layers as `transformer_layer_config`, `aux_hidden_state_layer_ids` in speculators' convention
(a layer's input: deepspec id + 1), `mask_token_id`, `sample_from_anchor`, `block_size`, the DSpark
heads' settings, and `speculators_config` (greedy proposal of `num_drafts` tokens, the verifier).
Weights: the backbone under deepspec's own names plus `markov_head.markov_w1/w2` and
`confidence_head.proj`; like speculators' own checkpoints, no embeddings or lm_head (full
vocabulary: the engine takes them, and the final norm, from the verifier).
"""
from __future__ import annotations

from deepspec.export import layer_ids
from deepspec.export.base import (Exported, TargetRef, backbone_tensors, qwen3_layer_config,
                                  require_mask_token, require_target_width)
from deepspec.models.draft import DraftModel

# the speculators release whose format this writes (config key `speculators_version`)
SPECULATORS_VERSION = "0.9.0"
ARCHITECTURES = {"dspark": "DSparkSpeculator", "dflash": "DFlashSpeculator"}


class Speculators:
    name = "speculators"

    def build(self, draft: DraftModel, target: TargetRef, dtype: str) -> Exported:
        cfg = draft.config
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
            "speculators_config": {
                "algorithm": kind,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.num_drafts,
                                      "verifier_accept_k": 1}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target.name_or_path, "architectures": target.architectures},
            },
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
