"""The cache stage's output follows its input: after each kind of change to the regen output (or the
target's template), `dvc repro` of the cache stage leaves exactly the store a from-scratch build of the
new input gives, and the file `train` depends on changes exactly when the content did."""
import json
import random
import shutil
from pathlib import Path

import pytest
import yaml

from tests.cache.test_cache import LAYERS, regen_rows, workdir
from tests.cache.test_derive import manifest, scratch, store_files
from tests.conftest import clone_project, project_env, run

pytestmark = pytest.mark.slow


def write_rows(repo: Path, rows: list[dict]) -> None:
    with open(repo / "data/regen/train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def rewrite_template(target: Path) -> None:
    """The same template with a default system line: every sample's token ids change."""
    jinja = target / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text("{{- 'system: be brief\\n' -}}" + jinja.read_text())
        return
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{- 'system: be brief\\n' -}}" + config["chat_template"]
    (target / "tokenizer_config.json").write_text(json.dumps(config))


def test_every_change_of_the_input_gives_the_from_scratch_store_and_reruns_train_only_then(tmp_path, trained_target):
    repo = clone_project(tmp_path / "repo")
    pipeline = yaml.safe_load((repo / "dvc.yaml").read_text())
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"cache": pipeline["stages"]["cache"]}}))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["layers"] = LAYERS
    params["cache"].update(part_tokens=200)
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    rows = regen_rows(40)
    work = workdir(tmp_path, trained_target, rows)
    shutil.copytree(work / "data", repo / "data", dirs_exist_ok=True)
    env = project_env(repo, DEEPSPEC_LOG="WARNING")
    store = repo / "data" / "cache.zarr"

    def outs() -> dict:
        lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["cache"]["outs"]
        return {o["path"]: o["md5"] for o in lock}

    def repro(*extra) -> dict:
        run(["dvc", "repro", "-s", *extra, "cache"], repo, env)
        return json.loads((repo / "data/cache/report.json").read_text())

    def equals_scratch(name: str, rows: list[dict], target: Path = trained_target) -> None:
        want = scratch(tmp_path / name, target, LAYERS, rows, part_tokens=200)
        assert store_files(str(store)) == store_files(want), name
        got, expect = manifest(str(store)), manifest(want)
        got.pop("derived_from", None)
        assert got == expect and got["num_samples"] == len(rows), name

    first = repro()
    assert first["parts_kept"] == 0
    equals_scratch("base", rows)
    base = outs()

    # the same input again, forced: not one output that train depends on changes (timings are metrics)
    again = repro("-f")
    assert again["samples_kept"] == len(rows) and again["parts_kept"] == again["parts"]
    data = ("data/cache.zarr", "data/cache/manifest.json")  # what train reads and depends on
    assert {k: outs()[k] for k in data} == {k: base[k] for k in data}
    same = {k: v for k, v in again.items() if k not in ("parts_kept", "samples_kept", "derive")}
    assert same == {k: v for k, v in first.items() if k not in ("parts_kept", "samples_kept", "derive")}
    assert "wall_s" not in again and "wall_s" in json.loads((repo / "data/cache/metrics.json").read_text())

    rng = random.Random(3)
    changes = []
    edited = [dict(r) for r in rows]
    edited[17] = dict(edited[17], conversations=[*edited[17]["conversations"][:-1],
                                                 {"role": "assistant", "content": "a rewritten answer."}])
    changes.append(("one answer rewritten", edited))
    changes.append(("rows dropped", [r for i, r in enumerate(edited) if i not in (0, 11, 12, 39)]))
    grown = changes[-1][1] + [{"id": f"{100 + i:016x}", "conversations": [
        {"role": "user", "content": f"What is {a} times {b}?"},
        {"role": "assistant", "content": f"{a} times {b} is {a * b}."}]}
        for i, (a, b) in enumerate((rng.randint(2, 99), rng.randint(2, 99)) for _ in range(6))]
    changes.append(("rows added", grown))
    changes.append(("rows reordered", grown[20:] + grown[:20]))
    previous = base
    for name, new_rows in changes:
        write_rows(repo, new_rows)
        report = repro()
        assert 0 < report["parts_kept"] < report["parts"], (name, report)  # only affected parts recomputed
        equals_scratch(name, new_rows)
        now = outs()
        assert now["data/cache/manifest.json"] != previous["data/cache/manifest.json"], name  # train reruns
        previous = now

    # a template change: every token sequence changes, so nothing is reused
    rewrite_template(repo / "data/target")
    target2 = tmp_path / "target2"
    shutil.copytree(trained_target, target2)
    rewrite_template(target2)
    report = repro()
    assert report["samples_kept"] == 0, report
    equals_scratch("template changed", changes[-1][1], target2)
    assert outs()["data/cache/manifest.json"] != previous["data/cache/manifest.json"]
