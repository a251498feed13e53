"""The one distributed set-up every stage that runs under torchrun uses (cache, train).

`launch(timeout_s)` reads RANK / WORLD_SIZE / LOCAL_RANK, takes this process's device
(devices.local_device), makes it the current CUDA device *before* any collective (NCCL's object
collectives serialise to the current device: without it every rank lands on GPU 0), and, when the
world has more than one rank, makes the process group (NCCL on CUDA, gloo on the CPU) with the
stage's collective timeout. It yields a `Dist` whose barrier / share / gather every caller uses, and
takes the group down on the way out. `split` divides such a world into trainers and capture ranks
(a read-through run's, deepspec/cache/build/fill_ranks.py), each role with a group of its own. No other
module creates a process group or sets the device (tests/test_devices.py keeps it so).
"""
from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from deepspec.devices import local_device


@dataclass(frozen=True)
class Dist:
    rank: int           # within `group`
    world: int
    device: torch.device
    group: Any = None   # None: the default group (every rank of the launch)
    timeout: timedelta | None = None  # the stage's, for the groups `split` makes (None: torch's default)

    @property
    def multi(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.multi:
            dist.barrier(group=self.group)

    def share(self, value: Any) -> Any:
        return share(value, self.device, self.group) if self.multi else value

    def gather(self, value: Any) -> list:
        return gather(value, self.device, self.group) if self.multi else [value]


def share(value: Any, device: torch.device, group=None) -> Any:
    """The `value` of rank 0 of `group` (None: the default group) on every rank of it."""
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0, device=_object_device(device, group))
    return box[0]


def gather(value: Any, device: torch.device, group=None) -> list:
    """Every rank's `value`, in rank order, on every rank of `group`. all_gather_object has no device
    argument: it uses the current CUDA device under NCCL, which `launch` has set."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _object_device(device: torch.device, group=None) -> torch.device | None:
    return device if dist.get_backend(group) == "nccl" else None


@dataclass(frozen=True)
class Roles:
    """A world split in two roles: the first world - k ranks train, the last k capture. `own` is this
    rank within its role's group; `side` is a gloo group of every rank for the few messages between the
    roles (the plan, the order, "training is done", the capture's report), whose waits span a whole
    training run, so its timeout is the run's, not a collective's."""
    capturing: bool
    own: Dist
    side: Any
    capture_root: int  # the global rank of capture rank 0 (the trainers' rank 0 is global rank 0)

    def send(self, value: Any, src: int) -> Any:
        """Global rank `src`'s `value` on every rank of the world."""
        box = [value]
        dist.broadcast_object_list(box, src=src, group=self.side)
        return box[0]

    def meet(self) -> None:
        dist.barrier(group=self.side)


def split(d: Dist, capture: int, wait_s: float) -> Roles:
    """Every rank of `d` (the default group) calls this, in the same order: the groups are made
    collectively. `wait_s`: how long one role may wait for the other (a whole run)."""
    if not 0 < capture < d.world:
        raise ValueError(f"capture ranks: {capture} of a world of {d.world} leaves no rank to train or none to capture")
    first = d.world - capture
    # each role's group waits as long as the launch's (a group made without a timeout gets the
    # backend's default: 10 minutes under NCCL, however long the stage may wait)
    groups = [dist.new_group(list(range(first)), timeout=d.timeout),
              dist.new_group(list(range(first, d.world)), timeout=d.timeout)]
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_s))
    capturing = d.rank >= first
    own = Dist(d.rank - first if capturing else d.rank, capture if capturing else first, d.device, groups[capturing],
               d.timeout)
    return Roles(capturing, own, side, first)


def world_from_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


@contextlib.contextmanager
def launch(timeout_s: float) -> Iterator[Dist]:
    rank, world = world_from_env()
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if world > 1:
        if device.type == "cuda":  # device_id: NCCL binds its communicator to this GPU at once
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    try:
        yield Dist(rank, world, device, timeout=timeout)
    finally:
        if world > 1 and dist.is_initialized():
            # Free what holds the process group (DDP, a trainer) while the interpreter is whole: left to
            # interpreter shutdown, gloo's destructor joins its threads there and can hang the worker.
            gc.collect()
            dist.destroy_process_group()
