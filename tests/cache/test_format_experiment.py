"""`dvc exp run -S cache.format=hdf5` is an experiment like any other: only `cache` and the stages
after it rerun, on a real DVC repo (a clone of this project) with a small target and a small split."""
import json
import shutil

import pytest
import yaml

from tests.conftest import project_env, run

pytestmark = pytest.mark.slow


def test_exp_run_cache_format_hdf5_reruns_only_cache_and_later(project, trained_target):
    params = yaml.safe_load((project / "params.yaml").read_text())
    model = project.parent / "model"
    shutil.copytree(trained_target, model)
    params["layers"] = [-1, 0, 2]
    params["target"]["source"] = str(model)
    params["cache"]["part_tokens"] = 400
    params["train"].update(steps=8, batch_size=4, warmup_steps=2, checkpoint_every=4, anchors_per_sample=4)
    params["eval"].update(suites=[{"source": "heldout", "max_prompts": 2}], max_new_tokens=8, sample=False)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = project_env(project, DEEPSPEC_LOG="WARNING")

    def dvc(*args):
        return run(["dvc", *args], project, env=env, timeout=1200).stdout

    dvc("repro", "split", "target")
    # regen with a model server takes minutes: its output is the split's rows (already chat rows),
    # recorded as the stage's result with `dvc commit`, as if it had run
    rows = (project / "data/split/train.jsonl").read_text().splitlines()[:24]
    (project / "data/regen").mkdir(parents=True, exist_ok=True)
    (project / "data/regen/train.jsonl").write_text("\n".join(rows) + "\n")
    (project / "data/regen/errors.jsonl").write_text("")
    (project / "data/regen/report.json").write_text("{}")
    dvc("commit", "-f", "regen")
    out = dvc("repro")
    assert "Running stage 'cache'" in out and "Running stage 'train'" in out
    base = json.loads((project / "data/cache/manifest.json").read_text())
    assert base.get("storage", "zarr") == "zarr" and (project / "data/cache.zarr/zarr.json").exists()
    run(["git", "add", "-A"], project)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "baseline"], project)

    out = dvc("exp", "run", "-S", "cache.format=hdf5", "-n", "hdf5")
    ran = {s for s in ("split", "target", "regen", "cache", "train", "eval", "export") if f"Running stage '{s}'" in out}
    assert {"split", "target", "regen"}.isdisjoint(ran) and {"cache", "train"} <= ran, out[-3000:]
    store = project / "data/cache.zarr"
    assert (store / "manifest.json").exists() and not (store / "zarr.json").exists()
    assert sorted(p.name for p in (store / "parts").iterdir()) == sorted(f"{p['name']}.h5" for p in base["parts"])
    manifest = json.loads((project / "data/cache/manifest.json").read_text())
    assert manifest["storage"] == "hdf5" and manifest["num_tokens"] == base["num_tokens"]
    metrics = json.loads((project / "data/cache/metrics.json").read_text())
    assert metrics["files"] == 2 + len(base["parts"])  # manifest.json, index/<h>.h5, one .h5 per part
    assert "hdf5" in dvc("exp", "show", "--csv")
