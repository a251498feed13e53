"""A deterministic, distributed, resumable batch sampler.

Order is a pure function of (seed, epoch): a permutation of all samples or, with `window_parts` W
and each sample's part, the parts in a random order taken W at a time, the samples of each window in
a random order (a loader then reads W parts at a time: what a part mirror of a remote store needs,
deepspec/cache/read/mirror.py). `window_parts="growing"`: the first epoch's windows hold 2, 2, 4, 8,
... parts (each twice the last after the first two), so its first batches need only two parts and
its mixing widens as it goes (what a read-through run fills the store in); later epochs are a
permutation of all samples. Batches are either a
fixed number of samples or, with `token_budget`, as many samples as fit in (batch size x longest
length) <= budget; `group_by_length` sorts each window of 64 batches by length first so batches
waste less padding. Every rank gets every `world_size`-th batch of the same global sequence:
disjoint, and together covering every batch (the global batch count is cut to a multiple of the
world size so all ranks take the same number of steps). `state_dict()` records how many batches
this epoch has already produced, so a resumed run continues exactly where it stopped.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Sampler

from deepspec.cache.spec.plan import pack_ranges


GROWING = "growing"
FIRST_WINDOW = 2  # parts in a growing order's first window (and its second)


def window_bounds(parts: int, window_parts: int | str) -> list[tuple[int, int]]:
    """[a, b) ranges of the shuffled parts that make the windows: W at a time, or growing (2, 2, 4, 8...)."""
    if window_parts != GROWING:
        return [(a, min(a + window_parts, parts)) for a in range(0, parts, window_parts)]
    out, a, size = [], 0, FIRST_WINDOW
    while a < parts:
        out.append((a, min(a + size, parts)))
        a, size = a + size, size if a == 0 else 2 * size
    return out


class ResumableBatchSampler(Sampler[list[int]]):
    def __init__(self, lengths, batch_size: int = 1, token_budget: int | None = None, seed: int = 0,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, group_by_length: bool = False,
                 drop_last: bool = False, parts=None, window_parts: int | str = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        if window_parts != GROWING and (not isinstance(window_parts, int) or window_parts < 0):
            raise ValueError(f"window_parts={window_parts!r}: a number of parts >= 0, or {GROWING!r}")
        if window_parts and (parts is None or len(parts) != len(lengths)):
            raise ValueError(f"window_parts={window_parts} needs the part of each of the {len(lengths)} samples")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.parts = None if parts is None else np.asarray(parts, dtype=np.int64)
        self.window_parts = window_parts
        self.batch_size = batch_size
        self.token_budget = token_budget
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.group_by_length = group_by_length
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches already yielded (by this rank) in `epoch`
        # called with each batch before it is yielded (in the process that iterates the sampler, a
        # DataLoader's main one): a read-through run blocks there until the batch's parts are stored
        self.gate = None

    # ---- the plan --------------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.lengths)
        if not self.shuffle:
            return np.arange(n)
        g = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + epoch)  # a host-side plan
        if not self.window_parts or (self.window_parts == GROWING and epoch > 0):
            return torch.randperm(n, generator=g, device="cpu").numpy()
        by_part = np.argsort(self.parts, kind="stable")  # sample indices grouped by part, in part order
        _, starts, counts = np.unique(self.parts[by_part], return_index=True, return_counts=True)
        picked = torch.randperm(len(starts), generator=g, device="cpu").numpy()
        starts, counts = starts[picked], counts[picked]
        order = []
        for a, b in window_bounds(len(starts), self.window_parts):
            window = np.concatenate([by_part[s:s + c] for s, c in zip(starts[a:b], counts[a:b])])
            order.append(window[torch.randperm(len(window), generator=g, device="cpu").numpy()])
        return np.concatenate(order) if order else np.zeros(0, np.int64)

    def part_order(self, epoch: int) -> list[int]:
        """The parts (the values of `parts`) in the order `epoch` first reads them: with window_parts,
        window by window (what a read-through run computes them in); else the order in which the
        epoch's samples first touch each part."""
        order = self._order(epoch)
        if self.parts is None:
            return []
        _, first = np.unique(self.parts[order], return_index=True)
        return [int(p) for p in self.parts[order][np.sort(first)]]

    def global_batches(self, epoch: int) -> list[list[int]]:
        order = self._order(epoch)
        batches: list[list[int]] = []
        if self.token_budget is None:
            for i in range(0, len(order), self.batch_size):
                batch = order[i:i + self.batch_size].tolist()
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        else:
            window = max(1, self.batch_size) * 64
            for w in range(0, len(order), window):
                chunk = order[w:w + window]
                if self.group_by_length:
                    chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
                batches += [chunk[a:b].tolist() for a, b in pack_ranges(self.lengths[chunk], self.token_budget, padded=True)]
            if self.group_by_length:  # keep the length grouping, not the length order
                g = torch.Generator(device="cpu").manual_seed(self.seed * 7_919 + epoch)
                batches = [batches[i] for i in torch.randperm(len(batches), generator=g, device="cpu").tolist()]
        usable = len(batches) - len(batches) % self.world_size
        return batches[:usable]

    def batches(self, epoch: int) -> list[list[int]]:
        return self.global_batches(epoch)[self.rank::self.world_size]

    def __len__(self) -> int:
        return len(self.batches(self.epoch))

    def __iter__(self):
        mine = self.batches(self.epoch)
        while self.position < len(mine):
            batch = mine[self.position]
            if self.gate is not None:
                self.gate(batch)
            self.position += 1
            yield batch
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    # ---- resume ----------------------------------------------------------------------------------
    def state_dict(self, epoch: int | None = None, position: int | None = None) -> dict:
        """With a DataLoader the sampler runs ahead of training (prefetch): the trainer passes the
        epoch and the number of batches it has actually consumed."""
        return {"epoch": self.epoch if epoch is None else epoch,
                "position": self.position if position is None else position, "seed": self.seed,
                "world_size": self.world_size, "num_samples": int(len(self.lengths)),
                "batch_size": self.batch_size, "token_budget": self.token_budget, "window_parts": self.window_parts}

    def load_state_dict(self, state: dict) -> None:
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"sampler state was saved with world_size {state['world_size']}, this run has "
                f"{self.world_size}: rank slices would differ, so the position cannot be mapped exactly "
                "(restart the epoch with `position=0`, or resume with the original world size)")
        for key in ("seed", "num_samples", "batch_size", "token_budget", "window_parts"):
            mine = self.state_dict()[key]
            if state.get(key, mine) != mine:
                raise ValueError(f"sampler state has {key}={state[key]!r}, this run has {mine!r}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
