"""`dvc exp run -S train.algorithm=eagle3` without DVC's overhead: the train, eval and export stage scripts, run
as DVC runs them (cwd = the project, params.yaml, data/), on the small fixtures with only that switch (and
sizes small enough for a test) changed: train picks three cached layers and says which, eval drafts chains,
export writes the EAGLE-3 formats and refuses dflash."""
import json
import shutil
import subprocess
import sys

import yaml

from tests.conftest import REPO, SAMPLE_CONVERSATIONS, project_env


def run_stage(work, name):
    proc = subprocess.run([sys.executable, str(REPO / "stages" / f"{name}.py")], cwd=work, env=project_env(REPO),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_algorithm_eagle3_runs_through_train_eval_export(tmp_path, trained_target, small_cache):
    work = tmp_path / "work"
    shutil.copytree(trained_target, work / "data" / "target")
    (work / "data" / "split").mkdir(parents=True)
    with open(work / "data" / "split" / "eval.jsonl", "w") as f:
        for i, conv in enumerate(SAMPLE_CONVERSATIONS[:3]):
            f.write(json.dumps({"id": f"e{i}", "task": "math", "turns": [conv[0]["content"]]}) + "\n")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["layers"] = [-1, 0, 2]
    params["cache"]["url"] = str(small_cache)
    params["train"] |= {"algorithm": "eagle3", "steps": 6, "batch_size": 4, "checkpoint_every": 6, "draft_vocab_size": 64}
    params["eval"] = {"suites": [{"source": "heldout"}], "max_new_tokens": 12, "sample": True}
    (work / "params.yaml").write_text(yaml.safe_dump(params))

    out = run_stage(work, "train")
    assert "eagle3: train.layers not set, fusing cached layers [-1, 0, 2]" in out
    draft = json.loads((work / "data" / "draft" / "config.json").read_text())
    assert draft["algorithm"] == "eagle3" and draft["target_layers"] == [-1, 0, 2] and draft["ttt_steps"] == 4

    metrics = json.loads(run_stage(work, "eval").strip().splitlines()[-1])
    assert metrics["heldout"]["greedy_match"] == 1.0 and metrics["heldout"]["tau"] >= 1.0
    report = json.loads((work / "data" / "eval" / "report.json").read_text())
    assert report["suites"]["heldout"]["greedy"]["mean_proposal"] <= 4 and report["protocol"]["block_size"] == 4

    assert json.loads(run_stage(work, "export").strip().splitlines()[-1]) == {
        "speculators": "exported", "dflash": "refused", "sglang-eagle3": "refused"}   # the fixture's layers include -1
    report = json.loads((work / "data" / "export" / "report.json").read_text())["formats"]
    assert report["speculators"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    assert "-1" in report["sglang-eagle3"]["reason"] and "chain" in report["dflash"]["reason"]
