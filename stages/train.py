"""DVC stage `train`: the cache + the target's embeddings/lm_head -> data/draft (see deepspec.train).

Runs as one process, or under `torchrun --nproc-per-node N stages/train.py` (DDP; gloo on CPU,
nccl on GPU). With `train.capture: read-through` it also writes the store's parts, each before it is
first trained on: in the training process (deepspec/cache/build/fill.py), or, with
`train.capture_ranks: k` under torchrun, on the last k ranks while the others train (fill_ranks.py);
the cache stage only planned them. Resume state lives in data/train_state/ (not a DVC output, so DVC
never deletes it), or at `train.state_url` (s3://…: ranks on several nodes share nothing but the
bucket); checkpoints made under other params are set aside, then deleted once this run has saved one
(README: "Training longer, and what a resume keeps").
"""
import json
from pathlib import Path

from deepspec.cache.build.fill import StoreFill, check_plan, stored
from deepspec.cache.build.fill_ranks import RanksFill, capture
from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.storage.naming import built_manifest, built_store_url
from deepspec.distributed import launch, split
from deepspec.stage import StageError, configure_threads, run_stage
from deepspec.train.checkpoint import CheckpointError
from deepspec.train.state_dir import StateDir
from deepspec.train.run import run_training
from deepspec.train.trainer import TrainError

REGEN, TARGET, PLANNED = Path("data/regen/train.jsonl"), Path("data/target"), "data/cache/manifest.json"
INDEX = Path("data/cache/index.npz")  # the cache stage's index of the input, used when it is current
# how long a capture rank waits for the trainers to finish (and a trainer for the plan): a whole run
RUN_S = 30 * 24 * 3600


def main(params):
    cfg = params.train
    configure_threads(cfg.threads)
    with launch(cfg.collective_timeout_s) as d:
        if cfg.algorithm == "eagle3" and cfg.layers is None and d.rank == 0:
            print(f"eagle3: train.layers not set, fusing cached layers {params.train_layers} (lowest, middle, highest "
                  f"of {params.layers}); set train.layers to choose three others", flush=True)
        final, error, fill = None, None, None
        try:
            if cfg.capture_ranks and cfg.capture != "read-through":
                raise TrainError("train.capture_ranks: capture ranks write a read-through run's parts; set "
                                 "train.capture: read-through, or capture_ranks: 0")
            state = StateDir(cfg.state_url or "data/train_state", cfg.state_storage_options)
            recorded = built_manifest()
            full = stored(recorded, params.cache.storage_options) if cfg.capture == "read-through" else None
            me = d
            if cfg.capture_ranks:  # the trainers are the same ranks whether or not the store is full yet
                if cfg.capture_ranks >= d.world:
                    raise TrainError(f"train.capture_ranks: {cfg.capture_ranks} of the launch's {d.world} ranks "
                                     "leaves none to train (launch more, e.g. torchrun --nproc-per-node "
                                     f"{cfg.capture_ranks + 1})")
                if d.multi:
                    full = d.share(full)  # every rank takes rank 0's view of the store
                roles = split(d, cfg.capture_ranks, RUN_S)
                me = roles.own
                if roles.capturing:
                    if full is None:
                        capture(params.cache, params.layers, REGEN, TARGET, roles, recorded, PLANNED, INDEX)
                    return
                fill = None if full is not None else RanksFill(roles, TARGET, params.cache.storage_options)
            if full is not None:  # filled by an earlier run: read as offline, nothing to plan or capture
                store, recorded = full["url"], full
            elif cfg.capture == "read-through":
                if fill is None:
                    if d.world > 1:
                        raise TrainError("train.capture: read-through under torchrun needs train.capture_ranks "
                                         "(the last ranks capture, the others train); in one process it captures "
                                         "on a thread of the trainer")
                    # the cache stage planned the store; this stage writes its parts as it trains on them
                    fill = StoreFill(params.cache, params.layers, REGEN, TARGET, d.device, index_from=INDEX)
                    try:
                        check_plan(fill.plan(), recorded, PLANNED)
                    except BaseException:
                        fill.abort()
                        raise
                else:
                    fill.plan()  # the capture ranks checked it against the cache stage's
                store = None
            else:
                store = built_store_url(params.cache.url)  # cache.url itself, or the stage's store in an S3 lake
            final = run_training(cfg, params.train_layers, store, TARGET, Path("data/draft"), Path("data/train"),
                                 state, params.cache.storage_options, me.rank, me.world, me.device,
                                 manifest=recorded, fill=fill, group=me.group)
        except (CacheFormatError, CheckpointError, TrainError) as e:
            error = str(e)  # only the message: the exception's frames hold the trainer and its DDP module
    if error:
        raise StageError(error)
    if d.rank == 0:
        print(json.dumps(final))


if __name__ == "__main__":
    run_stage(main)
