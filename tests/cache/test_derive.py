"""Deriving a store (a layer subset, fp8, another codec) from an existing one instead of running the target."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from deepspec.cache.build.stage import build_cache
from deepspec.cache.build.derive import OLD, STAGING, recover
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.spec.format import FORMAT_VERSION
from deepspec.cache.tools.verify import verify
from deepspec.cli import main as cli
from deepspec.config import CacheConfig
from tests.cache.test_cache import LAYERS, regen_rows, workdir
from tests.conftest import REPO, project_env

SUBSET = [0, 2]  # the small fixtures' `layers=[9,25]`


def store_files(url: str) -> dict[str, str]:
    """Every file of a local store -> sha256, the root manifest (Zarr's zarr.json, HDF5's manifest.json)
    left out (it names its provenance)."""
    root = Path(url)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and str(p.relative_to(root)) not in ("zarr.json", "manifest.json")}


def manifest(url: str, storage_options=None) -> dict:
    return dict(CacheReader(url, storage_options).manifest)


def same_store(derived: str, scratch: str) -> None:
    """Array for array, file for file, and the same manifest apart from provenance."""
    assert store_files(derived) == store_files(scratch)
    _same_manifest(derived, scratch)


def store_files_any_rank(url: str) -> dict:
    """store_files of a Zarr store written by several ranks: a part's commit record, less the rank
    that wrote it, in place of its hash."""
    out = store_files(url)
    for name in [k for k in out if k.startswith("parts/") and k.endswith("/zarr.json")]:
        meta = json.loads((Path(url) / name).read_text())
        meta.get("attributes", {}).pop("rank", None)
        out[name] = meta
    return out


def same_store_any_rank(derived: str, scratch: str) -> None:
    """same_store for a store written by several ranks."""
    assert store_files_any_rank(derived) == store_files_any_rank(scratch)
    _same_manifest(derived, scratch)


def _same_manifest(derived: str, scratch: str) -> None:
    a, b = manifest(derived), manifest(scratch)
    assert "derived_from" in a and "derived_from" not in b
    a.pop("derived_from")
    assert a == b
    assert verify(derived)["ok"]


def build(work: Path, layers, **cfg) -> dict:
    cfg.setdefault("part_tokens", 200)
    return build_cache(CacheConfig(url=str(work / "data" / "cache.zarr"), **cfg), layers,
                       work / "data" / "regen" / "train.jsonl", work / "data" / "target")


def scratch(tmp_path: Path, target: Path, layers, rows, **cfg) -> str:
    work = workdir(tmp_path / "scratch", target, rows)
    report = build(work, layers, derive_from="none", **cfg)
    assert report["mode"] == "computed"
    return str(work / "data" / "cache.zarr")


@pytest.mark.parametrize("source_format", ["hdf5", "zarr"])
def test_an_hdf5_layer_subset_is_re_encoded_and_equals_a_from_scratch_build(tmp_path, trained_target, source_format):
    """An HDF5 part is one file holding every array: nothing to link, the kept layers are re-encoded
    (from an HDF5 store, or from a Zarr one when the wanted store is HDF5)."""
    work = workdir(tmp_path / "a", trained_target, regen_rows(30))
    url = str(work / "data" / "cache.zarr")
    build(work, LAYERS, format=source_format)
    report = build(work, SUBSET, format="hdf5")
    assert report["mode"] == "derived" and report["forward_s"] == 0
    assert report["derive"]["parts_computed"] == 0 and "hardlink" not in report["derive"]["method"]
    same_store(url, scratch(tmp_path, trained_target, SUBSET, regen_rows(30), format="hdf5"))
    assert manifest(url)["storage"] == "hdf5"


def test_layer_subset_is_linked_from_the_current_store_and_equals_a_from_scratch_build(tmp_path, trained_target):
    work = workdir(tmp_path / "a", trained_target, regen_rows(30))
    url = str(work / "data" / "cache.zarr")
    build(work, LAYERS)
    superset = store_files(url)
    inodes = {k: os.stat(Path(url) / k).st_ino for k in superset}
    report = build(work, SUBSET)
    assert report["mode"] == "derived" and report["forward_s"] == 0
    derive = report["derive"]
    assert derive["parts_derived"] == len(manifest(url)["parts"]) and derive["parts_computed"] == 0
    assert derive["method"] == ["hardlink"] and derive["derived_from"]["layers"] == LAYERS
    assert 0 < derive["wall_s"] <= report["wall_s"] + 0.5
    same_store(url, scratch(tmp_path, trained_target, SUBSET, regen_rows(30)))
    # the kept arrays are the superset's very files (no byte copied), their bytes unchanged
    after = store_files(url)
    assert all(os.stat(Path(url) / k).st_ino == inodes[k] and after[k] == superset[k] for k in after
               if "/hidden/0/" in k or "/last_hidden/" in k)
    assert not any((Path(url).parent / (Path(url).name + s)).exists() for s in (STAGING, OLD))
    assert manifest(url)["derived_from"] == derive["derived_from"]  # the manifest names its source


def test_a_v3_store_is_linked_into_a_v4_store_without_a_forward(tmp_path, trained_target):
    """Format v4 moved the chunks' crc32cs; a v3 store of the same input (content-named parts) is
    derived by hard links, not computed again, and its arrays keep the layout they were written with."""
    from tests.cache.old_layout import to_v3_store

    work = workdir(tmp_path / "a", trained_target, regen_rows(30))
    url = str(work / "data" / "cache.zarr")
    build(work, LAYERS)
    to_v3_store(url)
    assert CacheReader(url).manifest.format_version == 3
    report = build(work, LAYERS)
    assert report["mode"] == "derived" and report["forward_s"] == 0
    assert report["derive"]["parts_computed"] == 0 and report["derive"]["method"] == ["hardlink"]
    fresh = scratch(tmp_path, trained_target, LAYERS, regen_rows(30))
    a, b = CacheReader(url), CacheReader(fresh)
    assert a.manifest.format_version == b.manifest.format_version == FORMAT_VERSION
    assert [p.name for p in a.manifest.parts] == [p.name for p in b.manifest.parts]
    assert not a.array_layout(0, "hidden/0").crc_table and b.array_layout(0, "hidden/0").crc_table
    for k in range(len(b)):
        x, y = a.read(k), b.read(k)
        assert all(np.array_equal(x[f], y[f]) for f in ("input_ids", "loss_mask"))
        assert all(np.array_equal(x[layer][0], y[layer][0]) for layer in [*LAYERS, "last"])
    assert verify(url)["ok"]


@pytest.mark.parametrize("dtype,codec", [("fp8", "none"), ("bfloat16", "blosc-zstd"), ("fp8", "blosc-lz4")])
def test_fp8_and_codec_derive_equals_a_from_scratch_build_bitwise(tmp_path, trained_target, dtype, codec, monkeypatch):
    work = workdir(tmp_path / "a", trained_target, regen_rows(20))
    url = str(work / "data" / "cache.zarr")
    build(work, LAYERS)
    from deepspec.cache.build.derive_source import Source

    monkeypatch.setattr(Source, "REENCODE_TOKENS", 37)  # a part streamed in several windows, not chunk-aligned
    report = build(work, SUBSET, dtype=dtype, codec=codec)
    assert report["mode"] == "derived" and "re-encode" in report["derive"]["method"]
    same_store(url, scratch(tmp_path, trained_target, SUBSET, regen_rows(20), dtype=dtype, codec=codec))


def test_re_encoding_a_part_of_more_chunks_than_one_read_takes(tmp_path, trained_target):
    """A whole part of ~850 chunks (the default's 65,536-token parts have 1,024) is read in windows:
    a single preadv of it exceeds the kernel's IOV_MAX and fails with EINVAL."""
    work = workdir(tmp_path / "a", trained_target, regen_rows())
    url = str(work / "data" / "cache.zarr")
    build(work, LAYERS, part_tokens=4000, chunk_tokens=2)
    assert len(manifest(url)["parts"]) == 1 and manifest(url)["num_tokens"] > 2 * 520
    report = build(work, SUBSET, part_tokens=4000, chunk_tokens=2, dtype="fp8")
    assert report["mode"] == "derived"
    same_store(url, scratch(tmp_path, trained_target, SUBSET, regen_rows(), part_tokens=4000, chunk_tokens=2,
                            dtype="fp8"))


def test_growth_and_dropped_rows_compute_only_the_parts_whose_composition_changed(tmp_path, trained_target):
    work = workdir(tmp_path / "a", trained_target, regen_rows(30))
    url = str(work / "data" / "cache.zarr")
    build(work, LAYERS)
    source_parts = len(manifest(url)["parts"])
    workdir(tmp_path / "a", trained_target, regen_rows(45))  # the regen rows grew
    report = build(work, SUBSET)
    assert report["mode"] == "derived+computed"
    derived, computed = report["derive"]["parts_derived"], report["derive"]["parts_computed"]
    assert 0 < derived < source_parts and computed > 0  # the source's last, partial part is rebuilt
    same_store(url, scratch(tmp_path / "grow", trained_target, SUBSET, regen_rows(45)))
    # fewer rows: the parts that held only kept rows are derived, the part the cut falls in (if a
    # content cut does not fall there too) is computed, and nothing of the dropped rows remains
    workdir(tmp_path / "a", trained_target, regen_rows(25))
    report = build(work, [0])
    assert report["derive"]["parts_derived"] > 0 and report["manifest"]["num_samples"] == 25
    same_store(url, scratch(tmp_path / "drop", trained_target, [0], regen_rows(25)))


def test_a_missing_layer_or_another_target_falls_back_to_computing_and_says_why(tmp_path, trained_target):
    work = workdir(tmp_path / "a", trained_target, regen_rows(12))
    url = str(work / "data" / "cache.zarr")
    build(work, SUBSET)
    report = build(work, [-1, 0])
    assert report["mode"] == "computed" and report["derive"]["parts_derived"] == 0
    assert "layers [-1] are not in the source (it has [0, 2])" in report["derive"]["reason"]
    assert store_files(url) == store_files(scratch(tmp_path, trained_target, [-1, 0], regen_rows(12)))
    # a store of another target, named by cache.derive_from: never a source
    other = workdir(tmp_path / "o", trained_target, regen_rows(12))
    ident = json.loads((other / "data/target/identity.json").read_text())
    (other / "data/target/identity.json").write_text(json.dumps(dict(ident, weights_sha256="0" * 64)))
    build(other, LAYERS)
    work2 = workdir(tmp_path / "b", trained_target, regen_rows(12))
    report = build(work2, SUBSET, derive_from=str(other / "data" / "cache.zarr"))
    assert report["mode"] == "computed"
    assert "another target identity (target.weights_sha256: store has" in report["derive"]["reason"]
    assert CacheReader(str(work2 / "data/cache.zarr")).manifest["target"]["weights_sha256"] == ident["weights_sha256"]


def test_derive_from_names_another_local_store(tmp_path, trained_target):
    src = workdir(tmp_path / "src", trained_target, regen_rows(20))
    build(src, LAYERS)
    work = workdir(tmp_path / "a", trained_target, regen_rows(20))
    report = build(work, SUBSET, derive_from=str(src / "data/cache.zarr"))
    assert report["mode"] == "derived" and report["derive"]["source"] == str(src / "data/cache.zarr")
    same_store(str(work / "data/cache.zarr"), scratch(tmp_path, trained_target, SUBSET, regen_rows(20)))
    assert manifest(str(src / "data/cache.zarr"))["layers"] == LAYERS and verify(str(src / "data/cache.zarr"))["ok"]
    # naming the store being replaced is the default in-place derive, never a read of a pruned store
    report = build(work, [0], derive_from=str(work / "data/cache.zarr"))
    assert report["mode"] == "derived" and report["derive"]["method"] == ["hardlink"]
    assert store_files(str(work / "data/cache.zarr")) == store_files(scratch(tmp_path / "s0", trained_target, [0],
                                                                             regen_rows(20)))


def test_a_store_absent_or_of_other_content_is_derived_from_the_first_other_local_store_that_can_serve(
        tmp_path, trained_target):
    """build_cache(also=...): the cache stage's store and a read-through run's (naming.read_through_url)
    derive from each other, so a switch of train.capture computes nothing the project holds already."""
    work = workdir(tmp_path / "a", trained_target, regen_rows(20))
    build(work, LAYERS)
    there = str(work / "data/cache.zarr")
    beside = str(work / "data/cache-read-through.zarr")
    cfg = CacheConfig(url=beside, part_tokens=200)
    regen, target = work / "data/regen/train.jsonl", work / "data/target"
    report = build_cache(cfg, SUBSET, regen, target, also=(str(tmp_path / "none.zarr"), there))
    assert report["mode"] == "derived" and report["derive"]["source"] == there and report["target_forwards"] == 0
    same_store(beside, scratch(tmp_path, trained_target, SUBSET, regen_rows(20)))
    # the store at the url itself comes first when it can serve; else the candidates, else the target
    assert build_cache(cfg, SUBSET, regen, target, also=(there,))["target_forwards"] == 0
    report = build_cache(CacheConfig(url=str(tmp_path / "other.zarr"), part_tokens=200), [-1, 1], regen,
                         target, also=(beside,))
    assert report["target_forwards"] > 0  # layer 1 is in neither store


def test_a_kill_between_the_swap_renames_is_repaired_by_the_next_run(tmp_path, trained_target):
    """The in-place derive writes `<url>.derive`, then renames the old store away and the new one in:
    whatever a kill leaves, the next run ends with a complete store and no sibling left over."""
    work = workdir(tmp_path / "a", trained_target, regen_rows(12))
    url = work / "data" / "cache.zarr"
    build(work, LAYERS)
    superset = store_files(str(url))
    os.rename(url, str(url) + OLD)  # killed after the first rename
    recover(str(url))
    assert store_files(str(url)) == superset and not Path(str(url) + OLD).exists()
    shutil.copytree(url, str(url) + OLD)  # killed while deleting the old store
    recover(str(url))
    assert not Path(str(url) + OLD).exists() and store_files(str(url)) == superset
    (Path(str(url) + STAGING) / "parts").mkdir(parents=True)  # a staging store of a derive given up
    report = build(work, LAYERS)
    assert report["mode"] == "computed" and not Path(str(url) + STAGING).exists()


def _parts(url: Path) -> int:
    """Committed parts (format v2: a commit is the part's own record; the root is consolidated at the end)."""
    n = 0
    for record in url.glob("parts/p*/zarr.json"):
        try:
            n += bool(json.loads(record.read_text()).get("attributes", {}).get("committed"))
        except (OSError, ValueError):
            pass
    return n


def test_cli_derive_sigkilled_then_rerun_gives_an_identical_store(tmp_path, trained_target):
    work = workdir(tmp_path / "a", trained_target, regen_rows(24))
    src = str(work / "data" / "cache.zarr")
    build(work, LAYERS, part_tokens=20)  # one sample per part: parts to be killed among
    total = len(manifest(src)["parts"])
    clean, crash = tmp_path / "clean.zarr", tmp_path / "crash.zarr"
    args = ["--layers", "0,2", "--dtype", "fp8"]
    assert cli(["cache", "derive", src, str(clean), *args]) == 0
    cmd = [sys.executable, "-m", "deepspec.cli", "cache", "derive", src, str(crash), *args]
    proc = subprocess.Popen(cmd, env=project_env(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and _parts(crash) < 3 and proc.poll() is None:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 0 < _parts(crash) < total, "the derive finished before it was killed"
    assert cli(["cache", "derive", src, str(crash), *args]) == 0
    assert store_files(str(crash)) == store_files(str(clean))
    assert json.loads((crash / "zarr.json").read_text()) == json.loads((clean / "zarr.json").read_text())
    assert verify(str(crash))["ok"] and manifest(str(crash))["dtype"] == "fp8"
    assert cli(["cache", "derive", src, str(tmp_path / "x.zarr"), "--layers", "1"]) == 1  # not in the source


def test_derive_from_a_store_in_an_s3_lake_uses_server_side_copies(tmp_path, trained_target, moto):
    bucket = moto.bucket("derive-lake")
    lake = f"s3://{bucket}/lake"
    work = workdir(tmp_path / "a", trained_target, regen_rows(15))
    regen, target = work / "data/regen/train.jsonl", work / "data/target"
    cfg = dict(url=lake, part_tokens=200, storage_options=moto.storage_options)
    superset = build_cache(CacheConfig(**cfg), LAYERS, regen, target)["url"]
    report = build_cache(CacheConfig(**cfg), SUBSET, regen, target)
    assert report["mode"] == "derived" and report["derive"]["source"] == superset
    assert report["derive"]["method"] == ["s3-copy"] and report["url"] != superset
    fp8 = build_cache(CacheConfig(**cfg, dtype="fp8"), SUBSET, regen, target)
    assert fp8["mode"] == "derived" and fp8["derive"]["source"] in (superset, report["url"])  # both bfloat16
    # both equal local from-scratch builds object for object
    for got, kw in ((report["url"], {}), (fp8["url"], {"dtype": "fp8"})):
        local = tmp_path / f"dl-{kw.get('dtype', 'bf16')}.zarr"
        assert cli(["cache", "derive", got, str(local), "--storage-options", json.dumps(moto.storage_options)]) == 0
        assert store_files(str(local)) == store_files(scratch(tmp_path / f"s-{kw.get('dtype', 'bf16')}",
                                                              trained_target, SUBSET, regen_rows(15), **kw))
    assert verify(report["url"], moto.storage_options)["ok"]
    assert CacheReader(superset, moto.storage_options).layers == LAYERS


def _dvc_cache_intact(repo: Path) -> int:
    """Every object in DVC's cache still holds the bytes its name (their md5) says: none was modified
    in place. Returns how many objects there are."""
    objects = [p for p in (repo / ".dvc" / "cache" / "files" / "md5").rglob("*") if p.is_file()]
    for p in objects:
        if p.suffix != ".dir":
            assert hashlib.md5(p.read_bytes()).hexdigest() == p.parent.name + p.name, p
    return len(objects)


@pytest.mark.slow
def test_dvc_layer_experiment_derives_and_checkout_restores_the_superset_bit_for_bit(tmp_path, trained_target):
    import yaml

    from tests.conftest import clone_project, run

    repo = clone_project(tmp_path / "repo")
    # only the cache stage: its inputs are copied in (as in test_cache's DVC-on-S3 test)
    pipeline = yaml.safe_load((repo / "dvc.yaml").read_text())
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"cache": pipeline["stages"]["cache"]}}))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["layers"] = LAYERS
    params["cache"].update(part_tokens=200)
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    work = workdir(tmp_path, trained_target, regen_rows(24))
    shutil.copytree(work / "data", repo / "data", dirs_exist_ok=True)
    env = project_env(repo, DEEPSPEC_LOG="WARNING")
    store = repo / "data" / "cache.zarr"
    lock = lambda: {o["path"]: o["md5"] for o in  # noqa: E731
                    yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["cache"]["outs"]}
    report = lambda: json.loads((repo / "data/cache/report.json").read_text())  # noqa: E731

    run(["dvc", "repro", "-s", "cache"], repo, env)
    assert report()["mode"] == "computed"
    superset = dict(store_files(str(store)), manifest=hashlib.sha256((store / "zarr.json").read_bytes()).hexdigest())
    superset_hash = lock()["data/cache.zarr"]
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    run(["git", "add", "-A"], repo, env)
    run([*git, "commit", "-qm", "superset cache"], repo, env)

    out = run(["dvc", "exp", "run", "-s", "cache", "-n", "subset", "-S", f"layers={SUBSET}"], repo, env).stdout
    assert "Running stage 'cache'" in out
    got = report()
    assert got["mode"] == "derived" and got["derive"]["parts_computed"] == 0, got
    assert got["derive"]["method"] == ["hardlink"]
    same_store(str(store), scratch(tmp_path / "s", trained_target, SUBSET, regen_rows(24)))
    derived_files = store_files(str(store))
    derived_hash = lock()["data/cache.zarr"]
    assert derived_hash != superset_hash  # dvc.lock records the derived store's own hash
    assert _dvc_cache_intact(repo) > 0
    assert "up to date" in run(["dvc", "status", "cache"], repo, env).stdout

    # back to the original: git's params/lock + dvc checkout restore the superset, bit for bit
    run(["git", "checkout", "HEAD", "--", "params.yaml", "dvc.lock"], repo, env)
    run(["dvc", "checkout"], repo, env)
    assert dict(store_files(str(store)), manifest=hashlib.sha256((store / "zarr.json").read_bytes()).hexdigest()) \
        == superset
    assert verify(str(store))["ok"] and manifest(str(store))["layers"] == LAYERS
    assert "up to date" in run(["dvc", "status", "cache"], repo, env).stdout
    assert cli(["cache", "verify", str(store)]) == 0
    # and the experiment is one `dvc exp apply` away, without running anything
    run(["dvc", "exp", "apply", "subset"], repo, env)
    assert store_files(str(store)) == derived_files and lock()["data/cache.zarr"] == derived_hash
    assert "up to date" in run(["dvc", "status", "cache"], repo, env).stdout
    run(["git", "checkout", "HEAD", "--", "params.yaml", "dvc.lock"], repo, env)
    run(["dvc", "checkout"], repo, env)
    assert store_files(str(store)) == {k: v for k, v in superset.items() if k != "manifest"}
    assert _dvc_cache_intact(repo) > 0


@pytest.mark.slow
def test_cache_stage_sigkilled_mid_derive_then_rerun_equals_an_uninterrupted_derive(tmp_path, trained_target):
    import yaml

    def params(work: Path, **cache):
        p = yaml.safe_load((REPO / "params.yaml").read_text())
        p["layers"] = cache.pop("layers")
        p["cache"].update(part_tokens=20, **cache)  # one sample per part: many parts to be killed among
        (work / "params.yaml").write_text(yaml.safe_dump(p))

    cmd = [sys.executable, str(REPO / "stages" / "cache.py")]
    env = project_env(REPO, DEEPSPEC_LOG="WARNING")
    clean = workdir(tmp_path / "clean", trained_target, regen_rows())
    params(clean, layers=LAYERS)
    subprocess.run(cmd, cwd=clean, env=env, check=True, capture_output=True)
    crash = tmp_path / "crash"
    shutil.copytree(clean, crash, symlinks=True)
    for w in (clean, crash):
        params(w, layers=SUBSET, dtype="fp8")
    subprocess.run(cmd, cwd=clean, env=env, check=True, capture_output=True)
    staging = crash / "data" / ("cache.zarr" + STAGING)
    proc = subprocess.Popen(cmd, cwd=crash, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and _parts(staging) < 3 and proc.poll() is None:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    total = len(manifest(str(clean / "data/cache.zarr"))["parts"])
    assert 0 < _parts(staging) < total, "the derive finished before it was killed"
    assert manifest(str(crash / "data/cache.zarr"))["layers"] == LAYERS  # the superset is untouched meanwhile
    subprocess.run(cmd, cwd=crash, env=env, check=True, capture_output=True)
    report = json.loads((crash / "data/cache/report.json").read_text())
    assert report["mode"] == "derived" and 0 < report["derive"]["parts_derived"] < total  # the rest was resumed
    assert store_files(str(crash / "data/cache.zarr")) == store_files(str(clean / "data/cache.zarr"))
    assert sorted(p.name for p in (crash / "data").iterdir()) == sorted(p.name for p in (clean / "data").iterdir())


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_a_derive_under_two_ranks_is_shared_by_both_and_takes_no_target_forward(tmp_path, trained_target, dtype,
                                                                                  monkeypatch):
    """The recipe launches the cache stage with torchrun: a layer subset (linked) or fp8 (re-encoded) is
    still derived, every rank deriving its share into rank 0's staging store, and equals a from-scratch
    build; no rank runs the target."""
    import deepspec.cache.build.stage as build_mod
    from tests.cache.test_build import build_ranks, committed

    work = workdir(tmp_path / "a", trained_target, regen_rows(30))
    url = str(work / "data" / "cache.zarr")
    build(work, LAYERS, part_tokens=150)

    def no_forward(*a, **k):
        raise AssertionError("a rank ran the target for a part the source holds")

    monkeypatch.setattr(build_mod, "compute_part", no_forward)
    reports = build_ranks(work, 2, layers=SUBSET, part_tokens=150, dtype=dtype)
    assert not any(isinstance(r, BaseException) for r in reports), reports
    report = reports[0]
    parts = len(manifest(url)["parts"])
    assert report["mode"] == "derived" and report["forward_s"] == 0
    assert (report["derive"]["parts_derived"], report["derive"]["parts_computed"]) == (parts, 0)  # both ranks' counts
    assert set(committed(url).values()) == {0, 1}
    monkeypatch.undo()
    same_store_any_rank(url, scratch(tmp_path, trained_target, SUBSET, regen_rows(30), part_tokens=150, dtype=dtype))
    assert not any((Path(url).parent / (Path(url).name + s)).exists() for s in (STAGING, OLD))


@pytest.mark.slow
def test_torchrun_cache_stage_derives_a_layer_subset_over_gloo(tmp_path, trained_target):
    """`dvc exp run -S 'layers=[9,25]'` with the recipe's `torchrun --nproc-per-node 8` launcher, in
    small: two processes over gloo derive the subset; the report says so and the store equals a
    from-scratch build."""
    import yaml

    from deepspec.data.servers import free_port

    def params(work: Path, layers):
        p = yaml.safe_load((REPO / "params.yaml").read_text())
        p["layers"] = layers
        # one thread in both runs: torchrun sets OMP_NUM_THREADS=1, and on CPU the thread count is part of
        # how states are computed (a store of 2-thread states is not derived from for 1-thread runs)
        p["cache"].update(part_tokens=150, threads=1)
        (work / "params.yaml").write_text(yaml.safe_dump(p))

    env = project_env(REPO, DEEPSPEC_LOG="WARNING")
    work = workdir(tmp_path / "a", trained_target, regen_rows(30))
    params(work, LAYERS)
    subprocess.run([sys.executable, str(REPO / "stages" / "cache.py")], cwd=work, env=env, check=True,
                   capture_output=True)
    params(work, SUBSET)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), str(REPO / "stages" / "cache.py")]
    proc = subprocess.run(torchrun, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((work / "data/cache/report.json").read_text())
    assert report["mode"] == "derived" and report["derive"]["parts_computed"] == 0, json.dumps(report)[:3000]
    assert report["derive"]["method"] == ["hardlink"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the stage ran
    try:
        expected = scratch(tmp_path, trained_target, SUBSET, regen_rows(30), part_tokens=150)
    finally:
        torch.set_num_threads(threads)
    same_store_any_rank(str(work / "data/cache.zarr"), expected)
