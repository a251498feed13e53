"""DVC stage `eval`: speculative decoding with data/draft + data/target on every `eval.suites` set.

With `eval.tensor_parallel: k`, under `torchrun --nproc-per-node k` (`eval.launcher`), the target is
sharded over the k ranks by transformers' tensor-parallel plan; every rank runs the whole loop with
its own copy of the draft (the target's logits are whole on every rank, so every rank decodes the
same tokens) and rank 0 writes the outputs.
"""
import json
from pathlib import Path

from deepspec.devices import local_device
from deepspec.distributed import launch
from deepspec.evaluate.run import compact_metrics, evaluate, plot_rows
from deepspec.evaluate.suites import PromptError, load_suite
from deepspec.io import write_json, write_jsonl
from deepspec.stage import StageError, configure_threads, run_stage

OUT = Path("data/eval")
HELDOUT = Path("data/split/eval.jsonl")
TARGET = Path("data/target")
COLLECTIVE_TIMEOUT_S = 3600


def run(params, device, load=None) -> tuple[dict, list[dict]]:
    cfg = params.eval
    try:
        suites = {s.name: load_suite(s, HELDOUT) for s in cfg.suites}  # every suite readable before any decoding
        return evaluate(TARGET, Path("data/draft"), suites, cfg, params.sampling, device, load=load)
    except PromptError as e:
        raise StageError(str(e)) from None


def sharded_run(params) -> tuple[dict, list[dict]] | None:
    """The eval on a group of `eval.tensor_parallel` ranks: rank 0's results, None on the others."""
    from transformers import AutoConfig

    from deepspec.models.target import compute_settings
    from deepspec.models.tensor_parallel import Groups, load_sharded, refuse_unshardable

    k = params.eval.tensor_parallel
    with launch(COLLECTIVE_TIMEOUT_S) as d:
        if d.world != k:
            raise StageError(f"eval.tensor_parallel = {k}: run the stage under `torchrun --nproc-per-node {k}` "
                             f"(eval.launcher); this launch has {d.world} ranks")
        try:
            refuse_unshardable(AutoConfig.from_pretrained(TARGET), k, str(TARGET))
        except ValueError as e:
            raise StageError(f"eval.tensor_parallel: {e}") from None
        groups = Groups.make(d.rank, d.world, k, d.device)
        got = run(params, d.device, lambda: load_sharded(TARGET, compute_settings(TARGET, d.device), groups))
        return got if d.rank == 0 else None


def main(params):
    cfg = params.eval
    configure_threads(cfg.threads)
    got = sharded_run(params) if cfg.tensor_parallel > 1 else run(params, local_device())
    if got is None:
        return
    report, rows = got
    metrics = compact_metrics(report)
    write_json(OUT / "report.json", report)
    write_json(OUT / "plots/tau.json", plot_rows(report))
    write_jsonl(OUT / "prompts.jsonl", rows)
    write_json(OUT / "metrics.json", metrics)
    print(json.dumps({name: m for name, m in metrics.items() if name != "protocol"}))


if __name__ == "__main__":
    run_stage(main)
