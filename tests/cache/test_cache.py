"""The cache stage and store: exactness, parts and resume, corruption, S3, torchrun, bad input."""
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
import yaml

from deepspec.cache.build.stage import build_cache, load_target
from deepspec.cache.read.checks import ChecksumError
from deepspec.cache.spec.format import CacheFormatError, decode_hidden, sample_id_to_str
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.build.regen_rows import EncodeRules, encode_rows
from deepspec.cache.tools.verify import verify
from deepspec.cache.write.writer import CacheWriter
from deepspec.config import CacheConfig, ConfigError
from tests.conftest import REPO, SAMPLE_CONVERSATIONS, clone_project, project_env, run

LAYERS = [-1, 0, 2]


def regen_rows(n=None):
    convs = SAMPLE_CONVERSATIONS if n is None else SAMPLE_CONVERSATIONS[:n]
    return [{"id": f"{i + 1:016x}", "conversations": c} for i, c in enumerate(convs)]


def workdir(tmp_path: Path, target: Path, rows=None) -> Path:
    work = tmp_path / "work"
    (work / "data" / "regen").mkdir(parents=True, exist_ok=True)
    if not (work / "data" / "target").exists():
        shutil.copytree(target, work / "data" / "target")
    with open(work / "data" / "regen" / "train.jsonl", "w") as f:
        for r in rows or regen_rows():
            f.write(json.dumps(r) + "\n")
    return work


def build(work: Path, **cfg) -> dict:
    cfg = CacheConfig(url=str(work / "data" / "cache.zarr"), **cfg)
    return build_cache(cfg, LAYERS, work / "data" / "regen" / "train.jsonl", work / "data" / "target")


def array_hashes(url: str) -> dict:
    out = {}
    root = Path(url)
    for p in sorted(root.rglob("*")):
        if p.is_file() and "/c/" in str(p.relative_to(root)).replace(os.sep, "/") + "/":
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_stored_values_equal_hidden_states_bitwise(tmp_path, trained_target):
    work = workdir(tmp_path, trained_target)
    build(work, batch_tokens=1)  # one sample per forward: the same computation as a plain forward
    reader = CacheReader(str(work / "data" / "cache.zarr"))
    tok, model = load_target(work / "data" / "target", torch.device("cpu"))
    rows = regen_rows()
    assert len(reader) == len(rows)
    ids = [sample_id_to_str(i) for i in reader.sample_ids()]
    assert sorted(ids) == sorted(r["id"] for r in rows)  # every row once (in a part, longest first)
    by_id = {r["id"]: r for r in rows}
    for index in (0, 7, len(rows) - 1):
        enc = encode_rows(tok, [by_id[ids[index]]], EncodeRules(1024))[0][0]
        sample = reader.read(index)
        assert sample["input_ids"].tolist() == enc.input_ids
        assert sample["loss_mask"].tolist() == enc.loss_mask
        with torch.no_grad():
            out = model(torch.tensor([enc.input_ids]), output_hidden_states=True)
        hs = out.hidden_states
        for layer in LAYERS:
            got = decode_hidden(*sample[layer], "bfloat16")
            assert torch.equal(got, hs[layer + 1][0].to(torch.bfloat16)), layer
        last = decode_hidden(*sample["last"], "bfloat16")
        assert torch.equal(last, hs[-1][0].to(torch.bfloat16))  # after the final norm


def test_batched_forward_matches_single_within_bf16_rounding(tmp_path, trained_target):
    single = workdir(tmp_path / "a", trained_target)
    batched = workdir(tmp_path / "b", trained_target)
    build(single, batch_tokens=1)
    build(batched, batch_tokens=4096)
    a, b = CacheReader(str(single / "data/cache.zarr")), CacheReader(str(batched / "data/cache.zarr"))
    for i in range(len(a)):
        sa, sb = a.read(i), b.read(i)
        for layer in [*LAYERS, "last"]:
            x, y = decode_hidden(*sa[layer], "bfloat16").float(), decode_hidden(*sb[layer], "bfloat16").float()
            torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)


def test_rerun_is_a_no_op_and_growth_appends_parts(tmp_path, trained_target):
    work = workdir(tmp_path, trained_target, regen_rows(30))
    build(work, part_tokens=200)
    url = str(work / "data" / "cache.zarr")
    before = array_hashes(url)
    parts_before = [p["name"] for p in CacheReader(url).manifest["parts"]]
    report = build(work, part_tokens=200)
    assert array_hashes(url) == before and report["manifest"]["num_samples"] == 30
    assert report["parts_kept"] == len(parts_before)
    workdir(tmp_path, trained_target, regen_rows())  # the source grew (rows appended)
    report = build(work, part_tokens=200)
    after = array_hashes(url)
    reader = CacheReader(url)
    names = [p["name"] for p in reader.manifest["parts"]]
    # parts are cut by content: appended rows change only the last part; every other part keeps
    # its name and files (the consolidated index is a new object)
    assert names[:len(parts_before) - 1] == parts_before[:-1]
    assert report["parts_kept"] >= len(parts_before) - 1
    assert all(after[k] == v for k, v in before.items() if k.split("/")[1] in names)
    assert not any(k.startswith(f"parts/{parts_before[-1]}/") for k in after) or parts_before[-1] in names
    assert len(reader) == len(regen_rows())
    assert sorted(sample_id_to_str(i) for i in reader.sample_ids()) == sorted(r["id"] for r in regen_rows())


def test_content_params_change_prunes_and_rebuilds(tmp_path, trained_target, caplog):
    work = workdir(tmp_path, trained_target, regen_rows(10))
    build(work)
    url = str(work / "data" / "cache.zarr")
    # derive_from none: computed (by default a layer subset is derived instead: tests/cache/test_derive.py)
    build_cache(CacheConfig(url=url, derive_from="none"), [0], work / "data/regen/train.jsonl", work / "data/target")
    assert "existing cache is stale (layers:" in caplog.text
    reader = CacheReader(url)
    assert reader.layers == [0] and len(reader) == 10
    assert (Path(url) / "parts").is_dir() and not list((Path(url) / "parts").glob("*/hidden/-1"))


def test_fp8_and_codecs_round_trip(tmp_path, trained_target):
    ref = workdir(tmp_path / "ref", trained_target, regen_rows(12))
    build(ref)
    exact = CacheReader(str(ref / "data/cache.zarr"))
    for dtype, codec in (("bfloat16", "blosc-zstd"), ("bfloat16", "blosc-lz4"), ("fp8", "none")):
        work = workdir(tmp_path / f"{dtype}-{codec}", trained_target, regen_rows(12))
        build(work, dtype=dtype, codec=codec)
        for fast in (True, False):
            r = CacheReader(str(work / "data/cache.zarr"), fast=fast)
            for i in range(len(r)):
                s, e = r.read(i), exact.read(i)
                assert (s["input_ids"] == e["input_ids"]).all() and (s["loss_mask"] == e["loss_mask"]).all()
                for layer in [*LAYERS, "last"]:
                    got, want = decode_hidden(*s[layer], dtype), decode_hidden(*e[layer], "bfloat16")
                    if dtype == "bfloat16":
                        assert torch.equal(got, want)
                    else:
                        cos = torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=-1)
                        assert cos.min() > 0.998


def test_flipped_byte_is_detected_naming_the_chunk(tmp_path, trained_target):
    work = workdir(tmp_path, trained_target, regen_rows(10))
    build(work, chunk_tokens=16)
    url = str(work / "data" / "cache.zarr")
    report = verify(url)
    # every chunk checked, an array's chunks read together (one request per array here, not per chunk)
    assert report["ok"] and report["chunks_checked"] >= 4 * report["array_reads"]
    first = CacheReader(url).manifest["parts"][0]["name"]
    shard = Path(url) / "parts" / first / "hidden" / "0" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # inside chunk 0
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=rf"parts/{first}/hidden/0/c/0/0: chunk 0 checksum mismatch"):
        verify(url)
    with pytest.raises(ChecksumError, match="chunk 0 checksum mismatch"):
        CacheReader(url).read(0)
    assert CacheReader(url).read(0, layers=[2])  # other arrays still read fine
    from deepspec.cli import main as cli

    assert cli(["cache", "verify", url]) == 1


def test_bad_rows_are_dropped_and_reported(tmp_path, trained_target):
    rows = regen_rows(5)
    rows.append({"id": "00000000000000ff", "conversations": [
        {"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "late answer"}]})
    work = workdir(tmp_path, trained_target, rows)
    report = build(work, max_length=64)
    assert report["dropped"] == [{"id": "00000000000000ff", "reason": "too_long",
                                  "detail": "the first answer does not fit in cache.max_length = 64"}]
    assert report["dropped_by_reason"] == {"too_long": 1}
    assert report["manifest"]["num_samples"] == 5


def test_layers_out_of_range_fail_before_loading_the_model(tmp_path, trained_target):
    work = workdir(tmp_path, trained_target, regen_rows(3))
    with pytest.raises(ConfigError, match=r"\[3\] out of range"):
        build_cache(CacheConfig(url=str(work / "c.zarr")), [0, 3], work / "data/regen/train.jsonl",
                    work / "data/target")
    assert not (work / "c.zarr").exists()


def test_store_from_another_target_is_refused_when_shared(tmp_path, trained_target, small_model_dir):
    work = workdir(tmp_path, trained_target, regen_rows(3))
    build(work)
    url = str(work / "data" / "cache.zarr")
    other = dict(CacheReader(url).manifest["target"], weights_sha256="0" * 64)
    with pytest.raises(CacheFormatError, match="target.weights_sha256: store has"):
        CacheReader(url, expect={"target": other})
    with pytest.raises(CacheFormatError, match="refusing to overwrite"):
        CacheWriter(url, dict(CacheReader(url).manifest, target=other), prune_stale=False)


def test_unwritable_url_and_failed_part_leave_no_half_committed_part(tmp_path, trained_target, monkeypatch):
    work = workdir(tmp_path, trained_target, regen_rows(30))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises((CacheFormatError, OSError)):
        build_cache(CacheConfig(url=str(blocker / "cache.zarr")), LAYERS, work / "data/regen/train.jsonl",
                    work / "data/target")
    # a disk that fills up while the third part is written (no real component does this on demand)
    from deepspec.cache.backends.zarr.write import ZarrStoreWriter

    real = ZarrStoreWriter.open_shard
    seen = []

    def flaky(self, key):
        name = key.split("/")[1] if key.startswith("parts/") else None
        if name is not None and name not in seen:
            seen.append(name)
        if name is not None and seen.index(name) == 2:
            raise OSError(28, "No space left on device")
        return real(self, key)

    monkeypatch.setattr(ZarrStoreWriter, "open_shard", flaky)
    with pytest.raises(CacheFormatError, match="No space left on device"):
        build(work, part_tokens=200)
    monkeypatch.setattr(ZarrStoreWriter, "open_shard", real)
    url = str(work / "data" / "cache.zarr")
    # the root still lists what the last finished run listed (nothing: this is the first run);
    # the two parts written before the failure are committed and kept for the rerun
    assert len(CacheReader(url)) == 0
    writer = CacheWriter(url, CacheReader(url).manifest.to_dict(), prune_stale=False)
    committed = sorted(writer.committed_parts())
    writer.abort()
    writer.release()
    assert committed == sorted(seen[:2])
    report = build(work, part_tokens=200)  # the rerun prunes the half-written part and finishes
    assert report["parts_kept"] == 2
    assert len(CacheReader(url)) == 30 and verify(url)["ok"]


def _stage_env():
    return project_env(REPO, DEEPSPEC_LOG="WARNING")


def _write_params(work: Path, **cache):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["layers"] = LAYERS
    params["cache"] = dict(params.get("cache") or {}, **cache)
    (work / "params.yaml").write_text(yaml.safe_dump(params))


@pytest.mark.slow
def test_sigkill_mid_stage_then_rerun_equals_a_clean_run(tmp_path, trained_target):
    rows = regen_rows() * 1
    clean = workdir(tmp_path / "clean", trained_target, rows)
    crash = workdir(tmp_path / "crash", trained_target, rows)
    for w in (clean, crash):
        _write_params(w, part_tokens=150, batch_tokens=64)
    cmd = [sys.executable, str(REPO / "stages" / "cache.py")]
    subprocess.run(cmd, cwd=clean, env=_stage_env(), check=True, capture_output=True)
    proc = subprocess.Popen(cmd, cwd=crash, env=_stage_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = crash / "data" / "cache.zarr" / "parts"
    deadline = time.time() + 120
    while time.time() < deadline and not (parts.exists() and len(list(parts.glob("*"))) >= 3):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    total = len(CacheReader(str(clean / "data/cache.zarr")).parts)
    assert 0 < len(list(parts.glob("*"))) < total
    subprocess.run(cmd, cwd=crash, env=_stage_env(), check=True, capture_output=True)
    assert array_hashes(str(crash / "data/cache.zarr")) == array_hashes(str(clean / "data/cache.zarr"))
    files = lambda w: sorted(str(p.relative_to(w)) for p in (w / "data/cache.zarr").rglob("*"))  # noqa: E731
    assert files(crash) == files(clean)  # no debris (temp files, lock file) left for DVC to hash
    assert json.loads((crash / "data/cache/metrics.json").read_text())["samples"] == len(rows)


@pytest.mark.slow
def test_torchrun_two_processes_equal_one_process(tmp_path, trained_target):
    one = workdir(tmp_path / "one", trained_target)
    two = workdir(tmp_path / "two", trained_target)
    for w in (one, two):
        _write_params(w, part_tokens=300)
    subprocess.run([sys.executable, str(REPO / "stages" / "cache.py")], cwd=one, env=_stage_env(), check=True,
                   capture_output=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(__import__("deepspec.data.servers", fromlist=["free_port"]).free_port()),
                str(REPO / "stages" / "cache.py")]
    proc = subprocess.run(torchrun, cwd=two, env=_stage_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a, b = CacheReader(str(one / "data/cache.zarr")), CacheReader(str(two / "data/cache.zarr"))
    ranks = {json.loads((two / "data/cache.zarr/parts" / p / "zarr.json").read_text())["attributes"]["rank"]
             for p in b.parts}
    assert ranks == {0, 1}
    assert array_hashes(str(one / "data/cache.zarr")) == array_hashes(str(two / "data/cache.zarr"))
    assert len(a) == len(b) == len(regen_rows())
    # each process tokenised its own share of the input for the plan (gathered over gloo)
    indexed = json.loads((two / "data/cache/metrics.json").read_text())["rows_indexed_by_rank"]
    assert sum(indexed) == len(regen_rows()) and min(indexed) > 0
    assert json.loads((one / "data/cache/metrics.json").read_text())["rows_indexed_by_rank"] == [len(regen_rows())]


def test_cache_stage_writes_to_s3_and_never_overwrites_a_foreign_store(tmp_path, trained_target, moto):
    bucket = moto.bucket("cache-stage")
    work = workdir(tmp_path, trained_target, regen_rows(20))
    lake = f"s3://{bucket}/runs/lake"
    cfg = CacheConfig(url=lake, part_tokens=200, storage_options=moto.storage_options)
    report = build_cache(cfg, LAYERS, work / "data/regen/train.jsonl", work / "data/target")
    url = report["url"]
    assert url.startswith(lake + "/") and report["manifest"]["num_samples"] == 20
    assert verify(url, moto.storage_options)["ok"]
    local = workdir(tmp_path / "local", trained_target, regen_rows(20))
    build(local, part_tokens=200)
    a, b = CacheReader(url, moto.storage_options), CacheReader(str(local / "data/cache.zarr"))
    for i in range(len(b)):
        sa, sb = a.read(i), b.read(i)
        assert all(np.array_equal(np.asarray(sa[k][0] if isinstance(sa[k], tuple) else sa[k]),
                                  np.asarray(sb[k][0] if isinstance(sb[k], tuple) else sb[k])) for k in sb)
    objects = moto.client().list_objects_v2(Bucket=bucket, Prefix=url.split("/", 3)[3] + "/")["Contents"]
    assert any(o["Key"].endswith("hidden/0/c/0/0") for o in objects)
    assert not any(o["Key"].endswith("lease.json") for o in objects)  # released, never tracked by DVC
    # a writer whose content differs is refused at that store, naming the field; nothing is pruned
    with pytest.raises(CacheFormatError, match=r"layers: store has \[-1, 0, 2\], expected \[0\]"):
        CacheWriter(url, dict(a.manifest, layers=[0]), moto.storage_options)
    assert CacheReader(url, moto.storage_options).layers == LAYERS


LOCAL_OUT = "      - data/cache.zarr:"
S3_OUT = """      - ${cache.url}:
          cache: false
          persist: true"""


def _s3_objects(moto, bucket: str, prefix: str) -> dict[str, str]:
    """key -> sha256 of the bytes @ LastModified: equal dicts mean not one object was rewritten."""
    s3, out = moto.client(), {}
    for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
        body = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        out[o["Key"]] = hashlib.sha256(body).hexdigest() + "@" + o["LastModified"].isoformat()
    return out


@pytest.mark.slow
def test_dvc_s3_cache_lake_layer_experiment_and_going_back(tmp_path, trained_target, moto):
    """The GPU recipe's dvc.yaml edit for a cache on S3, run through DVC against moto: the lake is
    tracked as an uncached output, `dvc exp run -S 'layers=[...]'` writes a sibling store without
    touching the original, and going back (rerun or `dvc exp apply`) rewrites nothing."""
    recipe = (REPO / "docs/gpu-recipe.md").read_text()
    assert S3_OUT in recipe, "docs/gpu-recipe.md must show the exact edit this test makes"
    repo = clone_project(tmp_path / "repo")
    dvc_yaml = (repo / "dvc.yaml").read_text()
    start = dvc_yaml.index(LOCAL_OUT)
    end = dvc_yaml.index("persist: true", start) + len("persist: true")
    # only the cache stage: its inputs are copied in below, and a workspace `dvc exp run` would
    # delete upstream outputs whose hashes are not in this clone's DVC cache
    pipeline = yaml.safe_load(dvc_yaml[:start] + S3_OUT + dvc_yaml[end:])
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"cache": pipeline["stages"]["cache"]}}))
    bucket = moto.bucket("dvc-external")
    lake = f"s3://{bucket}/lake"
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["layers"] = LAYERS
    params["cache"].update(url=lake, part_tokens=200)
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    workdir(tmp_path, trained_target, regen_rows(12))
    shutil.copytree(tmp_path / "work" / "data", repo / "data", dirs_exist_ok=True)
    # one endpoint setting that DVC, s3fs and boto3 all read
    env = project_env(repo, **moto.env, AWS_ENDPOINT_URL=moto.endpoint)
    store_of = lambda: json.loads((repo / "data/cache/manifest.json").read_text())["url"]  # noqa: E731

    out = run(["dvc", "repro", "-s", "cache"], repo, env).stdout
    assert "Running stage 'cache'" in out
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["cache"]
    tracked = {o["path"]: o for o in lock["outs"]}
    assert tracked[lake]["md5"].endswith(".dir") and tracked[lake]["nfiles"] > 10
    assert not (repo / "data/cache.zarr").exists()
    original = store_of()
    assert original.startswith(lake + "/") and CacheReader(original, moto.storage_options).lengths().size == 12
    assert "up to date" in run(["dvc", "status", "cache"], repo, env).stdout
    assert "Running stage" not in run(["dvc", "repro", "-s", "cache"], repo, env).stdout
    prefix = original.split("/", 3)[3] + "/"
    before = _s3_objects(moto, bucket, prefix)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    run(["git", "add", "-A"], repo, env)
    run([*git, "commit", "-qm", "cache on S3"], repo, env)

    # the documented experiment: a sibling store in the lake; the original is not touched
    out = run(["dvc", "exp", "run", "-s", "cache", "-n", "two-layers", "-S", "layers=[0,2]"], repo, env).stdout
    assert "Running stage 'cache'" in out
    smaller = store_of()
    assert smaller != original and smaller.startswith(lake + "/")
    assert CacheReader(smaller, moto.storage_options).layers == [0, 2]
    assert _s3_objects(moto, bucket, prefix) == before
    lake_after = _s3_objects(moto, bucket, "lake/")

    # going back: the original store is complete, so nothing in the lake is written
    run(["dvc", "exp", "run", "-s", "cache", "-S", f"layers={LAYERS}"], repo, env)
    assert store_of() == original and _s3_objects(moto, bucket, "lake/") == lake_after
    assert not any(k.endswith("lease.json") for k in lake_after)
    # and the experiment is one `dvc exp apply` away, with nothing to recompute
    run(["dvc", "exp", "apply", "two-layers"], repo, env)
    assert store_of() == smaller
    assert "up to date" in run(["dvc", "status", "cache"], repo, env).stdout

    # DVC notices a change made to the lake behind its back
    s3 = moto.client()
    key = next(k for k in before if k.endswith("input_ids/c/0"))
    s3.delete_object(Bucket=bucket, Key=key)
    assert "modified" in run(["dvc", "status", "cache"], repo, env).stdout
