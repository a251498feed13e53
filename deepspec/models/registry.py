"""Every draft algorithm in one place: the model class each is built from, and loading a saved
draft directory (config.json + model.safetensors, models.draft.save_draft) as its own class."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from deepspec.models.draft import DraftModel, load_weights, read_draft_config
from deepspec.models.eagle3 import Eagle3Model

ALGORITHMS: dict[str, type[nn.Module]] = {"dspark": DraftModel, "dflash": DraftModel, "eagle3": Eagle3Model}


def load_draft(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """Any deepspec draft directory, as the model class of its algorithm; its weights in `dtype`
    (None: as trained) and the values it computes when built kept as computed (`in_dtype`)."""
    config = read_draft_config(path)
    if config.algorithm not in ALGORITHMS:
        raise ValueError(f"{path}: unknown draft algorithm {config.algorithm!r} (known: {sorted(ALGORITHMS)})")
    model = load_weights(ALGORITHMS[config.algorithm](config), path).to(device)
    return model if dtype is None else in_dtype(model, dtype)


def in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with its parameters and saved buffers in `dtype`, while the buffers it computes when
    built and never saves (RoPE's inverse frequencies) keep their precision, as transformers keeps a
    target's loaded in bf16: Module.to(bf16) would round them and move the draft's RoPE angles away
    from those it was trained with (by tenths of a radian a thousand positions in)."""
    saved = model.state_dict().keys()
    computed = {name: b for name, b in model.named_buffers() if name not in saved and b.is_floating_point()}
    model.to(dtype)
    for name, b in computed.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, b)
    return model
