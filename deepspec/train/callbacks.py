"""Trainer callbacks: each hook receives the trainer; none of them changes the optimisation."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from deepspec.progress import progress


log = logging.getLogger(__name__)

TIMINGS = frozenset({"wall_s", "data_wait_fraction"})  # final metrics that depend on the machine, kept to metrics.json


class Callback:
    def on_train_begin(self, trainer) -> None: ...
    def on_step_end(self, trainer, metrics: dict) -> None: ...
    def on_checkpoint(self, trainer, path: Path) -> None: ...
    def on_train_end(self, trainer) -> None: ...


class ProgressBar(Callback):
    def on_train_begin(self, trainer) -> None:
        self.bar = progress(total=trainer.cfg.steps, initial=trainer.state.step, desc="train", unit="step",
                        dynamic_ncols=True, disable=trainer.rank != 0)
        self.t0, self.tokens0 = time.time(), trainer.state.tokens

    def on_step_end(self, trainer, metrics: dict) -> None:
        rate = (trainer.state.tokens - self.tokens0) / max(time.time() - self.t0, 1e-6)
        self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", lr=f"{metrics['lr']:.2e}", tok_s=f"{rate:.0f}")
        self.bar.update(1)

    def on_train_end(self, trainer) -> None:
        self.bar.close()


class DvcLiveMetrics(Callback):
    """Per-step metrics and plots through dvclive (rank 0 only). On resume the history written
    before the crash is kept and logging continues at the restored step."""

    KEYS = ("loss", "ce", "l1", "conf", "tau_greedy", "tau_prob", "lr")

    def __init__(self, directory: str | Path, every: int = 1):
        self.directory = Path(directory)
        self.every = every
        self.live = None

    def on_train_begin(self, trainer) -> None:
        if trainer.rank != 0:
            return
        from dvclive import Live

        resume = trainer.state.step > 0
        if resume:
            self._drop_torn_summary()
        self.live = Live(str(self.directory), resume=resume, save_dvc_exp=False, dvcyaml=None,
                         report=None)
        if resume:
            self._truncate_history(trainer.state.step)

    def _drop_torn_summary(self) -> None:
        """dvclive rewrites its summary (metrics.json) in place at every step, and reads it back on
        resume: a run killed in the middle of that write left a file it cannot parse. The summary
        holds only the latest values (written again at the next step), so a torn one is removed."""
        summary = self.directory / "metrics.json"
        try:
            json.loads(summary.read_text())
        except FileNotFoundError:
            pass
        except ValueError:  # a torn or empty file (UnicodeDecodeError is a ValueError too)
            log.warning("train: %s was cut off by the interrupted run; it is written again at the next step",
                        summary)
            summary.unlink()

    def _truncate_history(self, step: int) -> None:
        """Drop rows logged after the restored checkpoint, and a last row the interrupted run left
        half written, so the curve has each step once."""
        for tsv in (self.directory / "plots" / "metrics").rglob("*.tsv"):
            lines = tsv.read_text().splitlines()
            header = lines[0].split("\t")
            col = header.index("step")
            keep, last = [lines[0]], 0
            for row in (ln.split("\t") for ln in lines[1:]):
                if len(row) == len(header) and all(row) and row[col].isdigit() and last < int(row[col]) <= step:
                    keep.append("\t".join(row))
                    last = int(row[col])
            tsv.write_text("\n".join(keep) + "\n")

    def on_step_end(self, trainer, metrics: dict) -> None:
        if self.live is None or trainer.state.step % self.every:
            return
        self.live.step = trainer.state.step  # 1-based: the optimizer step just taken
        for key in self.KEYS:
            if key in metrics:
                self.live.log_metric(f"train/{key}", metrics[key])
        self.live.next_step()

    def on_train_end(self, trainer) -> None:
        if self.live is None:
            return
        final = trainer.final_metrics
        for key, value in final.items():
            if key not in TIMINGS:  # data/train/live is a hashed output: it must not change run to run
                self.live.summary[key] = value
        self.live.make_summary()
        self.live.end()


class JsonMetrics(Callback):
    """Final metrics as a flat JSON file (what `dvc exp show` lists next to cache size and τ)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def on_train_end(self, trainer) -> None:
        if trainer.rank == 0:
            from deepspec.io import write_json

            write_json(self.path, trainer.final_metrics)
