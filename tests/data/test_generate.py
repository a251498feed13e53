"""The in-process regen backend: fixed batches, one generator per row, the same answers every run."""
import json
import random

import pytest
import torch

from deepspec.config import RegenConfig, SamplingConfig
from deepspec.data.generate import RowSampler, batch_ranges, run_local, token_groups
from deepspec.data.journal import Journal
from deepspec.data.regen import regen_fingerprint, reproducibility
from deepspec.models.target import load_causal_lm
from tests.conftest import SAMPLE_CONVERSATIONS


def loader(model_dir):
    return lambda device: load_causal_lm(model_dir, device)


def rows_of(convs, start=0):
    return [{"id": f"{start + i:016x}", "conversations": c} for i, c in enumerate(convs)]


def test_batches_are_cut_by_content_so_an_insert_changes_only_its_own_batch():
    ids = [f"{random.Random(i).getrandbits(64):016x}" for i in range(2000)]
    plan = batch_ranges(ids, 8)
    assert plan[0][0] == 0 and plan[-1][1] == len(ids)
    assert all(b > a for a, b in plan) and all(p[1] == q[0] for p, q in zip(plan, plan[1:]))
    assert max(b - a for a, b in plan) <= 16 and 5 < len(ids) / len(plan) < 11
    batches = {tuple(ids[a:b]) for a, b in plan}
    grown = ids[:1000] + ["ffffffffffffffff"] + ids[1000:]
    changed = {tuple(grown[a:b]) for a, b in batch_ranges(grown, 8)} - batches
    assert 1 <= len(changed) <= 2 and any("ffffffffffffffff" in b for b in changed)


def test_a_rows_draw_does_not_depend_on_its_batch_mates():
    sampling = SamplingConfig(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01)
    torch.manual_seed(0)
    scores = torch.randn(4, 300)
    alone = [RowSampler(sampling, [11]) for _ in range(2)]
    together = RowSampler(sampling, [5, 11, 7, 9])
    picks = []
    for _ in range(20):  # steps: each generator advances once per step
        torch.manual_seed(1)  # the global generator plays no part
        picks.append((alone[0](None, scores[1:2]).argmax(-1).item(),
                      together(None, scores).argmax(-1)[1].item()))
    assert all(a == b for a, b in picks) and len({a for a, _ in picks}) > 1


def test_top_k_top_p_and_min_p_leave_only_allowed_tokens():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for sampling, allowed in [(SamplingConfig(top_k=2, top_p=1.0), {0, 1}),
                              (SamplingConfig(top_k=0, top_p=0.7), {0, 1}),
                              (SamplingConfig(top_k=0, top_p=1.0, min_p=0.4), {0, 1}),
                              (SamplingConfig(top_k=0, top_p=0.5), {0})]:
        sampler = RowSampler(sampling, [3])
        seen = {sampler(None, scores).argmax(-1).item() for _ in range(200)}
        assert seen == allowed, (sampling, seen)
    greedy = RowSampler(SamplingConfig(temperature=0.0), [0])
    assert torch.equal(greedy(None, scores), scores)


@pytest.fixture(scope="module")
def generated(trained_target, tmp_path_factory):
    """Two full runs of the same rows with the same params."""
    root = tmp_path_factory.mktemp("gen")
    cfg, sampling = RegenConfig(backend="local", concurrency=4), SamplingConfig(max_tokens=12)
    rows = rows_of(SAMPLE_CONVERSATIONS[:19] + SAMPLE_CONVERSATIONS[-1:])
    runs = []
    for k in range(2):
        journal = Journal(root / f"j{k}", regen_fingerprint(cfg, sampling, None))
        ordered, errors = run_local(rows, trained_target, cfg, sampling, journal, loader(trained_target))
        ordered = list(ordered)  # read back from the journal, which closing ends
        journal.close()
        assert errors == []
        runs.append(ordered)
    return rows, cfg, sampling, runs


def test_the_same_params_give_the_same_answers(generated):
    rows, _, _, (first, second) = generated
    assert [r["id"] for r in first] == [r["id"] for r in rows]
    assert json.dumps(list(first)) == json.dumps(list(second))
    assert len({r["conversations"][-1]["content"] for r in first}) > 5  # sampled, not constant
    multi = next(r for r in first if len(r["finish_reasons"]) == 2)  # second turns see the regenerated first
    assert [t["role"] for t in multi["conversations"]] == ["user", "assistant", "user", "assistant"]


def test_a_resumed_run_and_a_grown_input_keep_every_other_rows_answer(generated, trained_target, tmp_path):
    rows, cfg, sampling, (first, _) = generated
    # a crash left a few rows of one batch in the journal: the rerun regenerates the whole batch and
    # gets what the uninterrupted run got
    journal = Journal(tmp_path / "j", regen_fingerprint(cfg, sampling, None))
    a, b = batch_ranges([r["id"] for r in rows], cfg.concurrency)[1]
    for row in first[a:a + 1]:
        journal.append(row)
    resumed, _ = run_local(rows, trained_target, cfg, sampling, journal, loader(trained_target))
    resumed = list(resumed)
    journal.close()
    assert json.dumps(list(resumed)) == json.dumps(list(first))
    # one row more in the middle: rows outside its batch keep their answers exactly
    extra = rows_of(SAMPLE_CONVERSATIONS[40:41], start=1000)
    grown = rows[:10] + extra + rows[10:]
    journal = Journal(tmp_path / "j2", regen_fingerprint(cfg, sampling, None))
    again, _ = run_local(grown, trained_target, cfg, sampling, journal, loader(trained_target))
    again = list(again)
    journal.close()
    def batch_of(rs):
        return {r["id"]: frozenset(x["id"] for x in rs[a:b])
                for a, b in batch_ranges([r["id"] for r in rs], cfg.concurrency) for r in rs[a:b]}

    old, new = batch_of(rows), batch_of(grown)
    same = [r for r in again if r["id"] in old and old[r["id"]] == new[r["id"]]]
    # the new row's batch changes (and the next, when the cap at 2 x concurrency moves its cut)
    assert len(rows) - 4 * cfg.concurrency <= len(same) < len(rows)
    before = {r["id"]: r for r in first}
    assert all(json.dumps(r) == json.dumps(before[r["id"]]) for r in same)


def test_token_groups_cut_a_turn_by_rows_times_padded_length():
    lengths, new = [30, 5, 12, 5, 40, 7], 10
    assert token_groups(lengths, new, None) == [[0, 1, 2, 3, 4, 5]]  # no budget: one batch, as given
    groups = token_groups(lengths, new, 60)
    assert sorted(k for g in groups for k in g) == list(range(len(lengths)))
    assert [k for g in groups for k in g] == sorted(range(len(lengths)), key=lambda k: (lengths[k], k))
    assert all(len(g) * (max(lengths[k] for k in g) + new) <= 60 or len(g) == 1 for g in groups)
    assert groups == [[1, 3, 5], [2], [0], [4]]  # 3 x 17 = 51; 12 + 30 together would be 2 x 40
    assert token_groups([100, 3], new, 20) == [[1], [0]]  # over the budget alone: a group of one
    assert token_groups(lengths, new, 60) == groups


def test_a_token_budget_cuts_every_generation_and_keeps_runs_reproducible(generated, trained_target, tmp_path):
    rows, cfg, sampling, _ = generated
    budget = RegenConfig(backend="local", concurrency=4, batch_tokens=80)
    assert regen_fingerprint(budget, sampling, None) != regen_fingerprint(cfg, sampling, None)
    shapes = []

    def watched(device):
        model = load_causal_lm(trained_target, device)
        real = model.generate
        model.generate = lambda **kw: shapes.append(tuple(kw["input_ids"].shape)) or real(**kw)
        return model

    runs = []
    for k in range(2):
        journal = Journal(tmp_path / f"j{k}", regen_fingerprint(budget, sampling, None))
        ordered, errors = run_local(rows, trained_target, budget, sampling, journal, watched)
        runs.append(json.dumps(list(ordered)))
        journal.close()
        assert errors == []
    assert runs[0] == runs[1] and shapes
    assert all(b * (t + sampling.max_tokens) <= 80 or b == 1 for b, t in shapes)
    assert max(b for b, _ in shapes) > 1  # rows still share a generation


def test_out_of_device_memory_says_how_to_cut_the_batches(trained_target, tmp_path):
    sampling = SamplingConfig(max_tokens=12)
    cfg = RegenConfig(backend="local", concurrency=4)

    def oom(device):  # a device out of memory: no real component does it on demand
        model = load_causal_lm(trained_target, device)
        def generate(**kw):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        model.generate = generate
        return model

    journal = Journal(tmp_path / "j", regen_fingerprint(cfg, sampling, None))
    with pytest.raises(RuntimeError, match=r"out of device memory generating \d+ rows .*set regen.batch_tokens"):
        run_local(rows_of(SAMPLE_CONVERSATIONS[:8]), trained_target, cfg, sampling, journal, oom)
    journal.close()


def test_the_report_says_the_local_backend_is_reproducible():
    assert reproducibility(RegenConfig(backend="local"), SamplingConfig())["reproducible"] is True


@pytest.mark.slow
def test_stage_runs_give_identical_outputs_also_after_a_sigkill(trained_target, tmp_path):
    """`python stages/regen.py` with the local backend: two runs, and a run killed mid-way then
    rerun, all write the same data/regen/train.jsonl byte for byte."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from tests.conftest import REPO, project_env, write_split

    def workdir(name):
        work = tmp_path / name
        (work / "data").mkdir(parents=True)
        shutil.copytree(trained_target, work / "data" / "target")
        write_split(work / "data" / "split" / "train.jsonl", SAMPLE_CONVERSATIONS)
        params = yaml.safe_load((REPO / "params.yaml").read_text())
        params["sampling"]["max_tokens"] = 24
        params["regen"] |= {"backend": "local", "concurrency": 4, "fraction": 1.0}
        (work / "params.yaml").write_text(yaml.safe_dump(params))
        return work

    cmd, env = [sys.executable, str(REPO / "stages" / "regen.py")], project_env(REPO)
    outputs = []
    for name in ("a", "b"):
        work = workdir(name)
        subprocess.run(cmd, cwd=work, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        outputs.append((work / "data/regen/train.jsonl").read_bytes())
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == len(SAMPLE_CONVERSATIONS)
    report = json.loads((work / "data/regen/report.json").read_text())
    assert report["reproducible"] is True and report["regenerated"] == len(SAMPLE_CONVERSATIONS)

    work = workdir("killed")
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = work / "data" / "regen" / "journal" / "rows.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (journal.exists() and len(journal.read_bytes().splitlines()) >= 6):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 6 <= len(journal.read_bytes().splitlines()) < len(SAMPLE_CONVERSATIONS)
    subprocess.run(cmd, cwd=work, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert (work / "data/regen/train.jsonl").read_bytes() == outputs[0]
