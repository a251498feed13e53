"""The whole pipeline on the embedded default, driven by real DVC in throwaway clones, and the
three data-lake workflows (share through an S3 remote, a smaller-cache experiment, growth) plus
integrity, against a real S3-compatible server (moto_server) on 127.0.0.1.

`dvc repro` of the full default pipeline runs once per session (the `pipeline` fixture), as `make repro`
runs it (the trained target pulled from the repo's `embedded` remote; tests/test_embedded_target.py
checks that it is the target stage's output for the current code and params); every test here reuses
that clone, in the order written.
"""
import dataclasses
import hashlib
import json
import random
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import clone_project, project_env, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

TIMINGS: dict[str, float] = {}


@pytest.fixture(autouse=True)
def report_timings(request):
    """Hand TIMINGS to the test report; tests/conftest.py prints them in the terminal summary (the
    report, unlike a module global, also reaches it from a worker process)."""
    yield
    request.node.user_properties.append(("e2e_timings", dict(TIMINGS)))


def dvc(repo: Path, *args: str, env=None, check=True, timeout=1800):
    t0 = time.time()
    out = run(["dvc", *args], repo, env=env or project_env(repo), check=check, timeout=timeout)
    TIMINGS[" ".join(args[:2])] = TIMINGS.get(" ".join(args[:2]), 0.0) + time.time() - t0
    return out


def git(repo: Path, *args: str):
    return run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], repo)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    repo = clone_project(tmp_path_factory.mktemp("pipeline") / "a")
    t0 = time.time()
    # what `make repro` does on a fresh clone: the shipped target is pulled, every other stage runs
    dvc(repo, "pull", "-r", "embedded", "target")
    out = dvc(repo, "repro", timeout=3600).stdout
    TIMINGS["dvc repro (full default)"] = time.time() - t0
    assert "Stage 'target' didn't change" in out and "Running stage 'target'" not in out
    for stage in ("split", "regen", "cache", "train", "eval", "export"):
        assert f"Running stage '{stage}'" in out
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "pipeline outputs")
    yield repo


@pytest.fixture(scope="module")
def remote(pipeline, moto):
    bucket = moto.bucket("dvc-remote")
    url = f"s3://{bucket}/store"
    dvc(pipeline, "remote", "add", "-d", "store", url)
    dvc(pipeline, "remote", "modify", "store", "endpointurl", moto.endpoint)
    configure_credentials(pipeline)
    git(pipeline, "add", ".dvc/config")
    git(pipeline, "commit", "-qm", "remote")
    return bucket


def configure_credentials(repo: Path):
    dvc(repo, "remote", "modify", "--local", "store", "access_key_id", "testing")
    dvc(repo, "remote", "modify", "--local", "store", "secret_access_key", "testing")


def objects(moto, bucket) -> dict[str, str]:
    s3, out, token = moto.client(), {}, None
    while True:
        kw = {"Bucket": bucket, **({"ContinuationToken": token} if token else {})}
        page = s3.list_objects_v2(**kw)
        out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
        if not page.get("IsTruncated"):
            return out
        token = page["NextContinuationToken"]


def test_pipeline_outputs_and_rerun_is_a_no_op(pipeline):
    target = json.loads((pipeline / "data/target/metrics.json").read_text())
    assert target["heldout_loss"] < target["uniform_loss"] / 3
    cache = json.loads((pipeline / "data/cache/metrics.json").read_text())
    assert cache["samples"] > 1000 and cache["layers"] == 5
    train = json.loads((pipeline / "data/train/metrics.json").read_text())
    first = float((pipeline / "data/train/live/plots/metrics/train/loss.tsv").read_text().splitlines()[1].split("\t")[-1])
    assert train["final_loss"] < 0.5 * first
    ev = json.loads((pipeline / "data/eval/metrics.json").read_text())
    assert ev["heldout"]["tau"] >= 2.0 and ev["humaneval"]["tau"] >= 1.0  # reported separately
    assert all(ev[s]["greedy_match"] == 1.0 for s in ("heldout", "humaneval", "mtbench"))
    assert ev["protocol"]["thinking"] is False and ev["protocol"]["block_size"] == 4
    out = dvc(pipeline, "repro").stdout
    assert "Running stage" not in out
    assert "loss" in dvc(pipeline, "plots", "show", "--json").stdout


DATA_STAGES = ("split", "regen", "cache", "train")


def data_hashes(lock_text: str) -> dict:
    """The dvc.lock hashes of the data outputs (metrics files, which hold timings, left out)."""
    stages = yaml.safe_load(lock_text)["stages"]
    return {(s, o["path"]): o["md5"] for s in DATA_STAGES for o in stages[s]["outs"]
            if not o["path"].endswith("metrics.json")}


def test_a_second_fresh_clone_reproduces_every_data_output(pipeline, tmp_path):
    # what two teammates' `make repro` on fresh clones give: the same dvc.lock for every data output
    other = clone_project(tmp_path / "b")
    dvc(other, "pull", "-r", "embedded", "target")
    dvc(other, "repro", "train", timeout=3600)
    first = run(["git", "show", "HEAD:dvc.lock"], pipeline).stdout
    assert data_hashes((other / "dvc.lock").read_text()) == data_hashes(first)
    regen = json.loads((other / "data/regen/report.json").read_text())
    assert regen["reproducible"] is True


def test_greedy_speculative_equals_plain_on_every_eval_prompt(pipeline):
    # every turn the stage evaluated, in every suite (its default subsets), matched plain decoding
    rows = [json.loads(line) for line in (pipeline / "data/eval/prompts.jsonl").read_text().splitlines()]
    assert {r["suite"] for r in rows} == {"heldout", "humaneval", "mtbench"}
    assert any(r["turn"] == 1 for r in rows if r["suite"] == "mtbench")  # second turns too
    assert all(r["greedy_match"] for r in rows), [r for r in rows if not r["greedy_match"]][:3]
    # and the rest of the held-out split, the prompts beyond the stage's subset (32 new tokens per
    # turn: every prompt matters here, not the answer's length)
    seen = sorted({r["id"] for r in rows if r["suite"] == "heldout"})
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from deepspec.config import EvalConfig, SamplingConfig, SuiteConfig\n"
        "from deepspec.evaluate.run import evaluate\n"
        "from deepspec.evaluate.suites import load_suite\n"
        f"seen = set({seen!r})\n"
        "every = load_suite(SuiteConfig('heldout'), Path('data/split/eval.jsonl'))\n"
        "p = [q for q in every if q['id'] not in seen]\n"
        "m, rows = evaluate(Path('data/target'), Path('data/draft'), {'heldout': p}, EvalConfig(max_new_tokens=32, sample=False),"
        " SamplingConfig())\n"
        "print(json.dumps({'all': sorted(q['id'] for q in every), 'n': len({r['id'] for r in rows}),"
        " 'match': all(r['greedy_match'] for r in rows)}))\n")
    out = run(["python", "-c", code], pipeline).stdout.strip().splitlines()[-1]
    res = json.loads(out)
    assert res["match"], res
    assert len(res["all"]) >= 80 and res["n"] + len(seen) == len(res["all"]) and set(seen) <= set(res["all"])


def test_share_through_the_remote(pipeline, remote, moto, tmp_path):
    t0 = time.time()
    dvc(pipeline, "push")
    TIMINGS["push (full)"] = time.time() - t0
    b = tmp_path / "b"
    run(["git", "clone", "-q", str(pipeline), str(b)], tmp_path)
    configure_credentials(b)
    t0 = time.time()
    dvc(b, "pull")
    TIMINGS["pull (fresh clone)"] = time.time() - t0
    # what a teammate's machine adds to the tree (a built checksum extension, bytecode, editable-install
    # metadata) is not a source: every stage stays up to date
    (b / "deepspec/cache/_checker.cpython-311-x86_64-linux-gnu.so").write_bytes(random.randbytes(4096))
    (b / "deepspec/cache/__pycache__").mkdir(exist_ok=True)
    (b / "deepspec/cache/__pycache__/reader.cpython-311.pyc").write_bytes(random.randbytes(512))
    (b / "deepspec.egg-info").mkdir(exist_ok=True)
    (b / "deepspec.egg-info/PKG-INFO").write_text("Name: deepspec\n")
    assert "up to date" in dvc(b, "status").stdout
    assert "Running stage" not in dvc(b, "repro").stdout
    params = yaml.safe_load((b / "params.yaml").read_text())
    params["train"]["steps"] = 100  # the teammate's retrain is the proof, not its length
    (b / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = dvc(b, "repro", "-s", "-f", "train").stdout
    assert "Running stage 'train'" in out and "Running stage 'cache'" not in out
    assert json.loads((b / "data/train/metrics.json").read_text())["steps"] == 100


def test_smaller_cache_experiment(pipeline):
    base = json.loads((pipeline / "data/cache/metrics.json").read_text())
    t0 = time.time()
    # the documented command; the train/eval sizes are cut because this test is about the cache (the
    # GPU-recipe test runs the command exactly as written)
    out = dvc(pipeline, "exp", "run", "-S", "layers=[9,25]", "-S", "train.steps=150",
              "-S", "eval.suites=[{source: heldout, max_prompts: 4}, {source: humaneval, max_prompts: 1}]",
              "-n", "two-layers", timeout=3600).stdout
    TIMINGS["exp run layers=[9,25]"] = time.time() - t0
    ran = {s for s in ("split", "target", "regen", "cache", "train", "eval") if f"Running stage '{s}'" in out}
    assert ran == {"cache", "train", "eval"}, out[-3000:]
    manifest = json.loads((pipeline / "data/cache.zarr/zarr.json").read_text())["attributes"]
    assert manifest["layers"] == [9, 25]
    first = manifest["parts"][0]["name"]
    hidden = sorted(p.name for p in (pipeline / f"data/cache.zarr/parts/{first}/hidden").iterdir() if p.is_dir())
    assert hidden == ["25", "9"]
    small = json.loads((pipeline / "data/cache/metrics.json").read_text())
    ratio = small["bytes"] / base["bytes"]
    assert abs(ratio - 3 / 6) <= 0.1 * 3 / 6, ratio
    table = json.loads(dvc(pipeline, "exp", "show", "--json").stdout)
    text = json.dumps(table)
    assert "two-layers" in text and '"tau"' in text and '"final_loss"' in text and '"bytes"' in text
    csv = dvc(pipeline, "exp", "show", "--csv").stdout.splitlines()
    header = csv[0].split(",")
    assert {"bytes", "final_loss", "heldout.tau", "heldout.tau_sample", "humaneval.tau"} <= set(header)
    assert any(line.startswith("two-layers,") for line in csv[1:])
    dvc(pipeline, "exp", "apply", "two-layers")
    git(pipeline, "checkout", "--", ".")  # back to the default params (outputs follow on the next step)
    dvc(pipeline, "checkout")


def test_a_read_through_sampling_experiment_regenerates_and_fills_the_store_in_train(pipeline, remote, moto,
                                                                                     tmp_path):
    # the answers change under the same row ids: regen reruns, the cache stage plans (read-through:
    # no forward there), and train computes every part before it reads it, with no setting beyond
    # train.capture (README "Train while the cache fills"). The offline cache stage following such a
    # change is tests/cache/test_content_keys.py's (a real `dvc repro` of the stage).
    from deepspec.cache.build.stage import build_cache
    from deepspec.params import load_params
    from tests.cache.test_derive import manifest, store_files

    def answers() -> dict:
        rows = (json.loads(line) for line in (pipeline / "data/regen/train.jsonl").read_text().splitlines())
        return {r["id"]: r["conversations"] for r in rows}

    before = answers()
    offline_store = store_files(str(pipeline / "data/cache.zarr"))
    # smaller parts: a plan the store does not hold, cut into several windows of parts
    out = dvc(pipeline, "exp", "run", "-S", "sampling.temperature=0.9", "-S", "sampling.seed=7",
              "-S", "train.capture=read-through", "-S", "cache.part_tokens=12000",
              "-S", "train.steps=60", "-S", "eval.suites=[{source: heldout, max_prompts: 2}]",
              "-n", "hot-read-through", timeout=3600).stdout
    ran = {s for s in ("split", "target", "regen", "cache", "train", "eval") if f"Running stage '{s}'" in out}
    assert ran == {"regen", "cache", "train", "eval"}, out[-3000:]
    after = answers()
    assert set(after) == set(before)
    assert sum(after[i] != before[i] for i in after) > len(after) // 2  # most answers changed
    assert json.loads((pipeline / "data/cache/report.json").read_text())["mode"] == "planned"
    planned = json.loads((pipeline / "data/cache/manifest.json").read_text())
    metrics = json.loads((pipeline / "data/train/metrics.json").read_text())
    assert metrics["capture"] == "read-through" and metrics["target_forwards"] > 0 and len(planned["parts"]) >= 4
    assert metrics["parts_computed"] + metrics["parts_kept"] == len(planned["parts"]) and metrics["parts_computed"]
    assert 1 <= metrics["parts_before_first_step"] <= 2  # the first step after the first window, not the store
    # train left its store (the train stage's output beside cache.url) what a from-scratch cache-stage
    # build of the new regen output gives; the cache stage's store is as the offline run left it
    params = load_params(pipeline / "params.yaml")
    scratch = tmp_path / "scratch.zarr"
    build_cache(dataclasses.replace(params.cache, url=str(scratch), derive_from="none"), params.layers,
                pipeline / "data/regen/train.jsonl", pipeline / "data/target")
    store = str(pipeline / "data/cache-read-through.zarr")
    assert planned["url"] == "data/cache-read-through.zarr"
    assert store_files(store) == store_files(str(scratch))
    got, want = manifest(store), manifest(str(scratch))
    got.pop("derived_from", None)
    assert got == want
    root = json.loads((pipeline / "data/cache-read-through.zarr/zarr.json").read_text())["attributes"]
    assert [p["name"] for p in root["parts"]] == [p["name"] for p in planned["parts"]]
    assert store_files(str(pipeline / "data/cache.zarr")) == offline_store
    # each store is recorded by the stage that finished it: nothing is out of date after the run
    status = dvc(pipeline, "status").stdout
    assert "up to date" in status and "modified" not in status, status
    # a teammate's clone of this state pulls the filled store and recomputes nothing
    git(pipeline, "add", "params.yaml", "dvc.lock")
    git(pipeline, "commit", "-qm", "read-through experiment")
    dvc(pipeline, "push")
    b = tmp_path / "teammate"
    run(["git", "clone", "-q", str(pipeline), str(b)], tmp_path)
    configure_credentials(b)
    dvc(b, "pull")
    assert store_files(str(b / "data/cache-read-through.zarr")) == store_files(store)
    assert "up to date" in dvc(b, "status").stdout
    assert "Running stage" not in dvc(b, "repro").stdout
    git(pipeline, "reset", "-q", "--hard", "HEAD~1")  # back to the default params and their outputs
    dvc(pipeline, "checkout")


def test_growth_appends_parts_and_pushes_only_new_files(pipeline, remote, moto):
    # move the source to a file holding exactly the packaged corpus: nothing downstream changes
    from deepspec.embedded.corpus import builtin_chat_rows

    src = pipeline / "sources" / "corpus.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in builtin_chat_rows()))
    params = yaml.safe_load((pipeline / "params.yaml").read_text())
    params["split"]["source"] = "sources/corpus.jsonl"
    (pipeline / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = dvc(pipeline, "repro", "cache").stdout
    assert "Running stage 'split'" in out and "Running stage 'regen'" not in out  # same rows, same ids
    dvc(pipeline, "push")
    store = pipeline / "data/cache.zarr"
    before_files = {p: hashlib.md5(p.read_bytes()).hexdigest() for p in store.rglob("*") if p.is_file()}
    before_objects = objects(moto, remote)
    parts_before = [p["name"] for p in json.loads((store / "zarr.json").read_text())["attributes"]["parts"]]

    rng = random.Random(7)
    new_rows = [{"conversations": [{"from": "human", "value": f"What is {a} plus {b}?"},
                                   {"from": "gpt", "value": f"{a} plus {b} is {a + b}."}],
                 "task": "math", "source": "growth"}
                for a, b in ((rng.randint(100, 999), rng.randint(100, 999)) for _ in range(150))]
    with open(src, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in new_rows))
    out = dvc(pipeline, "repro", "cache").stdout
    assert "Running stage 'target'" not in out and "Running stage 'regen'" in out
    parts_after = [p["name"] for p in json.loads((store / "zarr.json").read_text())["attributes"]["parts"]]
    assert sorted(parts_after) == sorted(p.name for p in (store / "parts").iterdir() if p.is_dir())
    # parts are planned in input order with content-defined boundaries: rows appended at the end
    # rewrite at most the last part, every other part stays byte for byte
    assert parts_after[:len(parts_before) - 1] == parts_before[:-1] and set(parts_after) - set(parts_before)
    after_files = {p: hashlib.md5(p.read_bytes()).hexdigest() for p in store.rglob("*") if p.is_file()}
    changed = [p for p, h in before_files.items() if p in after_files and after_files[p] != h]
    # only the root manifest; the index is content-addressed (a new file, the old one pruned)
    assert [p.relative_to(store).as_posix() for p in changed] == ["zarr.json"]
    gone = {p.relative_to(store).parts[:2] for p in before_files if p not in after_files}
    assert {g for g in gone if g[0] == "parts"} == {("parts", n) for n in set(parts_before) - set(parts_after)}
    added = [p for p in after_files if p not in before_files]
    dvc(pipeline, "push")
    after_objects = objects(moto, remote)
    assert all(after_objects.get(k) == v for k, v in before_objects.items())  # nothing rewritten
    new_objects = set(after_objects) - set(before_objects)
    remote_md5 = {k.split("/")[-2] + k.split("/")[-1] for k in after_objects}
    store_files = {hashlib.md5(p.read_bytes()).hexdigest() for p in added} | {after_files[p] for p in changed}
    assert store_files <= remote_md5  # every new file of the store is on the remote (content-addressed:
    # a file identical to an existing object, such as a small zarr.json, adds nothing)
    # and nothing else of size was uploaded: the rest are the small split/regen/metrics files
    assert len(new_objects) <= len(store_files) + 12, (len(new_objects), len(store_files))
    TIMINGS["growth: new cache files"] = len(added)


def test_corrupt_remote_object_is_never_trained_on(pipeline, remote, moto, tmp_path):
    store = pipeline / "data/cache.zarr"
    shard = next(p for p in sorted(store.rglob("*")) if p.is_file() and p.as_posix().endswith("hidden/9/c/0/0"))
    md5 = hashlib.md5(shard.read_bytes()).hexdigest()
    key = next(k for k in objects(moto, remote) if k.endswith(md5[:2] + "/" + md5[2:]))
    s3 = moto.client()
    body = bytearray(s3.get_object(Bucket=remote, Key=key)["Body"].read())
    body[1000] ^= 0xFF
    s3.put_object(Bucket=remote, Key=key, Body=bytes(body))
    c = tmp_path / "c"
    run(["git", "clone", "-q", str(pipeline), str(c)], tmp_path)
    configure_credentials(c)
    pulled = dvc(c, "pull", check=False)
    if pulled.returncode != 0:  # DVC's own hash check caught it
        TIMINGS["integrity: detected by"] = "dvc pull"
        assert md5[:6] in pulled.stdout or "corrupt" in pulled.stdout.lower() or "hash" in pulled.stdout.lower()
        return
    TIMINGS["integrity: detected by"] = "chunk checksums on read"
    verify = run(["deepspec", "cache", "verify", "data/cache.zarr"], c, check=False)
    assert verify.returncode != 0 and "checksum mismatch" in verify.stdout
    trained = dvc(c, "repro", "-s", "-f", "train", check=False)
    assert trained.returncode != 0 and "checksum mismatch" in trained.stdout
