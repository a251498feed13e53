"""`make gpu-goals CPU=1`: the GPU goals command runs its every section on the CPU, so it cannot rot
while no GPU is at hand (its GPU table is what a lent GPU prints)."""
import json
import subprocess

import pytest

from tests.conftest import REPO, project_env


@pytest.mark.slow
def test_the_gpu_goals_command_runs_every_section_on_the_cpu(tmp_path):
    proc = subprocess.run(["make", "-s", "gpu-goals", "CPU=1", f"OUT={tmp_path}"], cwd=REPO, env=project_env(REPO),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_goals.json").read_text())
    assert result["env"]["device"] == "cpu"
    assert not [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    assert result["capture.tiny"]["ratio"] > 0 and result["writeback.tiny"]["ratio"] > 0
    assert result["compile.tiny"]["compiled_vs_eager"] > 0 and 1 <= result["compile.tiny"]["graphs"] <= 3
    assert result["train.tiny"]["ratio"] > 0 and result["host.tiny"]["ops"] > 0
    # on the CPU (deterministic) both runs train on the same batches and give the same draft
    assert result["read-through"]["same_batches"] and result["read-through"]["same_draft"]
    for line in ("capture vs plain forward (tiny)", "loader vs resident (defaults) (tiny)",
                 "read-through draft == offline"):
        assert line in proc.stdout
