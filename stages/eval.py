"""DVC stage `eval`: speculative decoding with data/draft + data/target on held-out prompts."""
import json
from pathlib import Path

import torch

from deepspec.evaluate.run import PromptError, evaluate, load_prompts
from deepspec.io import write_json, write_jsonl
from deepspec.stage import StageError, configure_threads, run_stage

OUT = Path("data/eval")


def main(params):
    cfg = params.eval
    configure_threads(cfg.threads)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        prompts = load_prompts(Path(cfg.prompts or "data/split/eval.jsonl"), cfg.max_prompts)
        metrics, rows = evaluate(Path("data/target"), Path("data/draft"), prompts, cfg, params.sampling, device)
    except PromptError as e:
        raise StageError(str(e)) from None
    write_json(OUT / "metrics.json", metrics)
    write_jsonl(OUT / "prompts.jsonl", rows)
    print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, dict)}))


if __name__ == "__main__":
    run_stage(main)
