"""Where a train stage's samples come from (`train.capture`): the store the cache stage built
(offline); under read-through, a store an earlier run filled (read as offline), or a fill that
writes the planned parts while this run trains on them, on a thread of the trainer (fill.py) or, with
`train.capture_ranks: k` under torchrun, on the last k ranks of the launch (fill_ranks.py), which
this returns from only when their part is done."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from deepspec.cache.build.fill import StoreFill, check_plan, stored
from deepspec.cache.build.fill_ranks import RanksFill, capture
from deepspec.cache.storage.naming import built_store_url, read_through_url
from deepspec.cache.storage.urls import is_remote
from deepspec.distributed import Dist, split
from deepspec.models.target import compute_settings
from deepspec.models.tensor_parallel import Groups, load_sharded
from deepspec.train.trainer import TrainError

# how long a capture rank waits for the trainers to finish (and a trainer for the plan): a whole run
RUN_S = 30 * 24 * 3600


def capture_groups(params, d: Dist, target: Path):
    """(the capture ranks' tensor-parallel groups, the sharded target's loader), made on every rank of
    the launch (the groups are collective); the trainers get (None, ...)."""
    k, c = params.cache.tensor_parallel, params.train.capture_ranks
    try:
        groups = Groups.make(d.rank, d.world, k, d.device, ranks=list(range(d.world - c, d.world)),
                             what="train.capture_ranks'")
    except ValueError as e:
        raise TrainError(f"cache.tensor_parallel: {e}") from None
    return groups, lambda: load_sharded(target, compute_settings(target, d.device), groups)


@dataclass
class Source:
    store: str | None             # the store to read (None: the fill's plan names it)
    recorded: dict | None         # the manifest the trainer reads exactly the parts of
    fill: StoreFill | RanksFill | None
    me: Dist                      # this rank among the trainers


def training_source(params, d: Dist, recorded: dict | None, regen: Path, target: Path, planned_at: str,
                    index: Path) -> Source | None:
    """`recorded`: the cache stage's manifest (at `planned_at`; under read-through its plan). None on
    a capture rank, once its capture is done."""
    cfg = params.train
    if cfg.capture_ranks and cfg.capture != "read-through":
        raise TrainError("train.capture_ranks: capture ranks write a read-through run's parts; set "
                         "train.capture: read-through, or capture_ranks: 0")
    full = stored(recorded, params.cache.storage_options) if cfg.capture == "read-through" else None
    # a read-through run fills a store of its own beside cache.url (naming.read_through_url), derived from
    # the cache stage's store where that one holds the content
    fill_cfg = replace(params.cache, url=read_through_url(params.cache.url))
    also = () if is_remote(params.cache.url) else (params.cache.url,)
    me, fill = d, None
    if cfg.capture_ranks:  # the trainers are the same ranks whether or not the store is full yet
        if cfg.capture_ranks >= d.world:
            raise TrainError(f"train.capture_ranks: {cfg.capture_ranks} of the launch's {d.world} ranks leaves none "
                             f"to train (launch more, e.g. torchrun --nproc-per-node {cfg.capture_ranks + 1})")
        full = d.share(full)  # every rank takes rank 0's view of the store
        roles = split(d, cfg.capture_ranks, RUN_S)
        me = roles.own
        sharded = capture_groups(params, d, target) if params.cache.tensor_parallel > 1 else None
        if roles.capturing:
            if full is None:
                capture(fill_cfg, params.layers, regen, target, roles, recorded, planned_at, index, also, sharded)
            return None
        if full is None:
            fill = RanksFill(roles, target, params.cache.storage_options)
            fill.plan()  # the capture ranks checked it against the cache stage's
    if full is not None:  # filled by an earlier run: read as offline, nothing to plan or capture
        return Source(full["url"], full, None, me)
    if cfg.capture != "read-through":
        return Source(built_store_url(params.cache.url), recorded, None, me)  # cache.url, or its store in a lake
    if fill is None:
        if params.cache.tensor_parallel > 1:
            raise TrainError(f"train.capture: read-through with cache.tensor_parallel {params.cache.tensor_parallel} "
                             "needs train.capture_ranks (a multiple of it): the capture ranks shard the target")
        if d.world > 1:
            raise TrainError("train.capture: read-through under torchrun needs train.capture_ranks (the last ranks "
                             "capture, the others train); in one process it captures on a thread of the trainer")
        # the cache stage planned the store; this stage writes its parts as it trains on them
        fill = StoreFill(fill_cfg, params.layers, regen, target, d.device, index_from=index, also=also)
        try:
            check_plan(fill.plan(), recorded, planned_at)
        except BaseException:
            fill.abort()
            raise
    return Source(None, recorded, fill, me)
