"""The `dflash` format: the dflash package's layout (`dflash.model.DFlashDraftModel`), which sglang
serves with `--speculative-algorithm DFLASH`.

config.json is a Qwen3 config of the draft's decoder layers with `architectures: [DFlashDraftModel]`,
`block_size` (= γ) and `num_target_layers` at the top level (older readers) and a `dflash_config`
with `block_size`, `target_layer_ids` (layer outputs, as in deepspec), `mask_token_id` and
`mask_token`. Weights: the backbone only; the engine embeds and projects with the target's own
embedding and lm_head. The layout has no Markov or confidence head and always discards slot 0's
output (γ-1 drafts per block), so only DFlash drafts trained with `sample_from_anchor: false` fit.
"""
from __future__ import annotations

from deepspec.export import layer_ids
from deepspec.export.base import (Exported, Refused, TargetRef, backbone_tensors, qwen3_layer_config,
                                  require_mask_token, require_target_width)
from deepspec.models.draft import DraftModel


class DFlash:
    name = "dflash"

    def build(self, draft: DraftModel, target: TargetRef, dtype: str) -> Exported:
        cfg = draft.config
        if cfg.algorithm == "eagle3":
            raise Refused("an EAGLE-3 draft drafts a chain, not a block of mask slots: export it as speculators "
                          "or sglang-eagle3")
        if cfg.algorithm != "dflash" or cfg.markov_rank > 0 or cfg.confidence:
            raise Refused(f"a {cfg.algorithm} draft has a Markov and a confidence head, which the dflash layout "
                          "cannot hold: train with train.algorithm: dflash (and sample_from_anchor false)")
        if cfg.sample_from_anchor:
            raise Refused("the draft predicts from its anchor slot (sample_from_anchor true); the dflash layout "
                          "discards slot 0's output: train with train.sample_from_anchor: false")
        require_mask_token(cfg)
        require_target_width(cfg)
        try:
            ids = layer_ids.to_dflash(cfg.target_layers)
        except layer_ids.NoSuchLayerId as e:
            raise Refused(f"{e}: train with train.layers that leave out -1") from None
        dflash_config = {"block_size": cfg.block_size, "target_layer_ids": ids, "mask_token_id": cfg.mask_token_id,
                         "mask_token": cfg.mask_token, "num_target_layers": target.num_layers}
        config = qwen3_layer_config(cfg, dtype) | {
            "architectures": ["DFlashDraftModel"],
            "block_size": cfg.block_size,
            "num_target_layers": target.num_layers,
            "dflash_config": dflash_config,
        }
        return Exported(config, backbone_tensors(draft), {"target_layer_ids": ids,
                                                           "speculative_tokens": cfg.num_drafts})
