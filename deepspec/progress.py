"""Progress bars a person can read in a terminal and in a log file.

In a terminal this is tqdm as usual. When stderr is not a terminal (`dvc repro > log`, CI, a
scheduler's log) tqdm would still redraw its bar with carriage returns ten times a second, so a
log holds thousands of overwritten updates per stage; here the bar instead writes one plain line
every LOG_INTERVAL_S seconds, and a final one when it closes.
"""
from __future__ import annotations

import os
import sys

from tqdm import tqdm

LOG_INTERVAL_S = float(os.environ.get("DEEPSPEC_PROGRESS_INTERVAL_S", 10))


class _Lines:
    """A stream for tqdm that turns each redraw ('\\r' + bar) into one line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def interactive(stream=None) -> bool:
    stream = stream or sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


class _Bar(tqdm):
    """tqdm whose set_postfix does not redraw by itself: the next update() shows it, at the bar's
    interval (tqdm's default redraws on every call, a log line per training step)."""

    def set_postfix(self, ordered_dict=None, refresh=False, **kwargs):
        super().set_postfix(ordered_dict, refresh=refresh, **kwargs)


def progress(iterable=None, **kwargs) -> tqdm:
    """tqdm(iterable, **kwargs), line by line every LOG_INTERVAL_S seconds when stderr is not a terminal."""
    if interactive(kwargs.get("file")):
        kwargs.setdefault("dynamic_ncols", True)
    else:
        kwargs["file"] = _Lines(kwargs.get("file") or sys.stderr)
        kwargs["mininterval"] = kwargs["maxinterval"] = LOG_INTERVAL_S
        kwargs["miniters"] = 1
        kwargs.pop("dynamic_ncols", None)
        kwargs.setdefault("ncols", 100)
        kwargs.setdefault("ascii", True)
    return _Bar(iterable, **kwargs)


def quiet_library_bars() -> None:
    """transformers' and huggingface_hub's own bars (weights loading, downloads) redraw the same way:
    off when stderr is not a terminal."""
    if not interactive():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass
