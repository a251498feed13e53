"""Target models: what every stage needs to know about one (identity, layer count, layer checks).
How `target.source` becomes a model directory is `deepspec.models.prepare` (the target stage only).

The identity (hashes of config, weights, tokenizer files and chat template) travels into every
later output so a cache is never paired with the wrong model silently.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
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


def attention_implementation(model_dir: str | Path) -> str:
    """The attention kernel a target is run with here: transformers' SDPA where the architecture
    supports it and it computes what eager does; eager where it does not (attention-logit
    soft-capping, Gemma 2's, exists only in eager). Chosen from the config alone, so the cache stage
    names it in the store's manifest before loading any weight."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    import transformers

    config = AutoConfig.from_pretrained(model_dir)
    text = getattr(config, "text_config", config)
    if getattr(text, "attn_logit_softcapping", None):
        return "eager"
    name = (config.architectures or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, "")])[0]
    cls = getattr(transformers, name, None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"


def compute_dtype(device) -> str:
    """bfloat16 on a GPU (what serving engines run), float32 on a CPU (no fast bf16 matmul there)."""
    return "bfloat16" if getattr(device, "type", str(device)) == "cuda" else "float32"


def compute_settings(model_dir: str | Path, device) -> dict:
    """How the target's states are computed: part of what a cached value is a function of."""
    return {"dtype": compute_dtype(device), "attention": attention_implementation(model_dir)}


def compute_fingerprint(device) -> str:
    """The software and hardware a state is computed with, beyond the settings a store is named by:
    library versions and the device's model change the last bits of a forward pass (other kernels),
    so a cache part records the fingerprint it was computed under (docs/cache-format.md §7)."""
    import platform

    import torch
    import transformers

    device = torch.device(device)
    parts = [f"torch={torch.__version__}", f"transformers={transformers.__version__}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        parts += [f"cuda={torch.version.cuda}", f"device={props.name} sm_{props.major}{props.minor}"]
    else:
        parts += [f"device={device.type} {platform.machine()}"]
    return " ".join(parts)


def load_causal_lm(model_dir: str | Path, device, compute: dict | None = None):
    """The target as every stage runs it (`compute_settings`), in eval mode on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    compute = compute or compute_settings(model_dir, device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, compute["dtype"]),
                                                 attn_implementation=compute["attention"])
    return model.to(device).eval()


def cache_keyword(model) -> str:
    """The keyword `model`'s forward takes a KV cache under: transformers renamed `past_key_values` to
    `cache` within the 5.x versions deepspec supports, and an older forward files an unknown `cache=`
    among its ignored keyword arguments (every call would then run with no context)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class TargetEmbeddings:
    """Where a target's input embedding and lm_head live in its safetensors (a tied head is the
    embedding), and the factor its embedding module applies (Gemma: sqrt(hidden_size))."""
    embed: tuple[Path, str]     # (file, tensor name)
    head: tuple[Path, str]
    scale: float

    def read_into(self, embed, head, rows: int = 8192) -> None:
        """Copy both into `embed` and `head` ([V, H] tensors of any dtype), `rows` rows at a time: only
        a slice of the checkpoint is in memory at once, whatever the vocabulary."""
        import torch
        from safetensors import safe_open

        for (path, name), out in ((self.embed, embed), (self.head, head)):
            for a in range(0, out.shape[0], rows):
                # reopened for each slice: the file is memory-mapped while open, and the mapped pages
                # read so far would count in the process's resident memory until it is closed
                with safe_open(str(path), framework="pt") as f, torch.no_grad():
                    sl = f.get_slice(name)
                    if list(sl.get_shape()) != list(out.shape):
                        raise TargetError(f"{path}: {name} has shape {sl.get_shape()}, the draft expects "
                                          f"{list(out.shape)}")
                    out[a:a + rows].copy_(sl[a:a + rows])


def embed_scale(module) -> float:
    """What an embedding module multiplies its rows by: Gemma's scaled embedding keeps it as a float
    and a buffer; a plain nn.Embedding, 1."""
    import torch

    scale = getattr(module, "scalar_embed_scale", None) or getattr(module, "embed_scale", 1.0)
    return float(scale.item() if isinstance(scale, torch.Tensor) else scale)


def target_embeddings(model_dir: str | Path) -> TargetEmbeddings | None:
    """The names come from the model class built with empty weights; None when the checkpoint's
    names are not its modules' (transformers renames some on load): then only loading the model
    finds them."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):  # buffers stay real: Gemma's embed_scale is one
        skeleton = AutoModelForCausalLM.from_config(config)
    emb_module, head_module = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    names = {id(m): n for n, m in skeleton.named_modules()}
    emb_name, head_name = names[id(emb_module)] + ".weight", names[id(head_module)] + ".weight"
    scale = embed_scale(emb_module)
    tied = head_module.weight is emb_module.weight or bool(getattr(config.get_text_config(), "tie_word_embeddings",
                                                                   False))
    where: dict[str, tuple[Path, str]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in {emb_name, head_name} & set(f.keys()):
                where[name] = (path, name)
    if emb_name not in where or (head_name not in where and not tied):
        return None
    return TargetEmbeddings(where[emb_name], where.get(head_name, where[emb_name]), scale)


def embedding_weights(model_dir: str | Path, where: TargetEmbeddings | None = None):
    """(input embedding [V, H], lm_head [V, H], embedding scale) of a target, float32: read by name
    from the safetensors where target_embeddings finds them (or `where` says), else from the loaded
    model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    where = where or target_embeddings(model_dir)
    if where is None:
        log.info("%s: embedding and lm_head not found by name in its safetensors: loading the whole model",
                 model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        emb = model.get_input_embeddings()
        return emb.weight.detach(), model.get_output_embeddings().weight.detach(), embed_scale(emb)
    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    shape = (text.vocab_size, text.hidden_size)
    embed, head = torch.empty(shape, device="cpu"), torch.empty(shape, device="cpu")
    where.read_into(embed, head)
    return embed, head, where.scale


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
