"""Where a process's tensors live, and the rules that keep device code right on any device.

- `local_device()`: the accelerator this process owns (`cuda:LOCAL_RANK`, what torchrun sets), else the CPU.
  Every stage picks its device here, so a GPU node never runs a stage on the CPU by omission.
- `generator(device, seed)`: a random generator on the device of the tensors it draws for; a CPU
  generator cannot draw for a CUDA tensor (PyTorch refuses), and a CUDA one cannot for a CPU tensor.
- `draw(probs, gen)`: one categorical draw per row, on the probabilities' device.
- `HostCopies`: device-to-host copies of a batch's tensors into pinned buffers, issued on a copy
  stream so that the compute stream starts the next forward meanwhile; the consumer waits for them
  (`HostBatch.result()`), usually on another thread. On the CPU a batch is already on the host.
- `writer_threads(device)`: how many threads a cache writer beside this device's forward passes
  writes on.
- `decoding(device)`: the attention kernels token-by-token decoding runs with (on CUDA, cuDNN after
  the kernels that need no set-up per shape).
"""
from __future__ import annotations

import collections
import contextlib
import os
import torch


def local_device() -> torch.device:
    """`cuda:LOCAL_RANK` when CUDA is available (LOCAL_RANK defaults to 0), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def writer_threads(device: torch.device | str) -> int:
    """Threads a cache writer fed by forward passes on `device` writes a part's arrays on
    (CacheWriter's `threads`). On the CPU one: the forward passes use every core already, and each
    writer thread more takes a core from them. Beside an accelerator, the cores this process may use
    (shared with the node's other ranks, LOCAL_WORLD_SIZE) less one for its own thread, at most 8: a
    GPU computes states faster than one thread checksums and writes them (docs/gpu-recipe.md)."""
    if torch.device(device).type == "cpu":
        return 1
    return max(1, min(8, _rank_cores() - 1))


def _rank_cores() -> int:
    """The cores this process may use, shared with the node's other ranks (LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


# loading processes beside an accelerator: gpu_check on an H200 (16 cores, one rank) waited for data
# 36 % of the run with none and under 3 % with 4
ACCELERATOR_LOADERS = 4


def loader_workers(setting: int | str, device: torch.device | str) -> int:
    """`train.num_workers` resolved for a trainer on `device`: a number as given; `auto` = on the CPU
    none (the loading processes take cores the step's own math uses: benchmarks/loader_workers.py),
    beside an accelerator ACCELERATOR_LOADERS, fewer where this rank's share of the cores (shared
    with the node's other ranks, LOCAL_WORLD_SIZE) leaves less than one core to the training process."""
    if setting != "auto":
        return int(setting)
    if torch.device(device).type == "cpu":
        return 0
    return max(1, min(ACCELERATOR_LOADERS, _rank_cores() - 1))


def separate_writer(device: torch.device | str) -> bool:
    """Whether a cache writer fed by forward passes on `device` runs in a process of its own
    (deepspec.cache.write.process_writer). Beside an accelerator: the forward passes are bound by
    the Python that launches their kernels, and a writer thread in their process takes the GIL each
    time an op gives it up, so they wait for it back many times a part (benchmarks/writeback_gil.py).
    On the CPU a thread: the forward passes spend their time in kernels that need no GIL, and a
    process costs its start-up. Only where shared memory files exist (Linux)."""
    return torch.device(device).type != "cpu" and hasattr(os, "memfd_create")


def decoding(device: torch.device | str) -> contextlib.AbstractContextManager:
    """A context for decoding on `device`: on CUDA, SDPA tries flash, then memory-efficient, then cuDNN
    attention, then the math kernel. Each decoding step meets a key length it has not met before, and
    PyTorch builds a cuDNN graph for every new shape (tens of milliseconds of host time on an H200,
    benchmarks/train_overlap.py), while it puts cuDNN first on Hopper and Blackwell once its cuDNN is
    recent; flash and memory-efficient attention have no such set-up. cuDNN stays ahead of the math
    kernel for the calls only it fuses (a mask with grouped-query heads; the drafts pad those to few
    shapes, models/attention.py). Elsewhere: no change."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH], set_priority=True)


def generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator on `device`, seeded with `seed` (its draws differ from a CPU generator's on another
    device type: a seed names a stream per device type, as PyTorch defines them)."""
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One index per row of `probs` ([V] -> [1], [B, V] -> [B, 1]), drawn with `gen` on the
    probabilities' own device; a generator of another device is refused here on every device
    (PyTorch refuses it only on CUDA), so a CPU test catches what a GPU run would meet."""
    if gen is not None and gen.device.type != probs.device.type:
        raise ValueError(f"a {gen.device.type} generator cannot draw for {probs.device.type} probabilities: "
                         "make it with deepspec.devices.generator(probs.device, seed)")
    return torch.multinomial(probs, 1, generator=gen)


class HostBatch:
    """Host copies of one batch's tensors: `result()` waits until they have landed (a no-op on the
    CPU) and returns the batch with every tensor as a numpy array (a view of its pinned buffer, which
    it keeps alive)."""

    def __init__(self, tensors: dict, event=None, device: torch.device | None = None):
        self._tensors, self._event, self._device = tensors, event, device

    def result(self) -> dict:
        if self._event is not None:
            # the waiting thread is the writer's, whose current device is cuda:0 however the rank's
            # was set (a thread's own): waiting there would open a context on another rank's GPU
            with torch.cuda.device(self._device):
                self._event.synchronize()
            self._event = None
        return {k: _map(lambda t: t.numpy(), v) for k, v in self._tensors.items()}


def landed(batches, ahead: int = 2):
    """The results of HostBatches as they are drawn from `batches`, each waited for only once `ahead`
    later ones were queued: the wait for a batch's copies then overlaps the next forward passes (as a
    writer's thread waiting beside the compute does), where waiting for each as it is yielded would hold
    the next forward until the copies landed."""
    pending = collections.deque()
    for batch in batches:
        pending.append(batch)
        if len(pending) > ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _map(fn, value):
    """`fn` over a tensor, or over each tensor of a tuple; None stays None."""
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(_map(fn, v) for v in value)
    return fn(value)


class HostCopies:
    """Copies tensors computed on `device` to the host without holding up the compute stream.

    On CUDA each `copy` makes the copy stream wait for what the compute stream has queued so far
    (the tensors' producers), copies every tensor into a freshly pinned buffer with
    `non_blocking=True` on that stream, tells the caching allocator the stream still reads the
    device tensors (`record_stream`), and records an event the consumer waits on. PyTorch's pinned
    allocator caches freed buffers and reuses one only after the copies that used it are done, so
    buffers cost one allocation per size, not one per batch. On the CPU nothing is copied."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def copy(self, tensors: dict) -> HostBatch:
        """`tensors`: {key: a tensor on self.device, a tuple of such tensors (or None), or None}."""
        if not self.cuda:
            return HostBatch({k: _map(torch.Tensor.detach, v) for k, v in tensors.items()})
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out = {k: _map(self._to_pinned, v) for k, v in tensors.items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        return HostBatch(out, event, self.device)

    def _to_pinned(self, t: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        buf.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # the compute stream may not reuse its memory before the copy ran
        return buf
