"""The embedded default's corpus: the packaged builtin:chat rows and the tiny target's extra rows."""
from deepspec.config import SplitConfig
from deepspec.data.conversation import normalize_prompt
from deepspec.data.split import prompt_key, split_rows
from deepspec.embedded.corpus import builtin_chat_rows, number_words
from deepspec.embedded.tiny import builtin_synthetic_rows


def test_synthetic_rows_for_the_builtin_target_never_hold_an_eval_prompt():
    cfg = SplitConfig(source="builtin:chat", seed=0, test_fraction=0.05)
    extra = builtin_synthetic_rows(cfg, 1500)
    assert 1300 < len(extra) <= 1500 and extra == builtin_synthetic_rows(cfg, 1500)
    assert {r["source"] for r in extra} == {"synthetic/math", "synthetic/code", "synthetic/instruction"}
    eval_prompts = {normalize_prompt(r["turns"][0]) for r in split_rows(cfg).eval}
    assert not eval_prompts & {prompt_key(r["conversations"]) for r in extra}
    assert builtin_synthetic_rows(cfg, 0) == []


def test_builtin_corpus_covers_four_tasks():
    rows = list(builtin_chat_rows())
    tasks = {r["task"] for r in rows}
    assert tasks == {"chat", "code", "math", "instruction"}
    assert sum(r["source"].startswith("chatterbot/") for r in rows) == 2026
    assert number_words(342) == "three hundred and forty-two"
