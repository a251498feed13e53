"""The trained `builtin:tiny` target ships in `embedded/` (a DVC remote inside the repo) so that `make repro`
on a fresh clone pulls it instead of training it for ~10 minutes. It must be exactly what dvc.lock
records for the target stage at the current code and params: otherwise `make repro` silently falls back
to training (and the 15-minute budget is gone). Fix a failure here with `make embedded-target` (or, for a
change that cannot alter the trained target, `dvc commit target`) and commit `embedded/` and dvc.lock."""
import json

import yaml

from tests.conftest import REPO, clone_project, run


def test_the_shipped_target_is_the_target_stage_output_for_this_code_and_params(tmp_path):
    repo = clone_project(tmp_path / "repo")
    run(["dvc", "pull", "-r", "embedded", "target"], repo)
    status = run(["dvc", "status", "target", "--json"], repo).stdout
    assert json.loads(status) == {}, f"dvc.lock's target stage is stale for this code/params: {status}"
    metrics = json.loads((repo / "data/target/metrics.json").read_text())
    identity = json.loads((repo / "data/target/identity.json").read_text())
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    assert params["target"]["source"] == "builtin:tiny" and identity["num_layers"] > max(params["layers"])
    assert metrics["heldout_loss"] < metrics["uniform_loss"] / 3

