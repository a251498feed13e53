"""A store equals a from-scratch build under every cache param (docs/cache-format.md §7, "Exactness").

For each param of the cache stage: a store built with the defaults, then built again in place with
the param changed (what `dvc exp run -S cache.<param>=<value>` runs), must equal, file for file, a
from-scratch build with the new value, or live under another name. The list of params is checked
against CacheConfig, so a new param needs a case here.
"""
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from deepspec.cache.build.stage import build_cache
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.storage.naming import store_url
from deepspec.config import CacheConfig
from deepspec.stage import configure_threads
from tests.cache.test_cache import LAYERS, regen_rows, workdir
from tests.cache.test_derive import store_files


def rows() -> list[dict]:
    """Short conversations, one answer cut by max_tokens and one two-turn conversation (the
    `overlong` and `truncated` rules have something to decide)."""
    out = [dict(r, finish_reasons=["stop"]) for r in regen_rows(24)]
    out[3]["finish_reasons"] = ["length"]
    two = out[5]["conversations"] + out[6]["conversations"]
    out.append({"id": f"{99:016x}", "conversations": two, "finish_reasons": ["stop", "stop"]})
    return out


BASE = {"part_tokens": 200, "max_length": 64}
# param -> (base overrides, the changed value)
CASES = {
    "launcher": ({}, "torchrun --nproc-per-node 2"),  # the stage's command prefix: the build never sees it
    "url": ({}, None),                                # another store: checked by name below
    "format": ({}, "hdf5"),
    "dtype": ({}, "fp8"),
    "codec": ({}, "blosc-zstd"),
    "max_length": ({}, 40),
    "overlong": ({}, "drop"),
    "truncated": ({}, "drop"),
    "batch_tokens": ({}, 64),                         # one sample a forward batch instead of the whole part
    "part_tokens": ({}, 120),
    "shard_bytes": ({"part_tokens": 4096}, 2**16),    # caps part_tokens at 2**16 / (hidden x 2 B)
    "chunk_tokens": ({}, 16),
    "storage_options": ({}, {"auto_mkdir": True}),
    "threads": ({}, 2),
    "collective_timeout_s": ({}, 60),
    "derive_from": ({}, "none"),
    "tensor_parallel": ({}, 2),                       # another store (its compute names the degree): checked below;
}                                                     # the sharded build itself: test_tensor_parallel.py


def test_every_cache_param_has_a_case():
    assert sorted(CASES) == sorted(f.name for f in dataclasses.fields(CacheConfig))


def build(work: Path, **cfg) -> dict:
    """As stages/cache.py runs it: the stage's thread count set first."""
    cfg = CacheConfig(url=str(work / "data" / "cache.zarr"), **cfg)
    threads = torch.get_num_threads()
    configure_threads(cfg.threads)
    try:
        return build_cache(cfg, LAYERS, work / "data" / "regen" / "train.jsonl", work / "data" / "target")
    finally:
        torch.set_num_threads(threads)


def comparable(url: str) -> tuple[dict, dict]:
    """Every file of a store (root manifest aside), a part's commit record parsed; and the manifest
    less where it was derived from (a derive equals a from-scratch computation, by this test)."""
    files = store_files(url)
    for name in [k for k in files if k.endswith("zarr.json")]:
        files[name] = json.loads((Path(url) / name).read_text())
    manifest = dict(CacheReader(url).manifest)
    manifest.pop("derived_from", None)
    return files, manifest


@pytest.fixture
def batch_sensitive(monkeypatch):
    """The tiny target on a CPU gives the same bf16 states however its samples are batched; a GPU's
    kernels do not (a batch's shape picks the kernel, padding changes reductions). This makes the
    states depend on the batch's shape the way a GPU's do, in a way no rounding hides."""
    import deepspec.cache.build.stage as build_module

    plain = build_module.forward_capture

    def forward_capture(model, ids, mask, layers):
        captured, last = plain(model, ids, mask, layers)
        bias = 1.0 + ids.shape[0] / 64 + ids.shape[1] / 4096
        return {k: v * bias for k, v in captured.items()}, last * bias

    monkeypatch.setattr(build_module, "forward_capture", forward_capture)


@pytest.mark.parametrize("param", sorted(CASES))
def test_a_changed_param_gives_a_from_scratch_build_or_another_store(tmp_path, trained_target, param,
                                                                     batch_sensitive):
    base, value = CASES[param]
    base = {**BASE, **base}
    work = workdir(tmp_path / "incremental", trained_target, rows())
    first = build(work, **base)
    assert first["samples"] > 10 and (first["parts"] > 2 or param == "shard_bytes")
    if param == "url":
        other = CacheConfig(**base, url=str(tmp_path / "elsewhere.zarr"))
        assert store_url(other.url, first["manifest"]) != first["url"]
        return
    if param == "tensor_parallel":  # built only by the stage's groups under torchrun: here, its content differs
        from deepspec.cache.build.stage import compute_of
        from deepspec.cache.spec.manifest import manifest_mismatch

        compute = compute_of(CacheConfig(**base, tensor_parallel=value), work / "data" / "target", torch.device("cpu"))
        assert compute["tensor_parallel"] == value
        assert manifest_mismatch(first["manifest"], dict(first["manifest"], compute=compute)) is not None
        with pytest.raises(ValueError, match="sharded by the stage's groups"):
            build(work, **{**base, param: value})
        return
    changed = {**base, param: value}
    again = build(work, **changed)
    scratch = workdir(tmp_path / "scratch", trained_target, rows())
    shutil.rmtree(scratch / "data" / "cache.zarr", ignore_errors=True)
    fresh = build(scratch, **changed, **({} if param == "derive_from" else {"derive_from": "none"}))
    assert fresh["mode"] == "computed"
    if param == "shard_bytes":
        assert fresh["parts"] > first["parts"]  # the cap took effect
    assert comparable(again["url"]) == comparable(fresh["url"]), param
    assert again["computed_by"] == fresh["computed_by"] and len(fresh["computed_by"]) == 1


def test_each_part_records_the_fingerprint_it_was_computed_under_and_derived_parts_keep_it(tmp_path,
                                                                                          trained_target):
    from deepspec.models.target import compute_fingerprint

    work = workdir(tmp_path, trained_target, rows())
    report = build(work, **BASE)
    fp = compute_fingerprint("cpu")
    assert fp.startswith(f"torch={torch.__version__} transformers=") and "device=cpu" in fp
    assert report["computed_by"] == {fp: report["parts"]}
    url = Path(report["url"])
    records = [json.loads((url / "parts" / p / "zarr.json").read_text())["attributes"]
               for p in CacheReader(str(url)).parts]
    assert {r["computed_by"] for r in records} == {fp}
    # a part computed elsewhere (another GPU, another torch) is kept, reported and named in a warning
    name = CacheReader(str(url)).parts[0]
    meta_path = url / "parts" / name / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["computed_by"] = "torch=2.99 transformers=9.9 cuda=13.0 device=NVIDIA H200 sm_90"
    meta_path.write_text(json.dumps(meta))
    derived = build(work, **{**BASE, "dtype": "fp8"})  # a derive re-encodes each part: records travel with bits
    assert derived["mode"] == "derived"
    assert derived["computed_by"] == {fp: report["parts"] - 1,
                                      "torch=2.99 transformers=9.9 cuda=13.0 device=NVIDIA H200 sm_90": 1}


def test_a_converted_store_keeps_each_parts_fingerprint(tmp_path, trained_target):
    from deepspec.cache.backends.readers import open_cache
    from deepspec.cache.tools.convert import convert

    work = workdir(tmp_path, trained_target, rows())
    report = build(work, **BASE)
    src = open_cache(report["url"])
    convert(report["url"], str(tmp_path / "store.h5"))
    dst = open_cache(str(tmp_path / "store.h5"))
    names = list(CacheReader(report["url"]).parts)
    assert [dst.computed_by(n) for n in names] == [src.computed_by(n) for n in names] != [None] * len(names)
