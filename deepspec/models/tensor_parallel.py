"""A target sharded over a group of k ranks by transformers' own tensor-parallel plan (no sharding
written here), and the lockstep that keeps the group's ranks in the same forward passes.

Under `torchrun --nproc-per-node N` with `tensor_parallel: k`, the N ranks form N/k groups of k
consecutive ranks (`Groups`): a (dp, tp) device mesh. Every rank of a group loads the target sharded
k ways (`load_sharded`: the model's `base_model_tp_plan`, its q/k/v/gate/up split by columns, o/down by
rows, the embedding by vocabulary rows) and every forward pass is a collective of the group: after
each all-reduce the residual stream is whole on every rank, so the states a hook captures are full
tensors. The group's first rank (its lead) runs the stage as a rank of an N/k-rank data-parallel job
over the leads; the others (`follow`) do what it tells them over a gloo group of their own: load the
target with it, run each forward with its inputs, stop. A group's forward reduces in another order
than one device's, so its bits differ: the degree is part of what a store's states are computed with
(docs/cache-format.md §7).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from deepspec.distributed import share
from deepspec.models.capture import forward_capture

# a lead may plan, derive or wait for a lease for as long as a stage runs before its next forward
FOLLOW_TIMEOUT = timedelta(days=7)


def refuse_unshardable(config, k: int, where: str = "the target") -> None:
    """ValueError naming why `k` ranks cannot shard this config: transformers' plan splits attention by
    heads, and a head count k does not divide fails only at the first forward (a reshape of a width
    that is not a multiple of head_dim), after the load."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if k == 1:
        return
    if not getattr(text, "base_model_tp_plan", None):
        raise ValueError(f"{where} ({type(text).__name__}) has no tensor-parallel plan in transformers: "
                         f"tensor_parallel {k} needs one (set tensor_parallel: 1)")
    for field in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(text, field, None)
        if n is not None and n % k:
            raise ValueError(f"{where}: {field} = {n} does not split over tensor_parallel = {k} ranks "
                             f"(choose a k that divides both head counts)")


@contextlib.contextmanager
def _group_mesh(dense, expert, device: torch.device):
    """transformers (5.x) builds its mesh over the whole world; a (dp, tp) job hands it ours instead (made
    with the groups, not at a group's load), as its own `initialize_distributed_mesh` returns it, so each
    dp row shards within itself (no FSDP)."""
    import transformers.distributed.mixin as mixin
    from transformers.distributed.utils import TransformersDeviceMesh

    built = mixin.initialize_distributed_mesh
    mixin.initialize_distributed_mesh = lambda _config: (device, TransformersDeviceMesh(dense, expert))
    try:
        yield
    finally:
        mixin.initialize_distributed_mesh = built


def load_sharded(model_dir, compute: dict, groups: "Groups") -> torch.nn.Module:
    """The target of `model_dir` sharded over this rank's group (every rank of the group calls this
    together), in eval mode; refused when nothing was sharded (a plan that matched no weight)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    k = groups.k
    refuse_unshardable(AutoConfig.from_pretrained(model_dir), k, str(model_dir))
    with _group_mesh(*groups.meshes, groups.device):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, compute["dtype"]),
                                                     attn_implementation=compute["attention"],
                                                     distributed_config=DistributedConfig(tp_size=k))
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.get_decoder().layers.parameters()):
        raise ValueError(f"{model_dir}: transformers' tensor-parallel plan sharded none of its decoder weights")
    return model.eval()


@dataclass
class Groups:
    """This rank's place in a (dp, tp) job: `lead` runs the stage as rank `dp_rank` of `dp_world`, over
    `dp_group` (the leads' group, on a lead); `control` is its tp group's gloo group, `lead_rank` the
    global rank of its lead."""
    k: int
    dp_rank: int
    dp_world: int
    lead: bool
    lead_rank: int
    meshes: tuple      # transformers' dense and expert meshes of the groups (pp, dp_replicate, ..., tp / ep)
    dp_group: Any
    control: Any
    device: torch.device  # this rank's (devices.local_device: its CUDA device under torchrun)

    @classmethod
    def make(cls, rank: int, world: int, k: int, device: torch.device, ranks: list[int] | None = None,
             what: str = "the launch's") -> "Groups | None":
        """The groups of k of `ranks` (global ranks, consecutive; default the whole launch: the capture
        ranks of a read-through run are the launch's last ones), this rank's place in them, None on a
        rank outside them. Every rank of the launch calls this, in the same order: the groups are
        made collectively."""
        from torch.distributed.device_mesh import DeviceMesh

        ranks = list(range(world)) if ranks is None else list(ranks)
        if k < 1 or len(ranks) % k:
            raise ValueError(f"tensor_parallel = {k} does not divide {what} {len(ranks)} ranks (make their "
                             f"count a multiple of it)")
        n, grid = len(ranks) // k, torch.tensor(ranks, device="cpu")  # rank ids, not data
        mesh = DeviceMesh(device.type, grid.reshape(n, k), mesh_dim_names=("dp", "tp"))
        meshes = (DeviceMesh(device.type, grid.reshape(1, n, 1, k), mesh_dim_names=("pp", "dp_replicate", "fsdp",
                                                                                    "tp")),
                  DeviceMesh(device.type, grid.reshape(1, n, k, 1), mesh_dim_names=("pp", "dp_replicate", "efsdp",
                                                                                    "ep")))
        controls = [dist.new_group(ranks[g * k:(g + 1) * k], backend="gloo", timeout=FOLLOW_TIMEOUT) for g in range(n)]
        if rank not in ranks:
            return None
        at = ranks.index(rank)
        return cls(k, at // k, n, at % k == 0, ranks[at - at % k], meshes, mesh.get_group("dp"), controls[at // k],
                   device)

    def tell(self, message: Any) -> Any:
        """The lead's `message` on every rank of the group (the others pass None)."""
        return share(message, self.device, self.control)  # the lead is the control group's first rank


class Lockstep:
    """The lead's side: the sharded target, loaded and run together with the followers. A stage uses
    it as it uses a model (forward_capture runs `capture`); `stop()` releases the followers."""

    def __init__(self, groups: Groups, load: Callable[[], torch.nn.Module]):
        self.groups, self._load, self.model = groups, load, None

    def load(self) -> "Lockstep":
        self.groups.tell(("load",))
        self.model = self._load()
        return self

    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: list[int]):
        self.groups.tell(("forward", input_ids.cpu(), None if attention_mask is None else attention_mask.cpu(),
                          list(layer_ids)))
        return forward_capture(self.model, input_ids, attention_mask, layer_ids)

    def stop(self) -> None:
        self.groups.tell(("stop",))


def follow(groups: Groups, load: Callable[[], torch.nn.Module], device: torch.device) -> int:
    """A follower's whole stage: the lead's loads and forwards, until it stops; returns the forwards run."""
    model, forwards = None, 0
    while True:
        message = groups.tell(None)
        if message[0] == "stop":
            return forwards
        if message[0] == "load":
            model = load()
        elif message[0] == "forward":
            _, ids, mask, layer_ids = message
            forward_capture(model, ids.to(device), None if mask is None else mask.to(device), layer_ids)
            forwards += 1
