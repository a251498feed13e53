"""What every `stages/*.py` entry point shares: params loading, logging, clean errors."""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from deepspec.config import ConfigError, Params, load_params


class StageError(RuntimeError):
    """A failure the user can fix from the message alone (bad input, bad params, missing file)."""


def configure_threads(n: int) -> None:
    import torch

    if n > 0:
        torch.set_num_threads(n)


def run_stage(main: Callable[[Params], object], params_path: str = "params.yaml") -> None:
    # HF_HUB_OFFLINE is the user's to set (deepspec.hub): an `hf:` source must be able to download
    os.environ.setdefault("DVC_NO_ANALYTICS", "1")
    logging.basicConfig(level=os.environ.get("DEEPSPEC_LOG", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        main(load_params(params_path))
    except (ConfigError, StageError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
