"""What every export format shares: the target reference, the draft's own layer config, refusals,
and writing a model directory (config.json + model.safetensors, no pickle) without leaving a half-
written one behind."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepspec.models.draft import DraftConfig, DraftModel

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ExportError(ValueError):
    """Bad input: the export cannot run (wrong target, output already there, unknown format)."""


class Refused(Exception):
    """The format cannot represent this draft; the message says why (listed in report.json)."""


@dataclass
class TargetRef:
    """The target as the exported config names it."""
    name_or_path: str                 # hub id for hf: targets, the model directory otherwise
    architectures: list[str]
    num_layers: int
    hidden_size: int
    vocab_size: int


@dataclass
class Exported:
    config: dict
    tensors: dict[str, torch.Tensor]
    facts: dict = field(default_factory=dict)   # for report.json: ids written, drafts per round, ...


def require_mask_token(cfg: DraftConfig) -> None:
    if cfg.mask_token_id < 0:
        raise Refused("the draft uses a learned mask vector (train.mask_token_id: -1); engines build the mask "
                      "slots from a token's embedding row: retrain with a reserved train.mask_token_id")


def require_plain_embeddings(cfg: DraftConfig, fmt: str) -> None:
    """For formats whose reference code embeds the draft's tokens with a plain nn.Embedding holding the
    verifier's rows (speculators: `embed_tokens` loaded by `load_verifier_weights`)."""
    if cfg.embed_scale != 1.0:
        raise Refused(f"the target scales its input embeddings by {cfg.embed_scale:g} (Gemma: sqrt(hidden_size)) "
                      f"and the draft was trained on those scaled rows; {fmt}'s draft models embed tokens with "
                      "the verifier's unscaled rows, so the exported draft would see other inputs than it was "
                      "trained on")


def require_target_width(cfg: DraftConfig) -> None:
    if cfg.hidden_size != cfg.target_hidden_size:
        raise Refused(f"draft width {cfg.hidden_size} differs from the target's {cfg.target_hidden_size}; "
                      "the engines size the feature projection as (number of layers x draft width)")


def _decoder_config(cfg: DraftConfig, dtype: str) -> dict:
    """The keys a Qwen3 and a Llama decoder-layer config share, from the draft's own config."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,            # older readers; transformers 5 reads rope_parameters
        "rope_parameters": cfg.rope(),
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def qwen3_layer_config(cfg: DraftConfig, dtype: str) -> dict:
    """The draft's decoder layers as a Qwen3 config, from the draft's own config (not the target's)."""
    return {"model_type": "qwen3", **_decoder_config(cfg, dtype), "attention_dropout": 0.0,
            "use_sliding_window": False, "sliding_window": None,
            "layer_types": ["full_attention"] * cfg.num_layers}


def llama_layer_config(cfg: DraftConfig, dtype: str) -> dict:
    """EAGLE-3's decoder layer as a Llama config (no q/k norm), from the draft's own config; `vocab_size`
    is the target's (the verifier's embedding), the draft head's size is `draft_vocab_size`."""
    return {"model_type": "llama", **_decoder_config(cfg, dtype), "mlp_bias": False}


def eagle3_tensors(draft) -> dict[str, torch.Tensor]:
    """fc, the decoder layer, norm, the draft-vocabulary lm_head and the vocabulary maps d2t/t2d: the names
    speculators' Eagle3 checkpoints and sglang's LlamaForCausalLMEagle3 loader use. No embeddings (the
    engines take the verifier's)."""
    keep = ("fc.", "layers.", "norm.", "lm_head.", "d2t", "t2d")
    return {k: v for k, v in draft.state_dict().items() if k.startswith(keep)}


def require_eagle3(cfg: DraftConfig, fmt: str) -> None:
    if cfg.algorithm != "eagle3":
        raise Refused(f"{fmt} holds EAGLE-3 drafts only (train.algorithm: eagle3); this is a {cfg.algorithm} "
                      "draft")


def backbone_tensors(draft: DraftModel) -> dict[str, torch.Tensor]:
    """Decoder layers, feature projection and norms: the names deepspec, speculators and dflash share."""
    keep = ("layers.", "fc.", "hidden_norm.", "norm.")
    return {k: v for k, v in draft.state_dict().items() if k.startswith(keep)}


def write_model_dir(out: Path, exported: Exported, dtype: str) -> list[str]:
    """config.json + model.safetensors into `out`, written beside it and renamed into place."""
    from safetensors.torch import save_file

    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to(DTYPES[dtype] if v.is_floating_point() else v.dtype).contiguous().cpu()
               for k, v in exported.tensors.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(exported.config, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return sorted(p.name for p in out.iterdir())
