"""DVC stage `target`: target.source -> data/target/ (HF model dir + identity.json + metrics.json)."""
import json
from pathlib import Path

from deepspec.models.target import TargetError, prepare_target
from deepspec.stage import StageError, configure_threads, run_stage


def main(params):
    configure_threads(params.target.tiny.threads)
    try:
        ident = prepare_target(params.target, params.layers, Path("data/split/train.jsonl"),
                               Path("data/target"))
    except TargetError as e:
        raise StageError(str(e)) from None
    print(json.dumps(ident, indent=2))


if __name__ == "__main__":
    run_stage(main)
