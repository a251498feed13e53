"""DVC stage `train`: the cache + the target's embeddings/lm_head -> data/draft (see deepspec.train).

Runs as one process, or under `torchrun --nproc-per-node N stages/train.py` (DDP; gloo on CPU,
nccl on GPU). With `train.capture: read-through` it also writes the store's parts, each before it is
first trained on: in the training process (deepspec/cache/build/fill.py), or, with
`train.capture_ranks: k` under torchrun, on the last k ranks while the others train (fill_ranks.py);
the cache stage only planned them (deepspec/train/source.py chooses), into a store beside cache.url
that is this stage's DVC output (data/cache-read-through.zarr; empty after an offline run), derived
from the cache stage's store where that one already holds the content. Resume state lives in
data/train_state/ (not a DVC output, so DVC never deletes it), or at `train.state_url` (s3://…: ranks
on several nodes share nothing but the bucket); checkpoints made under other params are set aside,
then deleted once this run has saved one (README: "Training longer, and what a resume keeps").
"""
import json
from pathlib import Path

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.storage.naming import built_manifest, read_through_url
from deepspec.cache.storage.urls import is_remote
from deepspec.distributed import launch
from deepspec.stage import StageError, configure_threads, run_stage
from deepspec.train.checkpoint import CheckpointError
from deepspec.train.source import training_source
from deepspec.train.state_dir import StateDir
from deepspec.train.run import run_training
from deepspec.train.trainer import TrainError

TARGET = Path("data/target")


def main(params):
    cfg = params.train
    configure_threads(cfg.threads)
    with launch(cfg.collective_timeout_s) as d:
        if cfg.algorithm == "eagle3" and cfg.layers is None and d.rank == 0:
            print(f"eagle3: train.layers not set, fusing cached layers {params.train_layers} (lowest, middle, highest "
                  f"of {params.layers}); set train.layers to choose three others", flush=True)
        final, error = None, None
        try:
            state = StateDir(cfg.state_url or "data/train_state", cfg.state_storage_options)
            # the cache stage's index of the input (data/cache/index.npz) is used when it is current
            src = training_source(params, d, built_manifest(), Path("data/regen/train.jsonl"), TARGET,
                                  "data/cache/manifest.json", Path("data/cache/index.npz"))
            if src is None:  # a capture rank, done
                return
            me = src.me
            final = run_training(cfg, params.train_layers, src.store, TARGET, Path("data/draft"), Path("data/train"),
                                 state, params.cache.storage_options, me.rank, me.world, me.device,
                                 manifest=src.recorded, fill=src.fill, group=me.group)
        except (CacheFormatError, CheckpointError, TrainError) as e:
            error = str(e)  # only the message: the exception's frames hold the trainer and its DDP module
    if error:
        raise StageError(error)
    if d.rank == 0:
        if not is_remote(params.cache.url):  # this stage's DVC output: the store a read-through run fills,
            Path(read_through_url(params.cache.url)).mkdir(parents=True, exist_ok=True)  # empty offline
        print(json.dumps(final))


if __name__ == "__main__":
    run_stage(main)
