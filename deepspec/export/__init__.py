"""Trained drafts -> the model directories serving engines load (see docs/export.md).

A format is an object with a `name` and `build(draft, target, dtype) -> Exported` that raises
`Refused` when it cannot represent the draft; `FORMATS` in `run.py` lists them (a new engine format,
e.g. sglang's EAGLE-3, is one more module and one more entry). Nothing here imports the engines'
own packages: they are test-only.
"""
from deepspec.export.base import ExportError, Exported, Refused, TargetRef
from deepspec.export.run import FORMATS, export_draft, target_ref, verifier_reference

__all__ = ["FORMATS", "ExportError", "Exported", "Refused", "TargetRef", "export_draft", "target_ref",
           "verifier_reference"]
