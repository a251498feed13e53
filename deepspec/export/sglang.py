"""The `sglang-eagle3` format: an EAGLE-3 draft as sglang's `LlamaForCausalLMEagle3`
(`python -m sglang.launch_server --speculative-algorithm EAGLE3 --speculative-draft-model-path ...`).

config.json is a Llama config of the draft's layer (`architectures: [LlamaForCausalLMEagle3]`,
`vocab_size` = the target's) plus what that class reads: `draft_vocab_size` (the size of its lm_head;
without it sglang would take the target's head), `target_hidden_size` (the width of the fused
features: fc takes 3 x that), and `eagle_config.eagle_aux_hidden_state_layer_ids` in sglang's
convention (layer outputs; sglang adds 1 itself). Weights under the names its `load_weights` maps:
`fc`, `layers.0.*` (q/k/v and gate/up are stacked by the loader), `norm`, `lm_head`, `d2t` (offsets:
sglang's hot-token ids are d2t + arange) and `t2d` (skipped by sglang, kept for other readers). No
embeddings: sglang shares the target's (`set_embed`).
"""
from __future__ import annotations

from deepspec.export import layer_ids
from deepspec.export.base import (Exported, Refused, TargetRef, eagle3_tensors, llama_layer_config, require_eagle3,
                                  require_target_width)
from deepspec.models.draft import DraftModel


class SglangEagle3:
    name = "sglang-eagle3"

    def build(self, draft: DraftModel, target: TargetRef, dtype: str) -> Exported:
        cfg = draft.config
        require_eagle3(cfg, "sglang's LlamaForCausalLMEagle3")
        require_target_width(cfg)
        try:
            ids = layer_ids.to_sglang_eagle3(cfg.target_layers)
        except layer_ids.NoSuchLayerId as e:
            raise Refused(f"{e}: train with train.layers that leave out -1") from None
        config = llama_layer_config(cfg, dtype) | {
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        }
        return Exported(config, eagle3_tensors(draft), {"eagle_aux_hidden_state_layer_ids": ids,
                                                         "draft_vocab_size": cfg.draft_vocab_size,
                                                         "speculative_tokens": cfg.num_drafts})
