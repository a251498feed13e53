import json
from pathlib import Path

import pytest

from deepspec.config import ConfigError, SplitConfig
from deepspec.data.conversation import RowRejected, normalize_conversation, normalize_prompt
from deepspec.data.sources import SourceError
from deepspec.data.split import SplitError, prompt_key, run_split, split_rows


def conv(*pairs, system=None):
    turns = [{"from": "system", "value": system}] if system else []
    for role, text in pairs:
        turns.append({"from": role, "value": text})
    return {"conversations": turns}


GOOD = [conv(("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(40)]


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())
    return path


def read(path):
    return [json.loads(line) for line in open(path)]


def test_roles_are_normalised_and_system_kept():
    turns = normalize_conversation({"conversations": [
        {"from": "system", "value": "be brief"}, {"role": "user", "content": "hi"},
        {"from": "chatgpt", "value": "hello"}, {"from": "human", "value": "bye"},
        {"from": "bard", "value": "ciao"}]})
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user", "assistant"]


@pytest.mark.parametrize("row, reason", [
    ({"text": "no conversations"}, "missing_conversations"),
    (conv(("human", "hi"), ("robot", "beep")), "unknown_role"),
    (conv(("human", "hi"), ("gpt", "   ")), "empty_content"),
    (conv(("gpt", "I speak first"), ("human", "ok")), "starts_with_assistant"),
    (conv(("human", "a"), ("human", "b")), "not_alternating"),
    ({"conversations": [{"from": "human", "value": 3}]}, "non_string_content"),
    ({"conversations": []}, "empty_conversations"),
])
def test_bad_rows_have_reasons(row, reason):
    with pytest.raises(RowRejected) as e:
        normalize_conversation(row)
    assert e.value.reason == reason


def test_bad_lines_are_counted_with_line_numbers(tmp_path):
    src = write_jsonl(tmp_path / "src.jsonl", [
        GOOD[0],
        b"{not json\n",
        {"text": "x"},
        conv(("human", "hi"), ("robot", "beep")),
        conv(("human", "hi"), ("gpt", "")),
        conv(("gpt", "first"), ("human", "second")),
        b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}\n',
        GOOD[0],
        GOOD[1],
    ])
    out = tmp_path / "out"
    report = run_split(SplitConfig(source=str(src), test_fraction=0.0, max_reject_fraction=1.0,
                                   leading_assistant="reject"), out)
    assert report["read"] == 9 and report["kept"] == 2
    assert report["rejected"] == {"duplicate": 1, "empty_content": 1, "malformed_json": 1,
                                  "missing_conversations": 1, "non_utf8": 1,
                                  "starts_with_assistant": 1, "unknown_role": 1}
    rejected = {r["reason"]: r["where"] for r in read(out / "rejected.jsonl")}
    assert rejected["malformed_json"] == f"{src}:2"
    assert rejected["non_utf8"] == f"{src}:7"
    assert rejected["duplicate"] == f"{src}:8"
    assert json.loads((out / "report.json").read_text()) == report


def test_a_source_of_only_malformed_lines_fails_with_reasons_and_writes_nothing(tmp_path, caplog):
    src = tmp_path / "not.jsonl"
    src.write_text("".join(f"line {i} is not json\n" for i in range(1000)))
    out = tmp_path / "out"
    with caplog.at_level("INFO"), pytest.raises(SplitError) as e:
        run_split(SplitConfig(source=str(src)), out)
    msg = str(e.value)
    assert "no row is usable" in msg and "1000 rows read, 1000 rejected (malformed_json: 1000)" in msg
    assert f"{src}:1: malformed_json" in msg and f"{src}:5: malformed_json" in msg
    assert f"{src}:6:" not in msg and "995 more in rejected.jsonl" in msg
    assert len(caplog.records) < 10    # a summary, not a line per rejected row
    assert not out.exists()


def test_an_empty_source_fails(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_bytes(b"")
    with pytest.raises(SplitError, match="empty.jsonl: the source holds no rows"):
        run_split(SplitConfig(source=str(src)), tmp_path / "out")


def test_more_rejections_than_the_threshold_fail_and_keep_previous_outputs(tmp_path, caplog):
    src = write_jsonl(tmp_path / "src.jsonl", GOOD[:10] + [b"{bad\n"] * 11)
    out = tmp_path / "out"
    with pytest.raises(SplitError, match=r"52% of rows rejected, more than split.max_reject_fraction = 0.5"):
        run_split(SplitConfig(source=str(src)), out)
    assert not out.exists()
    with caplog.at_level("WARNING"):
        report = run_split(SplitConfig(source=str(src), max_reject_fraction=0.6), out)
    assert report["rejected"] == {"malformed_json": 11} and report["kept"] == 10
    [summary] = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert summary.startswith("21 rows read, 11 rejected (malformed_json: 11)")
    before = (out / "train.jsonl").read_bytes()
    src.write_bytes(b"{bad\n" * 3)
    with pytest.raises(SplitError):
        run_split(SplitConfig(source=str(src)), out)
    assert (out / "train.jsonl").read_bytes() == before


def test_missing_source_is_a_clear_error_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SourceError, match="nope.jsonl: source file does not exist"):
        run_split(SplitConfig(source=str(tmp_path / "nope.jsonl")), out)
    assert not out.exists()
    with pytest.raises(ConfigError, match="unknown source 'builtin:nope'"):
        run_split(SplitConfig(source="builtin:nope"), out)
    with pytest.raises(ConfigError, match="unknown source 's4://bucket/x'"):
        run_split(SplitConfig(source="s4://bucket/x"), out)


def test_unreadable_source_leaves_previous_outputs_intact(tmp_path):
    src = write_jsonl(tmp_path / "src.jsonl", GOOD)
    out = tmp_path / "out"
    run_split(SplitConfig(source=str(src)), out)
    before = (out / "train.jsonl").read_bytes()
    src.chmod(0o000)
    try:
        import os
        if os.access(src, os.R_OK):  # running as root: permissions do not stop reads
            src.chmod(0o644)
            src.unlink()
            src.mkdir()
        with pytest.raises(SourceError):
            run_split(SplitConfig(source=str(src)), out)
    finally:
        if src.is_file():
            src.chmod(0o644)
    assert (out / "train.jsonl").read_bytes() == before


def test_the_new_files_of_a_killed_split_are_removed_by_the_next(tmp_path):
    """A run killed while it streamed leaves its temporary directory beside the outputs (what
    TemporaryDirectory cannot clean up after SIGKILL); the next run removes it and nothing else."""
    src = write_jsonl(tmp_path / "src.jsonl", GOOD)
    out = tmp_path / "out"
    debris = tmp_path / ".out.k1ll3d"
    debris.mkdir()
    (debris / "train.jsonl").write_text('{"id": "half a')
    keep = [tmp_path / ".outside", tmp_path / "out.bak"]
    for p in keep:
        p.mkdir()
    report = run_split(SplitConfig(source=str(src)), out)
    assert not debris.exists() and all(p.is_dir() for p in keep)
    assert report["train"] == len((out / "train.jsonl").read_text().splitlines())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # its own temporary is gone too


def test_split_is_deterministic_and_seeded(tmp_path):
    src = write_jsonl(tmp_path / "src.jsonl", GOOD * 1)
    a = split_rows(SplitConfig(source=str(src), seed=1, test_fraction=0.3))
    b = split_rows(SplitConfig(source=str(src), seed=1, test_fraction=0.3))
    c = split_rows(SplitConfig(source=str(src), seed=2, test_fraction=0.3))
    assert a.train == b.train and a.eval == b.eval
    assert {r["id"] for r in a.eval} != {r["id"] for r in c.eval}
    assert 0 < len(a.eval) < 40
    assert all("turns" in r and "conversations" not in r for r in a.eval)


def test_rows_sharing_a_prompt_share_a_side():
    res = split_rows(SplitConfig(source="builtin:chat", seed=0, test_fraction=0.05))
    train_prompts = {prompt_key(r["conversations"]) for r in res.train}
    eval_prompts = {normalize_prompt(r["turns"][0]) for r in res.eval}
    assert len(res.eval) > 50 and not eval_prompts & train_prompts
    # the corpus does repeat prompts with other answers, so grouping is doing work here
    assert len(train_prompts) < len(res.train)


def test_growth_never_moves_existing_rows(tmp_path):
    src = write_jsonl(tmp_path / "src.jsonl", GOOD[:20])
    cfg = SplitConfig(source=str(src), seed=0, test_fraction=0.3)
    a = split_rows(cfg)
    write_jsonl(src, GOOD)
    b = split_rows(cfg)
    assert len(b.train) > len(a.train)
    assert b.train[:len(a.train)] == a.train
    assert b.eval[:len(a.eval)] == a.eval


def test_parquet_and_local_hf_dataset(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"conversations": r["conversations"], "source": "unit"} for r in GOOD[:10]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "src.parquet")
    from_parquet = split_rows(SplitConfig(source=str(tmp_path / "src.parquet"), test_fraction=0.0))
    ds_dir = tmp_path / "hfdata"
    datasets.Dataset.from_list(rows).save_to_disk(str(ds_dir))
    from_hf = split_rows(SplitConfig(source=f"hf:{ds_dir}", test_fraction=0.0))
    files_dir = tmp_path / "hffiles" / "data"
    files_dir.mkdir(parents=True)
    write_jsonl(files_dir / "train.jsonl", rows)
    from_hf_files = split_rows(SplitConfig(source=f"hf:{files_dir.parent}", test_fraction=0.0))
    assert from_parquet.train == from_hf.train == from_hf_files.train
    assert len(from_parquet.train) == 10
    with pytest.raises(SourceError, match="cannot load dataset"):
        split_rows(SplitConfig(source=f"hf:{tmp_path / 'missing'}"))


def test_a_pretty_printed_json_array_splits_like_the_same_rows_as_jsonl(tmp_path):
    from deepspec.data.sources import json_array_rows

    rows = GOOD[:30] + [conv(("human", "caf\u00e9 \u2615"), ("gpt", "ok"))]
    array = tmp_path / "chats.json"
    array.write_text(json.dumps(rows[:10] + [7] + rows[10:], indent=2, ensure_ascii=False))
    jsonl = write_jsonl(tmp_path / "chats.jsonl", rows)
    a = run_split(SplitConfig(source=str(array), test_fraction=0.2), tmp_path / "a")
    b = run_split(SplitConfig(source=str(jsonl), test_fraction=0.2), tmp_path / "b")
    assert a["kept"] == b["kept"] == len(rows) and a["rejected"] == {"not_an_object": 1}
    strip = lambda rows: [{k: v for k, v in r.items() if k != "source"} for r in rows]  # noqa: E731 (the file name)
    assert strip(read(tmp_path / "a/train.jsonl")) == strip(read(tmp_path / "b/train.jsonl"))
    assert read(tmp_path / "a/rejected.jsonl")[0]["where"] == f"{array}:element 11"
    # chunk boundaries anywhere (inside strings, numbers, multi-byte characters) read the same
    every = [r.row for r in json_array_rows(array, chunk_chars=7)]
    assert every[:10] + every[11:] == rows and every[10] is None
    # a .json file of JSON lines is read as JSON lines
    lines = tmp_path / "lines.json"
    lines.write_bytes(jsonl.read_bytes())
    assert run_split(SplitConfig(source=str(lines), test_fraction=0.2), tmp_path / "c")["kept"] == len(rows)


@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_a_truncated_json_array_is_an_error_naming_the_byte_and_writes_nothing(tmp_path, cut):
    text = json.dumps(GOOD[:20], indent=1).encode()
    src = tmp_path / "cut.json"
    src.write_bytes(text[:int(len(text) * cut)])
    with pytest.raises(SourceError, match=r"cut\.json: (element \d+ at byte \d+|the JSON array ends after element \d+ at byte \d+)"):
        run_split(SplitConfig(source=str(src)), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    kept = run_split(SplitConfig(source=str(src), truncated_source="keep"), tmp_path / "kept")
    assert 0 < kept["kept"] < 20 and "cut.json" in kept["truncated_source"]


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_gzip_sources_split_like_the_uncompressed_file_and_a_truncated_one_is_an_error(tmp_path, kind):
    import gzip

    text = (json.dumps(GOOD[:40], indent=1) if kind == "json" else
            "".join(json.dumps(r) + "\n" for r in GOOD[:40])).encode()
    plain, packed = tmp_path / f"chats.{kind}", tmp_path / f"chats.{kind}.gz"
    plain.write_bytes(text)
    packed.write_bytes(gzip.compress(text))
    a = run_split(SplitConfig(source=str(plain), test_fraction=0.2), tmp_path / "a")
    b = run_split(SplitConfig(source=str(packed), test_fraction=0.2), tmp_path / "b")
    assert a["kept"] == b["kept"] == 40
    strip = lambda rows: [{k: v for k, v in r.items() if k != "source"} for r in rows]  # noqa: E731 (the file name)
    assert strip(read(tmp_path / "a/train.jsonl")) == strip(read(tmp_path / "b/train.jsonl"))
    many = [conv(("human", f"question {i}: {'words ' * 20}"), ("gpt", f"answer {i}")) for i in range(3000)]
    text = (json.dumps(many, indent=1) if kind == "json" else "".join(json.dumps(r) + "\n" for r in many)).encode()
    cut = tmp_path / f"cut.{kind}.gz"
    cut.write_bytes(gzip.compress(text)[:-200])  # a download that stopped early
    with pytest.raises(SourceError, match=r"cut\.%s\.gz: .*truncated" % kind):
        run_split(SplitConfig(source=str(cut)), tmp_path / "c")
    assert not (tmp_path / "c").exists()
    # asked for, the whole rows before the cut are kept and the report says where it was cut
    kept = run_split(SplitConfig(source=str(cut), truncated_source="keep", test_fraction=0.0), tmp_path / "d")
    assert 1000 < kept["kept"] < 3000 and "truncated" in kept["truncated_source"]
    got = read(tmp_path / "d/train.jsonl")
    assert [t["content"] for r in got for t in r["conversations"]][:4] == ["question 0: " + "words " * 20, "answer 0",
                                                                          "question 1: " + "words " * 20, "answer 1"]


def test_openai_messages_and_a_leading_assistant_turn(tmp_path):
    opening = {"messages": [{"role": "system", "content": "be kind"},
                            {"role": "assistant", "content": "Hi! Ask me anything."},
                            {"role": "user", "content": "what is 2+2?"}, {"role": "assistant", "content": "4"}]}
    src = write_jsonl(tmp_path / "src.jsonl", GOOD[:5] + [opening])
    report = run_split(SplitConfig(source=str(src), test_fraction=0.0), tmp_path / "a")
    assert report["kept"] == 6 and report["adjusted"] == {"dropped_leading_assistant": 1}
    last = read(tmp_path / "a/train.jsonl")[-1]["conversations"]
    assert [t["role"] for t in last] == ["system", "user", "assistant"] and last[1]["content"] == "what is 2+2?"
    strict = run_split(SplitConfig(source=str(src), test_fraction=0.0, leading_assistant="reject"), tmp_path / "b")
    assert strict["kept"] == 5 and strict["rejected"] == {"starts_with_assistant": 1}
