"""Export one trained draft to the requested formats and write report.json.

    <out>/<format>/config.json, model.safetensors   one complete model directory per exported format
    <out>/report.json                               per format: exported (path, files, ids written)
                                                    or refused (why); the draft and the verifier named
A format that cannot represent the draft is refused in the report, not an error. The draft must
have been trained against the target it is exported for (identity, else its dimensions).
"""
from __future__ import annotations

import json
from pathlib import Path

from deepspec.export.base import DTYPES, ExportError, Refused, TargetRef, write_model_dir
from deepspec.export.dflash import DFlash
from deepspec.export.sglang import SglangEagle3
from deepspec.export.speculators import Speculators
from deepspec.io import write_json
from deepspec.models.draft import DraftModel
from deepspec.models.registry import load_draft

FORMATS = {f.name: f for f in (Speculators(), DFlash(), SglangEagle3())}


def verifier_reference(source: str, target_dir: Path, override: str = "") -> str:
    """What the exported config names as the target: the hub id of an hf: target (the engine fetches
    it by that name), the model directory otherwise (relative paths resolve against the directory
    the engine is launched from)."""
    if override:
        return override
    if source.startswith("hf:"):
        return source[3:].partition("@")[0]
    return str(target_dir)


def target_ref(target_dir: Path, name_or_path: str) -> TargetRef:
    from deepspec.models.target import TargetError, read_config

    try:
        cfg = read_config(target_dir)
    except TargetError as e:
        raise ExportError(str(e)) from None
    return TargetRef(name_or_path=name_or_path, architectures=list(cfg["architectures"]),
                     num_layers=int(cfg["num_hidden_layers"]), hidden_size=int(cfg["hidden_size"]),
                     vocab_size=int(cfg["vocab_size"]))


def check_pairing(draft: DraftModel, draft_dir: Path, target_dir: Path, target: TargetRef) -> None:
    cfg = draft.config
    ident_path = target_dir / "identity.json"
    trained_on = cfg.target.get("id")
    if trained_on and ident_path.exists():
        ident = json.loads(ident_path.read_text())
        if ident.get("id") != trained_on:
            raise ExportError(f"{draft_dir}: trained against target {trained_on}, but {ident_path} is "
                              f"{ident.get('id')}")
    if (target.hidden_size, target.vocab_size) != (cfg.target_hidden_size, cfg.vocab_size):
        raise ExportError(f"{draft_dir}: made for a target of width {cfg.target_hidden_size} and vocab "
                          f"{cfg.vocab_size}; {target_dir} has {target.hidden_size} and {target.vocab_size}")
    bad = [i for i in cfg.target_layers if i > target.num_layers - 2]
    if bad:
        raise ExportError(f"{draft_dir}: target layers {bad} do not exist in {target_dir} "
                          f"({target.num_layers} layers)")


def export_draft(draft_dir: Path, out: Path, formats: list[str], target_dir: Path, verifier: str,
                 dtype: str = "bfloat16", overwrite: bool = False) -> dict:
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ExportError(f"unknown export format {unknown[0]!r} (known: {sorted(FORMATS)})")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r} (known: {sorted(DTYPES)})")
    if not overwrite:
        taken = [out / f for f in formats if (out / f).exists()]
        if taken:
            raise ExportError(f"{taken[0]}: already exists (pass --overwrite to replace it)")
    try:
        draft = load_draft(draft_dir)
    except (OSError, ValueError, TypeError) as e:
        raise ExportError(f"{draft_dir}: not a deepspec draft: {e}") from None
    target = target_ref(target_dir, verifier)
    check_pairing(draft, draft_dir, target_dir, target)
    cfg = draft.config
    report = {"draft": {"path": str(draft_dir), "algorithm": cfg.algorithm, "block_size": cfg.block_size,
                        "sample_from_anchor": cfg.sample_from_anchor, "mask_token_id": cfg.mask_token_id,
                        "target_layers": cfg.target_layers, "target_id": cfg.target.get("id")},
              "verifier": verifier, "dtype": dtype, "formats": {}}
    out.mkdir(parents=True, exist_ok=True)
    for name in formats:
        try:
            exported = FORMATS[name].build(draft, target, dtype)
        except Refused as e:
            report["formats"][name] = {"status": "refused", "reason": str(e)}
            continue
        files = write_model_dir(out / name, exported, dtype)
        report["formats"][name] = {"status": "exported", "path": str(out / name), "files": files} | exported.facts
    write_json(out / "report.json", report)
    return report
