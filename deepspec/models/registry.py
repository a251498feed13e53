"""Every draft algorithm in one place: the model class each is built from, and loading a saved
draft directory (config.json + model.safetensors, models.draft.save_draft) as its own class."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from deepspec.models.draft import DraftModel, load_weights, read_draft_config
from deepspec.models.eagle3 import Eagle3Model

ALGORITHMS: dict[str, type[nn.Module]] = {"dspark": DraftModel, "dflash": DraftModel, "eagle3": Eagle3Model}


def load_draft(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Any deepspec draft directory, as the model class of its algorithm."""
    config = read_draft_config(path)
    if config.algorithm not in ALGORITHMS:
        raise ValueError(f"{path}: unknown draft algorithm {config.algorithm!r} (known: {sorted(ALGORITHMS)})")
    return load_weights(ALGORITHMS[config.algorithm](config), path).to(device)
