"""The split stage driven by real DVC in a throwaway clone of this repo."""
import hashlib

import pytest
import yaml

from tests.conftest import run

pytestmark = pytest.mark.slow


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def set_seed(repo, seed):
    p = repo / "params.yaml"
    params = yaml.safe_load(p.read_text())
    params["split"]["seed"] = seed
    p.write_text(yaml.safe_dump(params, sort_keys=False))


def test_dvc_repro_split_in_a_clone(project):
    out = run(["dvc", "repro", "split"], project).stdout
    assert "Running stage 'split'" in out
    train, evals = project / "data/split/train.jsonl", project / "data/split/eval.jsonl"
    first = (digest(train), digest(evals))

    again = run(["dvc", "repro", "split"], project).stdout
    assert "Running stage" not in again and "didn't change" in again

    set_seed(project, 7)
    run(["dvc", "repro", "split"], project)
    assert (digest(train), digest(evals)) != first

    set_seed(project, 0)
    run(["dvc", "repro", "split"], project)
    assert (digest(train), digest(evals)) == first


@pytest.mark.parametrize("content", [b"", b"<html>not a dataset</html>\n" * 50], ids=["empty", "malformed"])
def test_a_source_with_no_usable_row_stops_dvc_at_the_split_stage(project, content):
    (project / "bad.jsonl").write_bytes(content)
    p = project / "params.yaml"
    params = yaml.safe_load(p.read_text())
    params["split"]["source"] = "bad.jsonl"
    p.write_text(yaml.safe_dump(params, sort_keys=False))
    proc = run(["dvc", "repro", "--downstream", "split"], project, check=False)
    assert proc.returncode != 0
    assert "bad.jsonl" in proc.stdout
    assert ("holds no rows" if not content else "malformed_json: 50") in proc.stdout
    assert "Running stage 'split'" in proc.stdout and "Running stage 'regen'" not in proc.stdout
    assert not (project / "data/split/train.jsonl").exists()
