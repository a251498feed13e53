"""docs/benchmarks.md is the one place a measured number lives: it is generated from the recorded
runs in benchmarks/results/, and no other doc states a benchmarked figure it does not hold."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_page_is_what_the_recorded_runs_give(report):
    assert report.PAGE.read_text() == report.render(), (
        "docs/benchmarks.md differs from what benchmarks/results/ and the scripts give "
        "(a new record, a new script, or a hand edit): run `make benchmarks-doc`")


def test_no_doc_states_a_benchmarked_figure_the_page_does_not_hold(report):
    held = {key: report.normal(value) for key, (value, _) in report.figures(report.records()).items()}
    wrong = []
    for doc in DOCS:
        if doc == report.PAGE:
            continue
        for key, value, line in report.stated_figures(doc.read_text()):
            if held.get(key) != report.normal(value):
                wrong.append(f"{doc.relative_to(ROOT)}:{line}: {key} stated as {value!r}, "
                             f"docs/benchmarks.md holds {held.get(key, 'nothing')!r} (link there instead)")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("text,key,value", [
    ("A fresh clone's `make repro` took 5 min 30 s here.", "make_repro.wall", "5 min 30 s"),
    ("`make test` runs in 27 min 4 s on two cores.", "make_test.wall", "27 min 4 s"),
    ("| cache | bf16 | 1,175 samples, 79 MB in 24 files |", "cache.files", "24"),
    ("| cache | bf16 | 1,175 samples, 79 MB in 24 files |", "cache.mb", "79"),
    ("109 s (final loss 0.60)", "train.loss", "0.60"),
    ("greedy τ heldout 2.90 (1.8× faster), humaneval 2.36, mtbench 2.06", "tau.mtbench.greedy", "2.06"),
    ("(sampled 2.80 / 1.71 / 1.96)", "tau.humaneval.sampled", "1.71"),
    ("(sampled 2.80 / 1.71 / 1.96)", "tau.mtbench.sampled", "1.96"),
])
def test_a_figure_is_found_as_prose_states_it(report, text, key, value):
    assert (key, value) in [(k, v) for k, v, _ in report.stated_figures(text)]


@pytest.mark.parametrize("text", ["`make repro` fits in 15 minutes on 2 cores.",
                                  "`make test` must run in under 30 minutes (CI has 90).",
                                  "greedy τ heldout is the goal: ≥ 2.50"])
def test_a_budget_or_a_goal_is_not_a_measured_figure(report, text):
    assert report.stated_figures(text) == []


def test_a_recorded_run_keeps_its_output_and_figures_and_renders_into_the_page(report, tmp_path):
    command = [sys.executable, "-c", "print('ratio 0.93'); print('FIGURE tau.heldout.greedy = 2.71')"]
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record.py"), "demo", "--title", "A demo run",
                    "--results", str(tmp_path), "--", *command], check=True, capture_output=True)
    rec = json.loads((tmp_path / "demo.json").read_text())
    assert rec["figures"]["tau.heldout.greedy"] == "2.71" and "demo.wall" in rec["figures"]
    assert rec["output"] == ["ratio 0.93"] and rec["date"] and rec["machine"]
    page = report.render([rec])
    assert "| greedy τ, `heldout` suite, embedded default | 2.71 | [demo](#demo)" in page
    assert "ratio 0.93" in page and "A demo run" in page


def test_a_record_holds_no_absolute_path_of_the_machine_it_ran_on(tmp_path):
    import tempfile
    printed = (f"print('{ROOT}/deepspec/io.py:3: warning'); print('{tempfile.gettempdir()}/run-x1/store ok'); "
               f"print('{sys.prefix}/lib/python3.11/site-packages/torch/x.py')")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record.py"), "paths", "--results", str(tmp_path), "--",
                    sys.executable, "-c", printed], check=True, capture_output=True, cwd=ROOT)
    output = json.loads((tmp_path / "paths.json").read_text())["output"]
    assert output == ["deepspec/io.py:3: warning", "<tmp> ok", "<site-packages>/torch/x.py"]


def test_a_failed_run_records_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record.py"), "demo", "--results", str(tmp_path),
                           "--", sys.executable, "-c", "raise SystemExit(3)"], capture_output=True)
    assert done.returncode == 3 and not (tmp_path / "demo.json").exists()
