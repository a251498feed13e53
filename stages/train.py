"""DVC stage `train`: the cache + the target's embeddings/lm_head -> data/draft (see deepspec.train).

Runs as one process, or under `torchrun --nproc-per-node N stages/train.py` (DDP; gloo on CPU,
nccl on GPU). With `train.capture: read-through` (one process) it also writes the store's parts,
each before it is first trained on (deepspec/cache/build/fill.py): the cache stage only planned them.
Resume state lives in data/train_state/ (not a DVC output, so DVC never deletes it), or
at `train.state_url` (s3://…: ranks on several nodes share nothing but the bucket);
checkpoints made under other params are set aside, then deleted once this run has saved one
(README: "Training longer, and what a resume keeps").
"""
import json
from pathlib import Path

from deepspec.cache.build.fill import StoreFill, check_plan, stored
from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.storage.naming import built_manifest, built_store_url
from deepspec.distributed import launch
from deepspec.stage import StageError, configure_threads, run_stage
from deepspec.train.checkpoint import CheckpointError
from deepspec.train.state_dir import StateDir
from deepspec.train.run import run_training
from deepspec.train.trainer import TrainError


def main(params):
    cfg = params.train
    configure_threads(cfg.threads)
    with launch(cfg.collective_timeout_s) as d:
        if cfg.algorithm == "eagle3" and cfg.layers is None and d.rank == 0:
            print(f"eagle3: train.layers not set, fusing cached layers {params.train_layers} (lowest, middle, highest "
                  f"of {params.layers}); set train.layers to choose three others", flush=True)
        final, error, fill = None, None, None
        try:
            state = StateDir(cfg.state_url or "data/train_state", cfg.state_storage_options)
            recorded = built_manifest()
            full = stored(recorded, params.cache.storage_options) if cfg.capture == "read-through" else None
            if full is not None:  # filled by an earlier run: read as offline, nothing to plan or capture
                store, recorded = full["url"], full
            elif cfg.capture == "read-through":
                if d.world > 1:
                    raise TrainError("train.capture: read-through runs in one process (train.launcher: python); "
                                     "train on several ranks offline, from the store the cache stage builds")
                # the cache stage planned the store; this stage writes its parts as it trains on them
                fill = StoreFill(params.cache, params.layers, Path("data/regen/train.jsonl"), Path("data/target"),
                                 d.device, index_from=Path("data/cache/index.npz"))  # the cache stage's, if current
                try:
                    check_plan(fill.plan(), recorded, "data/cache/manifest.json")
                except BaseException:
                    fill.abort()
                    raise
                store = None
            else:
                store = built_store_url(params.cache.url)  # cache.url itself, or the stage's store in an S3 lake
            final = run_training(cfg, params.train_layers, store, Path("data/target"), Path("data/draft"),
                                 Path("data/train"), state, params.cache.storage_options,
                                 d.rank, d.world, d.device, manifest=recorded, fill=fill)
        except (CacheFormatError, CheckpointError, TrainError) as e:
            error = str(e)  # only the message: the exception's frames hold the trainer and its DDP module
    if error:
        raise StageError(error)
    if d.rank == 0:
        print(json.dumps(final))


if __name__ == "__main__":
    run_stage(main)
