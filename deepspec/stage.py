"""What every `stages/*.py` entry point shares: params loading, logging, clean errors."""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
from typing import Callable

from deepspec.config import ConfigError, Params
from deepspec.params import load_params
from deepspec.progress import quiet_library_bars


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
    quiet_library_bars()  # a log file gets deepspec's own progress lines, not redraws (deepspec.progress)
    try:
        main(load_params(params_path))
    except (ConfigError, StageError) as e:
        print(f"error: {e}", file=sys.stderr)
        bound_exit()
        sys.exit(2)
    except BaseException:
        bound_exit()
        raise


# How long a failed stage's interpreter shutdown may take (threads joined, C++ destructors run).
EXIT_GRACE_S = 60.0


def bound_exit() -> None:
    """A failed stage must end, or `dvc repro` and torchrun wait on it forever: if shutdown outlasts
    EXIT_GRACE_S, every thread's stack goes to stderr and the process exits with status 1."""
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)
