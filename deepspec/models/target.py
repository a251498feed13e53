"""Target models: what every stage needs to know about one (identity, layer count, layer checks).
How `target.source` becomes a model directory is `deepspec.models.prepare` (the target stage only).

The identity (hashes of config, weights, tokenizer files and chat template) travels into every
later output so a cache is never paired with the wrong model silently.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from deepspec.config import ConfigError, SamplingConfig
from deepspec.io import fingerprint, sha256_file

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")


class TargetError(ValueError):
    pass


def check_layers(layers: list[int], num_layers: int, what: str = "layers") -> None:
    """Valid ids are -1 (embeddings) .. num_layers-2; the final layer's hooked output is not the
    normed state the draft trains against, so (as in the reference) it cannot be cached."""
    bad = [i for i in layers if i < -1 or i > num_layers - 2]
    if bad:
        raise ConfigError(f"{what}: {bad} out of range for a target with {num_layers} decoder layers "
                          f"(valid: -1 .. {num_layers - 2}; the final layer {num_layers - 1} is excluded)")


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.exists():
        raise TargetError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
    cfg = json.loads(path.read_text())
    return cfg.get("text_config", cfg) | {"architectures": cfg.get("architectures") or []}


def num_hidden_layers(model_dir: Path) -> int:
    return int(read_config(model_dir)["num_hidden_layers"])


def validate_model_dir(model_dir: Path) -> None:
    """Cheap checks first (config, architecture, chat template), then that it really loads."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not model_dir.is_dir():
        raise TargetError(f"{model_dir}: not a directory")
    cfg = read_config(model_dir)
    archs = cfg["architectures"]
    config = AutoConfig.from_pretrained(model_dir)
    causal = any(a.endswith("ForCausalLM") or a.endswith("ForConditionalGeneration") for a in archs) or (
        not archs and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if not causal:
        raise TargetError(f"{model_dir}: architectures {archs or [config.model_type]} is not a causal LM")
    if not any((model_dir / f).exists() for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        raise TargetError(f"{model_dir}: no *.safetensors weights")
    tok = AutoTokenizer.from_pretrained(model_dir)
    if not tok.chat_template:
        raise TargetError(f"{model_dir}: tokenizer has no chat template")


def identity(model_dir: Path) -> dict:
    from transformers import AutoTokenizer

    cfg = read_config(model_dir)
    weights = sorted(p for p in model_dir.iterdir() if p.suffix == ".safetensors")
    tok_files = sorted(f for f in TOKENIZER_FILES if (model_dir / f).exists())
    template = AutoTokenizer.from_pretrained(model_dir).chat_template
    ident = {
        "architecture": (cfg["architectures"] or [cfg.get("model_type", "?")])[0],
        "hidden_size": int(cfg["hidden_size"]),
        "num_layers": int(cfg["num_hidden_layers"]),
        "vocab_size": int(cfg["vocab_size"]),
        "config_sha256": sha256_file(model_dir / "config.json"),
        "weights_sha256": fingerprint({p.name: sha256_file(p) for p in weights}),
        "tokenizer_sha256": fingerprint({f: sha256_file(model_dir / f) for f in tok_files}),
        "chat_template_sha256": fingerprint(template),
    }
    ident["id"] = fingerprint(ident)[:16]
    return ident


def load_identity(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "identity.json"
    if not path.exists():
        raise TargetError(f"{path}: missing (run the target stage first)")
    return json.loads(path.read_text())


def default_generation_config(eos_token_id, pad_token_id, **extra):
    """The generation_config a target made here ships: `sampling`'s defaults (params.yaml), so plain
    `generate` and a server that reads the model's own config sample like the pipeline does."""
    from transformers import GenerationConfig

    s = SamplingConfig()
    return GenerationConfig(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                            min_p=s.min_p or None, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **extra)
