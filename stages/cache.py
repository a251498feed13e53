"""DVC stage `cache`: data/regen/train.jsonl + data/target -> the Zarr cache (see deepspec.cache.build.stage).

Runs as one process, or under `torchrun --nproc-per-node N stages/cache.py` (each rank writes its
own parts of a disjoint sample range; rank 0 holds the store's lease, writes the manifest and the
metrics). The store written is `cache.url` itself for a local path, `<cache.url>/<store key>` for a
remote lake (docs/cache-format.md §9); data/cache/manifest.json records its full URL for `train`.
With `train.capture: read-through` the stage only plans the store (data/cache/manifest.json then
lists the parts to come, not consolidated) and the train stage writes the parts as it trains, into
a store of its own beside cache.url (data/cache-read-through.zarr, its DVC output).
"""
import json
from dataclasses import replace
from pathlib import Path

from transformers import AutoConfig

from deepspec.cache.build.stage import build_cache, plan_cache
from deepspec.cache.storage.naming import read_through_url
from deepspec.cache.storage.urls import is_remote, local_path
from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.tools.verify import disk_usage
from deepspec.distributed import Dist, launch
from deepspec.io import write_json
from deepspec.models.target import compute_settings
from deepspec.models.tensor_parallel import Groups, Lockstep, follow, load_sharded, refuse_unshardable
from deepspec.stage import StageError, configure_threads, run_stage


KEPT_INDEX = "data/cache/index.npz"  # the read-through plan's index of the input, for the train stage


def split_timings(report: dict) -> dict:
    """Remove the wall-clock fields (and how the rows were shared among ranks) from the build report,
    in place, and return them: the report is a function of the input, the metrics of the run."""
    times = {k: report.pop(k) for k in ("wall_s", "forward_s", "load_s", "rows_indexed_by_rank", "target_forwards",
                                        "tokens_computed") if k in report}
    if isinstance(report.get("derive"), dict) and "wall_s" in report["derive"]:
        times["derive_wall_s"] = report["derive"].pop("wall_s")
    return times


def plan_only(params, d) -> None:
    """train.capture: read-through: the plan and nothing else (the train stage writes the parts). Every
    rank indexes its share of the input; rank 0 writes the outputs and keeps the index for train
    (data/cache/index.npz: not a DVC output, a train stage without it indexes the input itself)."""
    cfg = params.cache
    try:
        report = plan_cache(replace(cfg, url=read_through_url(cfg.url)), params.layers,
                            Path("data/regen/train.jsonl"), Path("data/target"), d.device, d.rank, d.world, d.gather,
                            keep_index=Path(KEPT_INDEX))
    except CacheFormatError as e:
        raise StageError(str(e)) from None
    if d.rank != 0:
        return
    manifest = report.pop("manifest")
    if not is_remote(cfg.url):
        # this stage's DVC output, left as it is (an earlier offline build's store, or empty): the train
        # stage fills the planned store beside it (naming.read_through_url), its own output
        Path(local_path(cfg.url)).mkdir(parents=True, exist_ok=True)
    metrics = {"samples": manifest["num_samples"], "tokens": manifest["num_tokens"], "parts": len(manifest["parts"]),
               "layers": len(manifest["layers"]), "mode": "planned (train.capture: read-through)"}
    metrics |= split_timings(report)
    write_json("data/cache/metrics.json", metrics)
    write_json("data/cache/report.json", report)
    write_json("data/cache/manifest.json", manifest)
    print(json.dumps(metrics))


def main(params):
    cfg = params.cache
    configure_threads(cfg.threads)
    if params.train.capture == "read-through":
        with launch(cfg.collective_timeout_s) as d:
            plan_only(params, d)
        return
    with launch(cfg.collective_timeout_s) as d:
        lead, lockstep = d, None
        if cfg.tensor_parallel > 1:  # groups of k ranks, each one sharded target; the groups' leads build
            target = Path("data/target")
            try:
                refuse_unshardable(AutoConfig.from_pretrained(target), cfg.tensor_parallel, "data/target")
                groups = Groups.make(d.rank, d.world, cfg.tensor_parallel, d.device)
            except ValueError as e:
                raise StageError(f"cache.tensor_parallel: {e}") from None

            def sharded():
                return load_sharded(target, compute_settings(target, d.device), groups)

            lockstep = Lockstep(groups, sharded)
            if not groups.lead:
                follow(groups, sharded, d.device)
                return
            lead = Dist(groups.dp_rank, groups.dp_world, d.device, groups.dp_group, d.timeout)
        try:
            # a read-through run's store of this very content is derived from, not computed again
            report = build_cache(cfg, params.layers, Path("data/regen/train.jsonl"), Path("data/target"),
                                 lead.rank, lead.world, d.device, share=lead.share, gather=lead.gather,
                                 also=() if is_remote(cfg.url) else (read_through_url(cfg.url),),
                                 load=lockstep and lockstep.load)
        except CacheFormatError as e:
            raise StageError(str(e)) from None
        finally:
            if lockstep is not None:
                lockstep.stop()
        rank = lead.rank
    if rank != 0:
        return
    manifest = report.pop("manifest")
    url = report["url"]
    size, files = disk_usage(url, cfg.storage_options)
    tokens = manifest["num_tokens"]
    metrics = {"samples": manifest["num_samples"], "tokens": tokens, "bytes": size, "files": files,
               "bytes_per_token": round(size / max(tokens, 1), 1), "layers": len(manifest["layers"])}
    # timings vary run to run: they go to the metrics file, so report.json (a hashed output) is
    # the same for the same input and two from-scratch runs leave the same dvc.lock
    metrics |= split_timings(report)
    write_json("data/cache/metrics.json", metrics)
    write_json("data/cache/report.json", report)
    # what later stages depend on: it changes exactly when the store's content does, and it exists
    # for a store on S3 too (DVC 3 has no external outputs)
    write_json("data/cache/manifest.json", dict(manifest, url=url))
    print(json.dumps(metrics))


if __name__ == "__main__":
    run_stage(main)
