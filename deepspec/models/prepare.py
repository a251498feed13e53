"""The target stage: `target.source` -> a standard HF model directory with identity.json and metrics.json.

Kept apart from `deepspec.models.target` so the later stages, which only read a target's identity,
do not depend on how a target is built (`builtin:tiny` pulls in the tokenizer trainer and corpus).
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

from deepspec.config import TargetConfig
from deepspec.io import write_json
from deepspec.models.target import (TargetError, _copy_model_dir, check_layers, download_hf, export_smollm2, identity,
                                    num_hidden_layers, parse_source, validate_model_dir)


def prepare_target(cfg: TargetConfig, layers: list[int], corpus: Callable[[], list[dict]], out_dir: Path) -> dict:
    """Produce out_dir as a standard HF model dir plus identity.json and metrics.json.
    `corpus()` gives the training conversations of `builtin:tiny` (called only for that source)."""
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
        from deepspec.models.tiny import train_tiny

        metrics |= train_tiny(cfg.tiny, corpus(), cfg.seed, out_dir)
    elif kind == "smollm2":
        export_smollm2(out_dir)
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
