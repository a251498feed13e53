"""DVC stage `train`: the cache + the target's embeddings/lm_head -> data/draft (see deepspec.train).

Runs as one process, or under `torchrun --nproc-per-node N stages/train.py` (DDP; gloo on CPU,
nccl on GPU). Resume state lives in data/train_state/ (not a DVC output, so DVC never deletes it);
checkpoints made under other params are pruned.
"""
import json
import os
import shutil
from pathlib import Path

import torch

from deepspec.cache.format import CacheFormatError
from deepspec.config import to_dict
from deepspec.io import fingerprint
from deepspec.loader.dataset import TargetCacheDataset
from deepspec.models.draft import DraftConfig, DraftModel
from deepspec.models.target import load_identity
from deepspec.stage import StageError, configure_threads, run_stage
from deepspec.train.callbacks import DvcLiveMetrics, JsonMetrics, ProgressBar
from deepspec.train.trainer import Trainer

TARGET, DRAFT, OUT, STATE = Path("data/target"), Path("data/draft"), Path("data/train"), Path("data/train_state")


def main(params):
    cfg = params.train
    configure_threads(cfg.threads)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if world > 1:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        identity = load_identity(TARGET)
        layers = params.train_layers
        try:
            dataset = TargetCacheDataset(params.cache.url, layers=layers, storage_options=params.cache.storage_options,
                                         expect={"target": identity})
        except CacheFormatError as e:
            raise StageError(str(e)) from None
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(cfg.seed)
        target_cfg = AutoConfig.from_pretrained(TARGET)
        draft_cfg = DraftConfig.for_target(cfg.algorithm, getattr(target_cfg, "text_config", target_cfg), layers,
                                           cfg.block_size, cfg.draft_layers, cfg.markov_rank, identity)
        model = DraftModel(draft_cfg)
        target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
        model.copy_target_embeddings(target)
        del target
        model.to(device)
        ddp = None
        if world > 1:
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=True)
        fp = fingerprint({"train": to_dict(cfg), "layers": layers, "target": identity["id"],
                          "cache": [dataset.manifest["parts"], dataset.manifest["dtype"]]})
        callbacks = [ProgressBar(), DvcLiveMetrics(OUT / "live"), JsonMetrics(OUT / "metrics.json")]
        if rank == 0 and (OUT / "live").exists() and not (STATE.exists() and any(STATE.iterdir())):
            shutil.rmtree(OUT / "live")  # a fresh run starts a fresh curve
        trainer = Trainer(model, dataset, cfg, STATE, fp, callbacks, rank, world, device, ddp)
        final = trainer.fit()
        if rank == 0:
            if DRAFT.exists():
                shutil.rmtree(DRAFT)
            model.save(DRAFT)
            print(json.dumps(final))
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_stage(main)
