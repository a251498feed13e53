"""DVC stage `split`: source conversations -> data/split/{train,eval}.jsonl (see deepspec.data.split)."""
import json

import deepspec.embedded  # noqa: F401  (registers the builtin:chat source)
from deepspec.data.sources import SourceError
from deepspec.data.split import SplitError, run_split
from deepspec.stage import StageError, run_stage


def main(params):
    try:
        report = run_split(params.split, "data/split")
    except (SourceError, SplitError) as e:
        raise StageError(str(e)) from None
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    run_stage(main)
