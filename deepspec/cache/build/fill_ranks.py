"""Read-through capture on ranks of their own (`train.capture_ranks: k` under torchrun): the last k
ranks of the launch run the cache stage's build (build_cache on k ranks) while the others train.

The build is the one fill.py runs on a thread of the trainer, joined through the same FillHooks; what
changes is where its messages go (distributed.Roles' side group). Capture rank 0 checks its plan
against the cache stage's and sends it to every trainer; trainer rank 0 sends back the order its
sampler's first epoch reads the parts in; the capture ranks write the parts the store lacks in that
order, every k-th each, and commit them. A trainer waits for a batch's parts by asking the store
whether each is committed, so trainers and capture ranks share nothing but the store (ranks on
several nodes, one bucket between them). When the trainers are done they meet the capture ranks once
more: the build switches the root to the plan, and capture rank 0 sends its report (the train stage's
metrics of what was captured).

A capture rank that fails, or is killed, ends the launch (torchrun stops every other rank, naming the
failed one and printing its error): a rerun keeps every committed part, computes only the others, and
resumes training from the newest checkpoint.
"""
from __future__ import annotations

import time
from pathlib import Path

from deepspec.cache.backends.readers import open_cache
from deepspec.cache.build.fill import FillError, Planned, check_plan, planned_samples, report_counts
from deepspec.cache.build.stage import FillHooks, build_cache
from deepspec.config import CacheConfig
from deepspec.distributed import Dist, Roles
from deepspec.models.tensor_parallel import Lockstep, follow


class CaptureHooks(FillHooks):
    """A capture rank's view of the build: the plan goes to the trainers, their order comes back, and
    the build's end waits for the trainers' (the root moves to the plan only after the last step)."""

    def __init__(self, roles: Roles, recorded: dict | None, where: str, lockstep=None):
        self.roles, self.recorded, self.where, self.lockstep = roles, recorded, where, lockstep
        self.current: str | None = None  # the part being written
        self._inputs: tuple | None = None

    def inputs(self, index, plan, rules) -> None:
        self._inputs = (index, plan, rules)

    def planned(self, url, manifest, rows, have) -> list[str] | None:
        message = None
        if self.roles.own.rank == 0:
            planned = Planned(url, manifest, rows)
            try:
                check_plan(planned, self.recorded, self.where)
                message = (planned, self._inputs, None)
            except FillError as e:
                message = (None, None, str(e))
        _, _, error = self.roles.send(message, self.roles.capture_root)
        if error:
            raise FillError(error)
        return self.roles.send(None, 0)

    def before_part(self, name: str) -> None:
        self.current = name

    def filled(self) -> None:
        self.current = None
        if self.lockstep is not None:  # its followers meet the trainers too
            self.lockstep.stop()
            self.lockstep = None
        self.roles.meet()


def capture(cfg: CacheConfig, layers: list[int], regen_path: Path, target_dir: Path, roles: Roles,
            recorded: dict | None, where: str, index_from: Path | None = None, also: tuple[str, ...] = (),
            sharded=None) -> dict:
    """A capture rank's whole run: the store built with the other capture ranks, in the trainers'
    order; returns capture rank 0's report (also sent to every trainer). `recorded`: the manifest the
    cache stage planned (at `where`), which the plan must equal. A failure raises FillError naming the
    part and the reason (the parts committed before it stay). `also`: build_cache's. `sharded`: with
    cache.tensor_parallel, (models.tensor_parallel.Groups of the capture ranks, the sharded target's
    loader): the groups' leads build, as capture ranks do, and their followers run each forward."""
    own, lockstep = roles.own, None
    if sharded is not None:
        groups, load = sharded
        if not groups.lead:
            return _follow_capture(roles, groups, load, own.device)
        lockstep = Lockstep(groups, load)
        own = Dist(groups.dp_rank, groups.dp_world, own.device, groups.dp_group, own.timeout)
    hooks = CaptureHooks(roles, recorded, where, lockstep)
    try:
        report = build_cache(cfg, layers, regen_path, target_dir, rank=own.rank, world=own.world, device=own.device,
                             share=own.share if own.multi else None, gather=own.gather if own.multi else None,
                             hooks=hooks, index_from=index_from, also=also, load=lockstep and lockstep.load)
    except FillError:
        raise
    except Exception as e:
        at = f" while writing part {hooks.current}" if hooks.current else ""
        raise FillError(f"capture rank {own.rank}: the read-through capture of {regen_path} failed{at}: "
                        f"{e.__class__.__name__}: {e}") from e
    finally:
        if hooks.lockstep is not None:  # a build that ended before filled(): release the followers
            hooks.lockstep.stop()
    return roles.send(report if roles.own.rank == 0 else None, roles.capture_root)


def _follow_capture(roles: Roles, groups, load, device) -> dict:
    """A follower's part in the capture: every message of the roles a capture rank takes part in
    (the plan, the trainers' order, the end of training, the report), and its lead's forwards between."""
    _, _, error = roles.send(None, roles.capture_root)
    if error:
        raise FillError(error)
    roles.send(None, 0)
    follow(groups, load, device)
    roles.meet()
    return roles.send(None, roles.capture_root)


class RanksFill:
    """A trainer's view of the capture ranks, with fill.StoreFill's interface: plan() -> compute(order)
    -> wait(names) per batch -> finish(). Every trainer calls plan, compute and finish (they are
    messages to all ranks)."""

    POLL_S = (0.02, 1.0)  # the first and the longest pause between two looks at a part's commit

    def __init__(self, roles: Roles, target_dir: Path, storage_options: dict | None = None):
        self.roles, self.target_dir, self.storage_options = roles, target_dir, storage_options
        self.report: dict | None = None
        self.wait_s = 0.0
        self._planned: Planned | None = None
        self._inputs: tuple | None = None
        self._store = None
        self._committed: set[str] = set()

    def plan(self) -> Planned:
        if self._planned is None:
            planned, inputs, error = self.roles.send(None, self.roles.capture_root)
            if error:
                raise FillError(error)
            self._planned, self._inputs = planned, inputs
            self._store = open_cache(planned.url, self.storage_options)
        return self._planned

    def compute(self, order: list[str]) -> None:
        self.roles.send(list(order) if self.roles.own.rank == 0 else None, 0)

    def wait(self, names) -> None:
        """Block until every part named is committed in the store."""
        t0 = time.perf_counter()
        for name in names:
            pause = self.POLL_S[0]
            while name not in self._committed:
                if self._store.part_committed(name):
                    self._committed.add(name)
                else:
                    time.sleep(pause)
                    pause = min(2 * pause, self.POLL_S[1])
        self.wait_s += time.perf_counter() - t0

    def idle(self) -> bool:
        return True  # no thread of this process writes: its loading processes start as an offline run's

    def samples(self):
        self.plan()
        return planned_samples(self.target_dir, *self._inputs)

    def finish(self) -> dict:
        self.roles.meet()
        self.report = self.roles.send(None, self.roles.capture_root)
        return self.report

    def abort(self) -> None:
        """Nothing to stop here: a trainer that fails ends the launch, and its launcher the capture ranks."""

    def counts(self) -> dict:
        return report_counts(self.report, self.wait_s)
