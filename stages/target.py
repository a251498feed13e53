"""DVC stage `target`: target.source -> data/target/ (HF model dir + identity.json + metrics.json)."""
import json
from pathlib import Path

from deepspec.embedded.tiny import builtin_synthetic_rows, builtin_train_rows, train_tiny
from deepspec.models.prepare import prepare_target
from deepspec.models.target import TargetError
from deepspec.stage import StageError, configure_threads, run_stage


def main(params):
    configure_threads(params.target.tiny.threads)
    try:
        # `layers` is checked here only as a courtesy (before minutes of training); the stage
        # does not depend on it, so `dvc exp run -S layers=...` never retrains the target.
        def train_builtin_tiny(tiny, seed, out_dir):
            rows = builtin_train_rows(params.split) + builtin_synthetic_rows(params.split, tiny.synthetic_rows)
            return train_tiny(tiny, rows, seed, out_dir)

        ident = prepare_target(params.target, params.layers, train_builtin_tiny, Path("data/target"))
    except TargetError as e:
        raise StageError(str(e)) from None
    print(json.dumps(ident, indent=2))


if __name__ == "__main__":
    run_stage(main)
