"""Progress bars in a log file: plain lines at an interval, never carriage-return redraws."""
import io

import deepspec.progress as progress_mod
from deepspec.progress import progress


def test_a_log_gets_one_line_per_interval_and_a_last_one(monkeypatch):
    log = io.StringIO()  # not a terminal, as `dvc repro > log` or CI
    for _ in progress(range(5000), desc="cache", unit="tok", file=log):
        pass
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert 1 <= len(lines) <= 2 and lines[-1].startswith("cache: 100%") and "5000/5000" in lines[-1]
    monkeypatch.setattr(progress_mod, "LOG_INTERVAL_S", 0.0)  # every update a line, each one whole
    log = io.StringIO()
    with progress(total=3, desc="train", file=log) as bar:
        for _ in range(3):
            bar.update(1)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) >= 3 and all(line.startswith("train:") for line in lines)


def test_a_terminal_keeps_tqdms_redraws():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    for _ in progress(range(3), desc="x", file=tty, mininterval=0):
        pass
    assert "\r" in tty.getvalue()


def test_a_postfix_set_every_step_does_not_add_a_line_per_step():
    log = io.StringIO()
    with progress(total=1000, desc="train", file=log) as bar:
        for step in range(1000):
            bar.set_postfix(loss=f"{1 / (step + 1):.3f}")
            bar.update(1)
    lines = log.getvalue().splitlines()
    assert 1 <= len(lines) <= 2 and "loss=0.001" in lines[-1]
