"""`make gpu-check CPU=1`: the prepared GPU check runs its every section on the CPU, so it cannot rot
while no GPU is at hand (it is the one command a lent H200 runs)."""
import json
import subprocess

import pytest

from tests.conftest import REPO, project_env


@pytest.mark.slow
def test_the_gpu_check_passes_on_the_cpu(tmp_path):
    proc = subprocess.run(["make", "-s", "gpu-check", "CPU=1", f"OUT={tmp_path}"], cwd=REPO, env=project_env(REPO),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["failed"] == [] and result["env"]["device"] == "cpu"
    for target in ("tiny", "wide"):
        cache, train, eval_ = (result[f"{target}.{s}"] for s in ("cache", "train", "eval"))
        assert cache["states_ok"] and cache["states_checked"] > 0 and cache["capture_vs_plain"] > 0
        assert train["micro_batches"] == train["steps"] * 2 and 0 <= train["data_wait_fraction"] < 1
        assert train["workers"] == 1 and 0 <= train["data_wait_fraction_no_workers"] < 1
        assert eval_["prompts"] > 0 and eval_["tau_sampled"] >= 1.0
    assert result["tiny.eval"]["greedy_match"] == 1.0
    assert result["torchrun"]["mode"] == "derived" and result["torchrun"]["parts_computed"] == 0
