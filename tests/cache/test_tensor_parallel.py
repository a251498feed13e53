"""The cache stage with a tensor-parallel target (`cache.tensor_parallel: k` under torchrun, gloo on the
CPU): transformers' own plan shards the embedded target over each group of k ranks, the groups' leads
build the store as a data-parallel job and their followers run each forward with them.

Exactness is stated, not assumed: a sharded forward sums in another order, so a state may differ from
the single-device one by rounding. Measured here on the embedded target (float32 compute, bfloat16
store, 61 samples): 99.99 % of the values are bit-equal to the single-device store's, and every value
lies within one bfloat16 ulp (2 half-ulps, the unit `make gpu-check` reports) of its token's largest
magnitude (1.02 half-ulps measured). The store's compute fingerprint names the degree."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from deepspec.cache.read.reader import CacheReader
from deepspec.cache.spec.format import decode_hidden
from deepspec.data.servers import free_port
from tests.cache.test_cache import array_hashes, regen_rows, workdir
from tests.conftest import REPO, project_env

LAYERS = [-1, 1, 17, 33]
# bfloat16 half-ulps (2^-8) of its token's largest magnitude a sharded forward's stored value may differ by
TOLERANCE_HALF_ULPS = 2.0


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> Path:
    """builtin:tiny as dvc.lock records it (4 heads, 2 KV heads: it splits in two)."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check.shipped_target(tmp_path_factory.mktemp("embedded") / "target")


def project(root: Path, target: Path, **cache) -> Path:
    work = workdir(root, target, regen_rows())
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["layers"] = LAYERS
    params["cache"] = dict(params.get("cache") or {}, part_tokens=400, batch_tokens=256, **cache)
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    return work


def stage(work: Path, ranks: int, wait: bool = True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
           str(free_port()), str(REPO / "stages" / "cache.py")] if ranks > 1 else \
        [sys.executable, str(REPO / "stages" / "cache.py")]
    env = project_env(REPO, DEEPSPEC_LOG="WARNING", OMP_NUM_THREADS="1")
    if not wait:
        return subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def store(work: Path) -> str:
    return str(work / "data" / "cache.zarr")


@pytest.fixture(scope="module")
def builds(tmp_path_factory, embedded) -> dict[str, Path]:
    """The same input built by one process (threads 1, as each torchrun rank runs) and by one group of
    two ranks (tensor_parallel 2)."""
    root = tmp_path_factory.mktemp("tp")
    one, two = project(root / "one", embedded, threads=1), project(root / "two", embedded, tensor_parallel=2)
    stage(one, 1)
    stage(two, 2)
    return {"one": one, "two": two}


def test_a_sharded_target_builds_the_single_device_store_within_the_stated_tolerance(builds):
    a, b = CacheReader(store(builds["one"])), CacheReader(store(builds["two"]))
    assert len(a) == len(b) == len(regen_rows())
    assert np.array_equal(a.sample_ids(), b.sample_ids()) and np.array_equal(a.lengths(), b.lengths())
    assert a.manifest.extra.get("compute", a.manifest.to_dict().get("compute", {})).get("tensor_parallel") is None
    assert b.manifest.to_dict()["compute"]["tensor_parallel"] == 2  # another store: the degree is in its name
    worst, values, equal = 0.0, 0, 0
    for k in range(len(a)):
        x, y = a.read(k), b.read(k)
        assert np.array_equal(x["input_ids"], y["input_ids"]) and np.array_equal(x["loss_mask"], y["loss_mask"])
        for key in [*LAYERS, "last"]:
            want = decode_hidden(*x[key], a.dtype).float()
            diff = (decode_hidden(*y[key], b.dtype).float() - want).abs()
            # in half-ulps of the token's largest magnitude: a value near zero, the sum of terms that
            # cancel, takes its rounding from the terms, not from itself
            worst = max(worst, (diff / (want.abs().amax(-1, keepdim=True) * 2.0**-8)).max().item())
            values, equal = values + diff.numel(), equal + int((diff == 0).sum())
    print(f"tensor_parallel 2 vs one device: {equal / values:.5f} of {values} values bit-equal, worst "
          f"{worst:.3f} bf16 half-ulps of its token's largest magnitude")
    assert worst <= TOLERANCE_HALF_ULPS and equal / values >= 0.99


def test_two_groups_build_the_store_one_group_builds(builds, tmp_path, embedded):
    """4 ranks, k = 2: two groups share the parts as two data-parallel ranks do; each part's states
    come from the same sharded forward, so the store is bit for bit one group's."""
    four = project(tmp_path / "four", embedded, tensor_parallel=2)
    stage(four, 4)
    assert array_hashes(store(four)) == array_hashes(store(builds["two"]))
    ranks = {json.loads((Path(store(four)) / "parts" / p / "zarr.json").read_text())["attributes"]["rank"]
             for p in CacheReader(store(four)).parts}
    assert ranks == {0, 1}  # each group's lead wrote its share


def test_a_follower_killed_mid_stage_then_a_rerun_builds_the_same_store(builds, tmp_path, embedded):
    work = project(tmp_path / "crash", embedded, tensor_parallel=2)
    proc = stage(work, 2, wait=False)
    parts = Path(store(work)) / "parts"
    deadline = time.time() + 300
    while time.time() < deadline and not (parts.exists() and len(list(parts.glob("p*"))) >= 2):
        time.sleep(0.05)
    follower = [int(p) for p in subprocess.run(["pgrep", "-f", "-s", str(os.getpgid(proc.pid)), "stages/cache.py"],
                                               capture_output=True, text=True).stdout.split()]
    assert follower, "no rank process found"
    os.kill(max(follower), signal.SIGKILL)  # the youngest: a rank (torchrun's agent started first)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    stage(work, 2)
    assert array_hashes(store(work)) == array_hashes(store(builds["two"]))


def test_a_degree_the_heads_do_not_split_into_is_refused_naming_them(tmp_path, trained_target):
    """The trained test target has 2 heads and 1 KV head: k = 2 would fail only at the first forward."""
    work = project(tmp_path / "bad", trained_target, tensor_parallel=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(REPO / "stages" / "cache.py")]
    proc = subprocess.run(cmd, cwd=work, env=project_env(REPO, DEEPSPEC_LOG="WARNING"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "num_key_value_heads = 1 does not split over tensor_parallel = 2" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_smollm2_over_three_ranks_its_heads_split_in_three(tmp_path):
    """SmolLM2-135M: 9 attention heads and 3 KV heads split three ways (not two: refused above for
    the same reason); its stored states against one process's, in the same unit."""
    from deepspec.config import TargetConfig
    from deepspec.models.prepare import prepare_target
    from tests.models.test_target import corpus

    target = tmp_path / "smollm2"
    prepare_target(TargetConfig(source="builtin:smollm2-135m"), [1, 14, 28], corpus(), target)
    rows = regen_rows(12)
    works = {}
    for name, ranks, extra in (("one", 1, {"threads": 1}), ("three", 3, {"tensor_parallel": 3})):
        work = workdir(tmp_path / name, target, rows)
        params = yaml.safe_load((REPO / "params.yaml").read_text())
        params["layers"] = [1, 14, 28]
        params["cache"] = dict(params.get("cache") or {}, part_tokens=400, batch_tokens=512, **extra)
        (work / "params.yaml").write_text(yaml.safe_dump(params))
        stage(work, ranks)
        works[name] = CacheReader(store(work))
    a, b = works["one"], works["three"]
    assert len(a) == len(b) == len(rows) and np.array_equal(a.sample_ids(), b.sample_ids())
    assert b.manifest.to_dict()["compute"]["tensor_parallel"] == 3
    worst = 0.0
    for k in range(len(a)):
        x, y = a.read(k), b.read(k)
        assert np.array_equal(x["input_ids"], y["input_ids"]) and np.array_equal(x["loss_mask"], y["loss_mask"])
        for key in [1, 14, 28, "last"]:
            want = decode_hidden(*x[key], a.dtype).float()
            diff = (decode_hidden(*y[key], b.dtype).float() - want).abs()
            worst = max(worst, (diff / (want.abs().amax(-1, keepdim=True) * 2.0**-8)).max().item())
    print(f"SmolLM2, tensor_parallel 3 vs one device: worst {worst:.3f} bf16 half-ulps of its token's largest magnitude")
    assert worst <= TOLERANCE_HALF_ULPS


def test_a_degree_that_does_not_divide_the_launch_or_a_model_without_a_plan_is_refused():
    import torch
    from transformers import GPT2Config, Qwen3Config

    from deepspec.models.tensor_parallel import Groups, refuse_unshardable

    with pytest.raises(ValueError, match="tensor_parallel = 2 does not divide the launch's 3 ranks"):
        Groups.make(0, 3, 2, torch.device("cpu"))  # refused before any collective
    with pytest.raises(ValueError, match="has no tensor-parallel plan in transformers"):
        refuse_unshardable(GPT2Config(n_layer=1, n_head=2, n_embd=8), 2)
    refuse_unshardable(Qwen3Config(num_attention_heads=4, num_key_value_heads=2), 2)
    with pytest.raises(ValueError, match="num_key_value_heads = 2 does not split over tensor_parallel = 4"):
        refuse_unshardable(Qwen3Config(num_attention_heads=4, num_key_value_heads=2), 4)


def test_read_through_capture_ranks_shard_the_target_and_fill_the_store_a_sharded_cache_stage_builds(
        builds, tmp_path, embedded):
    """train.capture: read-through with train.capture_ranks 2 and cache.tensor_parallel 2 (3 ranks: one
    trainer, one capture group of two): the group's lead writes the parts the trainer waits for, its
    follower runs each forward with it, and the store is bit for bit the sharded cache stage's."""
    from tests.train.test_read_through import TRAIN

    work = project(tmp_path / "rt", embedded, tensor_parallel=2)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["train"] = {**params["train"], **TRAIN, "capture": "read-through", "capture_ranks": 2, "steps": 6,
                       "threads": 1}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    env = project_env(REPO, DEEPSPEC_LOG="WARNING", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(REPO / "stages" / "cache.py")], cwd=work, env=env, check=True,
                   capture_output=True)  # the plan only
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port()),
           str(REPO / "stages" / "train.py")]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    filled = str(work / "data" / "cache-read-through.zarr")
    assert array_hashes(filled) == array_hashes(store(builds["two"]))
    assert CacheReader(filled).manifest.to_dict()["compute"]["tensor_parallel"] == 2
