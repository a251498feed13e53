"""DVC stage `eval`: speculative decoding with data/draft + data/target on every `eval.suites` set."""
import json
from pathlib import Path

from deepspec.devices import local_device
from deepspec.evaluate.run import compact_metrics, evaluate, plot_rows
from deepspec.evaluate.suites import PromptError, load_suite
from deepspec.io import write_json, write_jsonl
from deepspec.stage import StageError, configure_threads, run_stage

OUT = Path("data/eval")
HELDOUT = Path("data/split/eval.jsonl")


def main(params):
    cfg = params.eval
    configure_threads(cfg.threads)
    device = local_device()
    try:
        suites = {s.name: load_suite(s, HELDOUT) for s in cfg.suites}  # every suite readable before any decoding
        report, rows = evaluate(Path("data/target"), Path("data/draft"), suites, cfg, params.sampling, device)
    except PromptError as e:
        raise StageError(str(e)) from None
    metrics = compact_metrics(report)
    write_json(OUT / "report.json", report)
    write_json(OUT / "plots/tau.json", plot_rows(report))
    write_jsonl(OUT / "prompts.jsonl", rows)
    write_json(OUT / "metrics.json", metrics)
    print(json.dumps({name: m for name, m in metrics.items() if name != "protocol"}))


if __name__ == "__main__":
    run_stage(main)
