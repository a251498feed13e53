"""Read-through capture (`train.capture: read-through`): the cache stage's build, run on a thread of
the training process, writing the parts in the order the trainer will first read them.

The build is build_cache itself (stage.py), joined through its FillHooks: the same plan, the same
parts kept, derived or computed, the same writer, lease and commit, and at the end the same switch of
the root to the plan. So the store a read-through run leaves is the one the cache stage builds from
the same input, and a part the store already holds (another experiment's, or an earlier run's that
was killed) is read, never computed again. What the fill adds is timing: the trainer gets the plan
(`plan`: the planned manifest and per-sample index, enough to size and order every batch; `samples`:
every sample's tokens, encoded again) before a part is written, names the order it needs the parts
in (`compute`), and its sampler waits for a batch's parts (`wait`). The root is switched only after training ends (`finish`), because a local
derive writes next to the store and swaps the two at the end.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deepspec.cache.build.regen_rows import part_samples
from deepspec.cache.build.stage import FillHooks, build_cache, load_tokenizer
from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.spec.manifest import Manifest, manifest_mismatch
from deepspec.config import CacheConfig


class FillError(CacheFormatError):
    """The read-through capture failed or was stopped: the run stops, naming the part and the reason."""


class _Stopped(Exception):
    """Raised on the building thread when the trainer gives up (nothing uncommitted is kept)."""


@dataclass
class Planned:
    url: str            # where the parts are committed and read from
    manifest: Manifest  # stage.planned_manifest: content fields and every planned part, in plan order
    rows: np.ndarray    # its per-sample index rows (backends.base.index_rows)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.manifest.parts]


def check_plan(planned: Planned, recorded: dict | None, where: str) -> None:
    """Refuse to fill a store other than the one the cache stage planned (`recorded`, the manifest at
    `where`; None: no stage recorded one): same content fields, same parts in the same order."""
    if recorded is None:
        return
    why = manifest_mismatch(recorded, planned.manifest)
    if why is None:
        mine, theirs = planned.names, [p.get("name") for p in recorded.get("parts", [])]
        if mine != theirs:
            first = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            why = (f"parts: it lists {len(theirs)}, this run plans {len(mine)}; they differ from position {first} on")
    if why:
        raise FillError(f"{where}: the cache stage planned another store than this run would fill ({why}); run the "
                        "cache stage again (dvc repro). On a CPU the capture runs with train.threads, the cache stage "
                        "plans with cache.threads: they must agree")


def stored(recorded: dict | None, storage_options: dict | None = None) -> dict | None:
    """The store the cache stage planned (`recorded`: its data/cache/manifest.json), when it is already
    filled and consolidated with exactly the planned parts: its root manifest, with `url`; else None.
    A read-through run on such a store (a second experiment on the same data, target and layers) reads
    it as an offline run does, with nothing to plan, tokenise or capture."""
    from deepspec.cache.backends.readers import open_cache

    if not recorded or not recorded.get("url"):
        return None
    try:
        m = open_cache(recorded["url"], storage_options).read_manifest()
    except (CacheFormatError, OSError):
        return None
    names = [p.get("name") for p in recorded.get("parts", [])]
    if not m.consolidated or [p.name for p in m.parts] != names or manifest_mismatch(recorded, m):
        return None
    return dict(m.to_dict(), url=recorded["url"])


class StoreFill(FillHooks):
    """Builds the store for (cfg, layers, regen file, target) on a background thread, started at
    construction. Trainer side: plan() -> compute(order) -> wait(names) per batch -> finish(), or
    abort() when training fails."""

    def __init__(self, cfg: CacheConfig, layers: list[int], regen_path: Path, target_dir: Path,
                 device: torch.device | None = None, index_from: Path | None = None,
                 separate_writer: bool | None = None, also: tuple[str, ...] = ()):
        """`index_from`: the input's index the cache stage kept (stage.plan_cache's keep_index), used
        when it was made from this very input, so the plan comes without tokenising the input again.
        `separate_writer`, `also`: build_cache's (default: a writer process beside a GPU; none)."""
        self.cfg, self.layers, self.regen_path, self.target_dir = cfg, list(layers), regen_path, target_dir
        self.index_from, self.separate_writer, self.also = index_from, separate_writer, tuple(also)
        self.device = device or torch.device("cpu")
        self.report: dict | None = None
        self.wait_s = 0.0  # how long the trainer waited for parts
        self._planned: Planned | None = None
        self._inputs: tuple | None = None  # (RowIndex, plan, EncodeRules) the plan was made of
        self._order: list[str] | None = None
        self._committed: set[str] = set()
        self._current: str | None = None  # the part being written
        self._error: BaseException | None = None
        self._ended = False
        self._stop = False
        self._cond = threading.Condition()
        self._plan_ready, self._order_given = threading.Event(), threading.Event()
        self._training_done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="read-through-fill", daemon=True)
        self._thread.start()

    # ---- the building thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.report = build_cache(self.cfg, self.layers, self.regen_path, self.target_dir, device=self.device,
                                      hooks=self, index_from=self.index_from,
                                      separate_writer=self.separate_writer, also=self.also)
        except BaseException as e:  # handed to the trainer at its next plan/wait/finish
            self._error = e
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()
            self._plan_ready.set()

    def _await(self, event: threading.Event) -> None:
        while not event.wait(0.5):
            if self._stop:
                raise _Stopped()
        if self._stop:
            raise _Stopped()

    def inputs(self, index, plan, rules) -> None:
        self._inputs = (index, plan, rules)

    def planned(self, url: str, manifest: Manifest, rows: np.ndarray, have: set[str]) -> list[str] | None:
        with self._cond:
            self._planned = Planned(url, manifest, rows)
            self._committed |= have
            self._cond.notify_all()
        self._plan_ready.set()
        self._await(self._order_given)
        return self._order

    def before_part(self, name: str) -> None:
        if self._stop:
            raise _Stopped()
        self._current = name

    def committed(self, name: str) -> None:
        with self._cond:
            self._committed.add(name)
            self._cond.notify_all()

    def filled(self) -> None:
        self._current = None
        self._await(self._training_done)

    # ---- the trainer's side ----------------------------------------------------------------------
    def _failure(self, what: str) -> FillError:
        if isinstance(self._error, _Stopped):
            return FillError(f"{what}: the read-through capture was stopped")
        where = f" while writing part {self._current}" if self._current else ""
        return FillError(f"{what}: the read-through capture of {self.regen_path} failed{where}: "
                         f"{self._error.__class__.__name__}: {self._error}")

    def plan(self) -> Planned:
        """The store's plan (blocks while the regen file is indexed; raises what the build raised)."""
        self._plan_ready.wait()
        if self._planned is None:
            if isinstance(self._error, CacheFormatError):  # the input's own error (an empty input, a bad row)
                raise self._error
            raise self._failure("planning the store")
        return self._planned

    def compute(self, order: list[str]) -> None:
        """Write the parts the store lacks in this order (names of the plan; any left out come last)."""
        self._order = list(order)
        self._order_given.set()

    def committed_parts(self) -> set[str]:
        with self._cond:
            return set(self._committed)

    def wait(self, names) -> None:
        """Block until every part named is committed; raises FillError if the capture failed first."""
        t0 = time.perf_counter()
        with self._cond:
            for name in names:
                while name not in self._committed:
                    if self._ended:
                        raise self._failure(f"part {name} is needed for training but not stored")
                    self._cond.wait(1.0)
        self.wait_s += time.perf_counter() - t0

    def idle(self) -> bool:
        """Every planned part is committed: the fill's threads only wait (for finish) from now on."""
        with self._cond:
            return self._planned is not None and all(p.name in self._committed for p in self._planned.manifest.parts)

    def samples(self):
        """Every planned sample's tokens ({"input_ids": int32, "loss_mask": uint8} tensors), part by
        part in plan order, encoded again from the regen file by the plan's own rules with a tokenizer
        of the calling thread: what the store holds, for what needs every sample's tokens before its
        first step (EAGLE-3's vocabulary, a mask token), without waiting for the store to fill."""
        self.plan()
        return planned_samples(self.target_dir, *self._inputs)

    def finish(self) -> dict:
        """Training is over: let the build switch the root to the plan (after writing any part training
        never read) and return its report."""
        if not self._order_given.is_set():
            self.compute(self.plan().names)
        self._training_done.set()
        self._thread.join()
        if self._error is not None:
            raise self._failure("finishing the store")
        return self.report

    def abort(self) -> None:
        """Training failed: stop after the part being written (committed parts stay) and release the store."""
        self._stop = True
        self._thread.join()

    def counts(self) -> dict:
        """What this run captured, for the train stage's metrics (finish() first)."""
        return report_counts(self.report, self.wait_s)


def report_counts(report: dict | None, wait_s: float) -> dict:
    """The train stage's capture metrics of a build's report (build_cache's), and the trainer's wait."""
    r = report or {}
    derive = r.get("derive") or {}
    return {"target_forwards": int(r.get("target_forwards", 0)), "parts_computed": int(derive.get("parts_computed", 0)),
            "parts_derived": int(derive.get("parts_derived", 0)), "parts_kept": int(r.get("parts_kept", 0)),
            "tokens_computed": int(r.get("tokens_computed", 0)), "wait_for_parts_s": round(wait_s, 2)}


def planned_samples(target_dir: Path, index, plan, rules):
    """Every planned sample's tokens ({"input_ids": int32, "loss_mask": uint8} tensors), part by part in
    plan order, encoded from the regen file the index was made of, by the plan's rules (FillHooks.inputs)."""
    for _, samples in part_samples(load_tokenizer(target_dir), index, plan, rules):
        for s in samples:
            yield {"input_ids": torch.tensor(s.input_ids, dtype=torch.int32, device="cpu"),
                   "loss_mask": torch.tensor(s.loss_mask, dtype=torch.uint8, device="cpu")}
