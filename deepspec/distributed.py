"""The one distributed set-up every stage that runs under torchrun uses (cache, train).

`launch(timeout_s)` reads RANK / WORLD_SIZE / LOCAL_RANK, takes this process's device
(devices.local_device), makes it the current CUDA device *before* any collective (NCCL's object
collectives serialise to the current device: without it every rank lands on GPU 0), and, when the
world has more than one rank, makes the process group (NCCL on CUDA, gloo on the CPU) with the
stage's collective timeout. It yields a `Dist` whose barrier / share / gather every caller uses, and
takes the group down on the way out. No other module creates a process group or sets the device
(tests/test_devices.py keeps it so).
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
    rank: int
    world: int
    device: torch.device

    @property
    def multi(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.multi:
            dist.barrier()

    def share(self, value: Any) -> Any:
        return share(value, self.device) if self.multi else value

    def gather(self, value: Any) -> list:
        return gather(value, self.device) if self.multi else [value]


def share(value: Any, device: torch.device) -> Any:
    """Rank 0's `value` on every rank (of the default group)."""
    box = [value]
    dist.broadcast_object_list(box, src=0, device=_object_device(device))
    return box[0]


def gather(value: Any, device: torch.device) -> list:
    """Every rank's `value`, in rank order, on every rank. all_gather_object has no device argument:
    it uses the current CUDA device under NCCL, which `launch` has set."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _object_device(device: torch.device) -> torch.device | None:
    return device if dist.get_backend() == "nccl" else None


def world_from_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


@contextlib.contextmanager
def launch(timeout_s: float) -> Iterator[Dist]:
    rank, world = world_from_env()
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        if device.type == "cuda":  # device_id: NCCL binds its communicator to this GPU at once
            dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s), device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        yield Dist(rank, world, device)
    finally:
        if world > 1 and dist.is_initialized():
            # Free what holds the process group (DDP, a trainer) while the interpreter is whole: left to
            # interpreter shutdown, gloo's destructor joins its threads there and can hang the worker.
            gc.collect()
            dist.destroy_process_group()
