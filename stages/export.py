"""DVC stage `export`: data/draft -> data/export/<format>/ (model dirs serving engines load) + report.json.

A format the draft cannot be represented in is listed as refused (with the reason) in
data/export/report.json; that is not a failure. See docs/export.md.
"""
import json
import shutil
from pathlib import Path

from deepspec.export import ExportError, export_draft, verifier_reference
from deepspec.stage import StageError, run_stage

OUT = Path("data/export")
TARGET = Path("data/target")


def main(params):
    cfg = params.export
    shutil.rmtree(OUT, ignore_errors=True)  # the stage owns its output: never mix two drafts' exports
    try:
        report = export_draft(Path("data/draft"), OUT, cfg.formats, TARGET,
                              verifier_reference(params.target.source, TARGET, cfg.verifier), cfg.dtype)
    except ExportError as e:
        raise StageError(str(e)) from None
    print(json.dumps({name: r["status"] for name, r in report["formats"].items()}))


if __name__ == "__main__":
    run_stage(main)
