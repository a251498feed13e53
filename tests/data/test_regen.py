import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from deepspec.config import RegenConfig, SamplingConfig
from deepspec.data.chat_client import (Client, Endpoint, ProbeError, ProbeRejected, RequestFailed, build_request,
                                       probe_endpoints)
from deepspec.data.journal import Journal, JournalError
from deepspec.data.regen import WorkerCrashed, model_eos, reproducibility, request_token_bound, run_regen, select_rows
from deepspec.data.servers import DETERMINISTIC_SGLANG, cb_budget, free_port, launch_transformers_serve, sglang_commands
from tests.conftest import REPO, SAMPLE_CONVERSATIONS, project_env, write_split

MULTI = [{"id": "a" * 16, "conversations": [
    {"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "old answer"},
    {"role": "user", "content": "What is 5 plus 6?"}, {"role": "assistant", "content": "old answer 2"}]}]


def rows(n):
    return [{"id": f"{i:016x}", "conversations": c} for i, c in enumerate(SAMPLE_CONVERSATIONS[:n])]


# ---- request bodies -------------------------------------------------------------------------------

# sglang's documented /v1/chat/completions request (ChatCompletionRequest in
# python/sglang/srt/entrypoints/openai/protocol.py, sgl-project/sglang@004c82e): field -> allowed types
SGLANG_CHAT_FIELDS = {
    "messages": list, "model": str, "max_tokens": int, "max_completion_tokens": int, "temperature": float,
    "top_p": float, "top_k": int, "min_p": float, "seed": int, "stream": bool, "stop": (str, list),
    "chat_template_kwargs": dict, "n": int, "frequency_penalty": float, "presence_penalty": float,
    "repetition_penalty": float, "min_tokens": int, "skip_special_tokens": bool,
}


def test_sglang_body_matches_the_documented_api():
    sampling = SamplingConfig(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, max_tokens=128, seed=3)
    body = build_request("sglang", "Qwen/Qwen3-4B", [{"role": "user", "content": "hi"}], sampling, 11, True)
    for key, value in body.items():
        assert key in SGLANG_CHAT_FIELDS, f"{key} is not a field of sglang's ChatCompletionRequest"
        types = SGLANG_CHAT_FIELDS[key]
        types = (int, float) if types is float else types
        assert isinstance(value, types), f"{key}={value!r} has the wrong type"
    assert body["top_k"] == 20 and body["min_p"] == 0.05 and body["seed"] == 11
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["max_tokens"] == 128 and body["temperature"] == 0.7 and body["top_p"] == 0.8
    assert build_request("sglang", "m", [], SamplingConfig(top_k=0), 0, False)["top_k"] == -1
    assert "chat_template_kwargs" not in build_request("sglang", "m", [], sampling, 0, False)


def test_transformers_body_puts_top_k_in_generation_config():
    body = build_request("transformers", "data/target", [], SamplingConfig(top_k=5, temperature=0.9), 1)
    assert "top_k" not in body
    gen = json.loads(body["generation_config"])
    assert gen == {"do_sample": True, "max_new_tokens": 64, "temperature": 0.9, "top_k": 5, "top_p": 0.8}
    greedy = json.loads(build_request("transformers", "m", [], SamplingConfig(temperature=0.0), 1)["generation_config"])
    assert greedy == {"do_sample": False, "max_new_tokens": 64}


def test_openai_body_carries_top_k_min_p_and_the_thinking_switch():
    """vLLM and sglang read these as extra top-level fields; leaving them out samples differently."""
    sampling = SamplingConfig(top_k=20, min_p=0.05)
    body = build_request("openai", "qwen", [{"role": "user", "content": "hi"}], sampling, 1, True)
    assert body["top_k"] == 20 and body["min_p"] == 0.05 and body["top_p"] == 0.8
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert build_request("openai", "m", [], SamplingConfig(top_k=0), 0, False)["top_k"] == -1  # explicitly off
    assert "chat_template_kwargs" not in build_request("openai", "m", [], sampling, 0, False)


def test_selection_is_stable_under_growth():
    small, big = rows(20), rows(60)
    cfg = RegenConfig(fraction=0.5)
    picked_small = {r["id"] for r in select_rows(small, cfg)}
    picked_big = {r["id"] for r in select_rows(big, cfg)}
    assert picked_small <= picked_big and 0 < len(picked_small) < 20


# ---- faults against a real HTTP server on 127.0.0.1 -----------------------------------------------

class FaultServer:
    """Answers /v1/chat/completions with a scripted sequence of faults, then a valid reply."""

    def __init__(self, script):
        self.script = list(script)
        self.calls = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.calls += 1
                kind = outer.script.pop(0) if outer.script else "ok"
                if kind == "slow":
                    time.sleep(1.0)
                    kind = "ok"
                if kind == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                status, body = {
                    "500": (503, b"overloaded"),
                    "html": (200, b"<html>oops</html>"),
                    "empty": (200, b'{"choices": []}'),
                    "400": (400, b'{"detail": "bad"}'),
                    "badusage": (200, json.dumps({"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}],
                                                  "usage": {"completion_tokens": "many"}}).encode()),
                    "ok": (200, json.dumps({"choices": [{"message": {"content": "fine"}, "finish_reason": "stop"}],
                                            "usage": {"completion_tokens": 2}}).encode()),
                }[kind]
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.mark.parametrize("fault, reason", [("500", "http_5xx"), ("html", "non_json"), ("empty", "empty_choices"),
                                           ("slow", "timeout"), ("drop", "connection"),
                                           ("badusage", "bad_response")])
def test_faults_are_retried_then_recorded(fault, reason):
    server = FaultServer([fault] * 10)
    delays = []
    client = Client(RegenConfig(backend="openai", max_retries=2, backoff_s=0.1, timeout_s=0.3), SamplingConfig(), sleep=delays.append)
    try:
        with pytest.raises(RequestFailed) as e:
            client.complete(Endpoint(server.url, "m"), {"messages": []})
        assert e.value.reason == reason
        assert server.calls == 3 and len(delays) == 2
        assert 0.05 <= delays[0] <= 0.15 and 0.1 <= delays[1] <= 0.3  # exponential backoff with jitter
    finally:
        server.close()


def test_transient_fault_then_success_and_4xx_not_retried():
    server = FaultServer(["500", "empty"])
    client = Client(RegenConfig(backend="openai", max_retries=3, backoff_s=0.0), SamplingConfig())
    try:
        assert client.complete(Endpoint(server.url, "m"), {}) == ("fine", "stop", 2)
        assert server.calls == 3
        server.script = ["400"]
        with pytest.raises(RequestFailed, match="http_4xx"):
            client.complete(Endpoint(server.url, "m"), {})
        assert server.calls == 4
    finally:
        server.close()


def test_connection_refused_is_recorded_per_row(tmp_path):
    dead = Endpoint(f"http://127.0.0.1:{free_port()}", "m")
    journal = Journal(tmp_path / "j", "fp")
    ordered, errors = run_regen(rows(3), [dead], RegenConfig(backend="openai", max_retries=1, backoff_s=0.0, concurrency=2),
                                SamplingConfig(), journal)
    assert ordered == [] and sorted(e["reason"] for e in errors) == ["connection"] * 3


def test_a_bug_in_a_worker_stops_the_run_instead_of_becoming_a_row_error(tmp_path):
    """Only transport/server faults are row errors; a row the client code cannot handle is a bug."""
    server = FaultServer([])
    bad = {"id": "b" * 16, "conversations": [{"role": "user", "text": "no content key"}]}
    journal = Journal(tmp_path / "j", "fp")
    try:
        with pytest.raises(WorkerCrashed, match=f"row {bad['id']}.*KeyError: 'content'") as e:
            run_regen(rows(3) + [bad], [Endpoint(server.url, "m")],
                      RegenConfig(backend="openai", concurrency=1, max_error_fraction=1.0), SamplingConfig(), journal)
        assert isinstance(e.value.__cause__, KeyError)  # the original traceback travels with it
        journal.close()
        kept = Journal(tmp_path / "j", "fp")  # rows finished before the crash are journaled, not lost
        assert sorted(kept.done) == sorted(r["id"] for r in rows(3))
    finally:
        server.close()


class StrictServer:
    """An OpenAI-compatible endpoint that validates requests like a strict server: an unknown top-level
    field is an HTTP 400 naming it (the OpenAI API's behaviour). Records every body it accepts."""

    BASE = {"model", "messages", "max_tokens", "temperature", "top_p", "seed", "stream"}

    def __init__(self, extra_fields=("top_k", "min_p", "chat_template_kwargs")):
        self.allowed = self.BASE | set(extra_fields)
        self.bodies = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                unknown = sorted(set(body) - outer.allowed)
                if unknown:
                    status, reply = 400, {"error": {"message": f"Unrecognized request argument supplied: "
                                                               f"{unknown[0]}", "type": "invalid_request_error"}}
                else:
                    outer.bodies.append(body)
                    status, reply = 200, {"choices": [{"message": {"content": "fine"}, "finish_reason": "stop"}],
                                          "usage": {"completion_tokens": 1}}
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.mark.parametrize("missing, param", [("top_k", "sampling.top_k"), ("min_p", "sampling.min_p"),
                                            ("chat_template_kwargs", "regen.disable_thinking")])
def test_probe_names_the_parameter_a_server_rejects(missing, param):
    server = StrictServer(extra_fields={"top_k", "min_p", "chat_template_kwargs"} - {missing})
    cfg = RegenConfig(backend="openai", max_retries=0)
    try:
        with pytest.raises(ProbeRejected, match=rf"{server.url} rejects `{missing}` \(HTTP 400.*{param}"):
            probe_endpoints([Endpoint(server.url, "m")], cfg, SamplingConfig())
        assert server.bodies and all(missing not in b for b in server.bodies)  # found by leaving each out
    finally:
        server.close()


def test_probe_leaves_out_a_dead_server_and_rows_go_to_the_live_one(tmp_path, caplog):
    server = StrictServer()
    dead = Endpoint(f"http://127.0.0.1:{free_port()}", "m")
    cfg = RegenConfig(backend="openai", max_retries=1, backoff_s=0.0, concurrency=2)
    try:
        live = probe_endpoints([dead, Endpoint(server.url, "m")], cfg, SamplingConfig())
        assert live == [Endpoint(server.url, "m")]
        assert f"{dead.url} did not answer the start-up probe" in caplog.text
        probe = server.bodies[0]
        assert probe["top_k"] == 20 and probe["min_p"] == 0.0 and probe["chat_template_kwargs"] == {
            "enable_thinking": False}
        ordered, errors = run_regen(rows(4), live, cfg, SamplingConfig(), Journal(tmp_path / "j", "fp"))
        assert errors == [] and len(ordered) == 4
        assert all(b["top_k"] == 20 and b["top_p"] == 0.8 for b in server.bodies)
        with pytest.raises(ProbeError, match=rf"no server answered.*{dead.url}.*connection"):
            probe_endpoints([dead], cfg, SamplingConfig())
    finally:
        server.close()


def regen_workdir(tmp_path, regen: dict) -> Path:
    work = tmp_path / "work"
    write_split(work / "data" / "split" / "train.jsonl", SAMPLE_CONVERSATIONS[:5])
    (work / "data" / "target").mkdir(parents=True)
    (work / "data" / "target" / "identity.json").write_text(json.dumps({"id": "t" * 16}))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["regen"] |= {"fraction": 1.0} | regen  # every row (the embedded default takes half)
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    return work


def run_regen_stage(work: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "stages" / "regen.py")], cwd=work, env=project_env(REPO),
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)


def test_stage_stops_when_the_endpoint_rejects_a_sampling_field(tmp_path):
    strict = StrictServer(extra_fields=())
    try:
        work = regen_workdir(tmp_path, {"backend": "openai", "urls": [strict.url], "max_retries": 0})
        proc = run_regen_stage(work)
    finally:
        strict.close()
    assert proc.returncode == 2, proc.stdout
    assert f"error: regen: {strict.url} rejects `top_k`" in proc.stdout and "Traceback" not in proc.stdout
    assert not (work / "data" / "regen" / "train.jsonl").exists()


def test_stage_regenerates_through_the_live_servers_only(tmp_path):
    live = StrictServer()
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        work = regen_workdir(tmp_path, {"backend": "openai", "urls": [dead, live.url], "max_retries": 1,
                                        "backoff_s": 0.0})
        proc = run_regen_stage(work)
    finally:
        live.close()
    assert proc.returncode == 0, proc.stdout
    assert f"{dead} did not answer the start-up probe" in proc.stdout
    out = [json.loads(line) for line in (work / "data" / "regen" / "train.jsonl").read_text().splitlines()]
    assert len(out) == 5 and (work / "data" / "regen" / "errors.jsonl").read_text() == ""
    assert len(live.bodies) == 1 + sum(1 for c in SAMPLE_CONVERSATIONS[:5] for t in c if t["role"] == "user")


# ---- the journal -----------------------------------------------------------------------------------

def test_journal_drops_a_torn_line_and_resets_on_new_fingerprint(tmp_path):
    j = Journal(tmp_path / "j", "fp1")
    j.append({"id": "1", "x": 1})
    j.append({"id": "2", "x": 2})
    j.close()
    with open(tmp_path / "j" / "rows.jsonl", "a") as f:
        f.write('{"id": "3", "x"')  # killed mid-write
    j = Journal(tmp_path / "j", "fp1")
    assert sorted(j.done) == ["1", "2"]
    j.append({"id": "3", "x": 3})
    j.close()
    assert len((tmp_path / "j" / "rows.jsonl").read_text().splitlines()) == 3
    assert Journal(tmp_path / "j", "fp2").done == {}


def test_a_journal_of_other_params_is_set_aside_and_resumed_when_they_come_back(tmp_path):
    j = Journal(tmp_path / "j", "fp1")
    j.append({"id": "1", "x": 1})
    j.close()
    j2 = Journal(tmp_path / "j", "fp2")
    assert j2.done == {}
    j2.append({"id": "1", "x": 2})
    j2.close()
    aside = tmp_path / "j-stale-fp1"
    assert [json.loads(line) for line in (aside / "rows.jsonl").read_text().splitlines()] == [{"id": "1", "x": 1}]
    j1 = Journal(tmp_path / "j", "fp1")  # back to the first params: their finished rows are reused
    assert j1.done == {"1": {"id": "1", "x": 1}} and not aside.exists()
    j1.close()
    assert Journal(tmp_path / "j", "fp2").done == {"1": {"id": "1", "x": 2}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["j", "j-stale-fp1"]


def test_journal_counts_the_first_copy_of_a_row_and_lists_ids_in_journal_order(tmp_path):
    # a row finished twice (two servers raced, or an old copy resumed): the first line is the row
    j = Journal(tmp_path / "j", "fp")
    for row in ({"id": "b", "x": 1}, {"id": "a", "x": 2}, {"id": "b", "x": 3}):
        j.append(row)
    assert list(j.done) == ["b", "a"] and j.done["b"] == {"id": "b", "x": 1} and len(j.done) == 2
    j.close()
    j = Journal(tmp_path / "j", "fp")  # the same after recovery from the file
    assert list(j.done) == ["b", "a"] and j.done["b"] == {"id": "b", "x": 1} and "c" not in j.done
    assert list(j.in_order([{"id": "a"}, {"id": "c"}, {"id": "b"}])) == [{"id": "a", "x": 2}, {"id": "b", "x": 1}]
    j.close()


@pytest.mark.parametrize("bad_line", [b'{"id": "2", "x"\n', b"\x00\x00\x00\n", b'["not", "a", "row"]\n'])
def test_journal_line_corrupt_mid_file_is_an_error_naming_file_and_line(tmp_path, bad_line):
    j = Journal(tmp_path / "j", "fp")
    j.append({"id": "1", "x": 1})
    j.close()
    path = tmp_path / "j" / "rows.jsonl"
    with open(path, "ab") as f:
        f.write(bad_line + b'{"id": "3", "x": 3}\n')
    before = path.read_bytes()
    with pytest.raises(JournalError, match=rf"{path}:2: corrupt journal line"):
        Journal(tmp_path / "j", "fp")
    assert path.read_bytes() == before  # nothing written is dropped or rewritten


def test_stage_reports_a_corrupt_journal_without_a_traceback(tmp_path):
    from deepspec.params import load_params
    from deepspec.data.regen import regen_fingerprint
    from deepspec.devices import local_device
    from deepspec.models.target import compute_dtype

    work = tmp_path / "work"
    write_split(work / "data" / "split" / "train.jsonl")
    (work / "data" / "target").mkdir(parents=True)
    (work / "data" / "target" / "identity.json").write_text(json.dumps({"id": "t" * 16}))
    (work / "params.yaml").write_text((REPO / "params.yaml").read_text())
    p = load_params(work / "params.yaml")
    compute = {"dtype": compute_dtype(local_device())}  # what the stage keys a local backend's journal by
    Journal(work / "data" / "regen" / "journal", regen_fingerprint(p.regen, p.sampling, {"id": "t" * 16}, compute)).close()
    (work / "data" / "regen" / "journal" / "rows.jsonl").write_bytes(b'{"id": "1"}\n}{\n')
    proc = subprocess.run([sys.executable, str(REPO / "stages" / "regen.py")], cwd=work, env=project_env(REPO),
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert proc.returncode == 2, proc.stdout
    assert "data/regen/journal/rows.jsonl:2: corrupt journal line" in proc.stdout
    assert "Traceback" not in proc.stdout


# ---- a real `transformers serve` on 127.0.0.1 --------------------------------------------------------

@pytest.fixture(scope="module")
def serve_sequential(trained_target):
    server = launch_transformers_serve(trained_target, continuous_batching=False, timeout=180)
    yield server
    server.stop()


def test_multi_turn_rows_replace_every_answer(serve_sequential, tmp_path):
    ep = Endpoint(serve_sequential.url, serve_sequential.model)
    ordered, errors = run_regen(MULTI + rows(2), [ep], RegenConfig(backend="transformers", concurrency=1),
                                SamplingConfig(max_tokens=12), Journal(tmp_path / "j", "fp"))
    assert errors == []
    assert [r["id"] for r in ordered] == [MULTI[0]["id"], rows(2)[0]["id"], rows(2)[1]["id"]]
    conv = ordered[0]["conversations"]
    assert [t["role"] for t in conv] == ["user", "assistant", "user", "assistant"]
    assert [t["content"] for t in conv if t["role"] == "user"] == ["What is 3 plus 4?", "What is 5 plus 6?"]
    assert all(t["content"] not in ("old answer", "old answer 2") for t in conv if t["role"] == "assistant")
    assert len(ordered[0]["finish_reasons"]) == 2
    assert set(ordered[0]["finish_reasons"]) <= {"stop", "length"}


def test_sampling_settings_take_effect(serve_sequential):
    ep = Endpoint(serve_sequential.url, serve_sequential.model)
    client = Client(RegenConfig(backend="transformers"), SamplingConfig())
    msgs = [{"role": "user", "content": "What is 7 plus 5?"}]

    def ask(sampling, seed):
        return client.complete(ep, build_request("transformers", ep.model, msgs, sampling, seed))[0]

    hot = SamplingConfig(temperature=1.5, top_p=1.0, top_k=0, max_tokens=24)
    assert len({ask(hot, s) for s in (1, 2, 3)}) > 1             # different seeds, different answers
    assert ask(hot, 7) == ask(hot, 7)                              # same seed, same answer
    greedy = SamplingConfig(temperature=0.0, max_tokens=24)
    assert ask(greedy, 1) == ask(greedy, 2)                        # temperature 0 is deterministic


def test_probe_against_transformers_serve(serve_sequential):
    """The real server: its own backend's body passes; the vLLM/sglang extras are refused by name."""
    ep = Endpoint(serve_sequential.url, serve_sequential.model)
    cfg = RegenConfig(backend="transformers", max_retries=0)
    assert probe_endpoints([ep], cfg, SamplingConfig()) == [ep]
    with pytest.raises(ProbeRejected, match=rf"{ep.url} rejects `top_k` \(HTTP 4\d\d.*sampling.top_k"):
        probe_endpoints([ep], RegenConfig(backend="openai", max_retries=0), SamplingConfig())


def test_server_killed_mid_run_then_rerun_completes(trained_target, tmp_path):
    server = launch_transformers_serve(trained_target, continuous_batching=False, timeout=180)
    ep = Endpoint(server.url, server.model)
    cfg = RegenConfig(backend="transformers", concurrency=1, max_retries=1, backoff_s=0.05, timeout_s=20)
    data = rows(len(SAMPLE_CONVERSATIONS))
    journal = Journal(tmp_path / "j", "fp")

    def kill_after_three_rows():
        while len(journal.done) < 3:
            time.sleep(0.005)
        server.proc.kill()

    killer = threading.Thread(target=kill_after_three_rows)
    killer.start()
    try:
        ordered, errors = run_regen(data, [ep], cfg, SamplingConfig(max_tokens=48), journal)
    finally:
        killer.join()
        server.stop()
    assert errors and {e["reason"] for e in errors} <= {"connection", "timeout"}
    assert len(ordered) + len(errors) == len(data)
    journal.close()
    server = launch_transformers_serve(trained_target, continuous_batching=False, timeout=180)
    try:
        journal = Journal(tmp_path / "j", "fp")
        done_before = dict(journal.done)
        ordered, errors = run_regen(data, [Endpoint(server.url, server.model)], cfg,
                                    SamplingConfig(max_tokens=48), journal)
    finally:
        server.stop()
    assert errors == [] and [r["id"] for r in ordered] == [r["id"] for r in data]
    assert all(journal.done[i] == row for i, row in done_before.items())


def proc_status(pid: int, field: str) -> int:
    """A /proc/<pid>/status memory field in bytes (VmHWM = peak resident set)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def test_request_token_bound_counts_history_at_max_tokens(small_model_dir):
    from transformers import AutoTokenizer

    from deepspec.data.template import encode_prompt

    tok = AutoTokenizer.from_pretrained(small_model_dir)
    sampling = SamplingConfig(max_tokens=32)
    history = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": ""},
               {"role": "user", "content": "What is 5 plus 6?"}]
    expected = len(encode_prompt(tok, history)) + 32 + 32  # one earlier answer at its bound, one to generate
    assert request_token_bound(tok, MULTI, sampling, False) == expected
    assert request_token_bound(tok, MULTI + rows(3), sampling, False) == expected  # the longest row decides


def test_continuous_batching_server_is_sized_from_the_work(small_model_dir, tmp_path, monkeypatch):
    """`transformers serve --continuous-batching` would size its KV cache from free RAM (80-90% of it);
    sized from the rows, the max tokens and the concurrency it stays small and still serves every row."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "yes")  # the user's setting reaches the server unchanged
    data = MULTI + rows(11)
    sampling = SamplingConfig(max_tokens=32)
    budget = cb_budget(request_token_bound(AutoTokenizer.from_pretrained(small_model_dir), data, sampling, True),
                       concurrency=4)
    server = launch_transformers_serve(small_model_dir, continuous_batching=True, cb=budget, timeout=180)
    try:
        cmd = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert cmd[cmd.index(b"--cb-num-blocks") + 1] == str(budget["num_blocks"]).encode()
        assert b"HF_HUB_OFFLINE=yes" in Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
        ordered, errors = run_regen(data, [Endpoint(server.url, server.model)],
                                    RegenConfig(backend="transformers", concurrency=4), sampling,
                                    Journal(tmp_path / "j", "fp"), eos_token_id=model_eos(small_model_dir))
        peak = proc_status(server.proc.pid, "VmHWM")
    finally:
        server.stop()
    assert errors == [] and len(ordered) == len(data)
    assert peak < 2 * 2**30, f"server peak RSS {peak / 2**20:.0f} MiB"


def server_pids(work: Path) -> list[int]:
    """`transformers serve` processes running in `work` (the ones a regen stage there started)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and b"serve" in (d / "cmdline").read_bytes() and (d / "cwd").resolve() == work.resolve():
                found.append(int(d.name))
        except OSError:
            continue
    return found


def test_stage_sizes_the_server_it_starts(trained_target, tmp_path):
    """The regen stage's own `transformers serve` gets a KV cache sized from its rows (checked on the
    running server's command line before it could reserve most of the machine's memory)."""
    from transformers import AutoTokenizer

    work = tmp_path / "work"
    shutil.copytree(trained_target, work / "data" / "target")
    data = SAMPLE_CONVERSATIONS[-1:] + SAMPLE_CONVERSATIONS[:5]
    write_split(work / "data" / "split" / "train.jsonl", data)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["sampling"]["max_tokens"] = 16
    params["regen"] |= {"backend": "transformers", "concurrency": 2, "fraction": 1.0}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    rows_ = [{"id": str(i), "conversations": c} for i, c in enumerate(data)]
    budget = cb_budget(request_token_bound(AutoTokenizer.from_pretrained(trained_target), rows_,
                                           SamplingConfig(max_tokens=16), True), 2)
    proc = subprocess.Popen([sys.executable, str(REPO / "stages" / "regen.py")], cwd=work, env=project_env(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not server_pids(work) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        pids = server_pids(work)
        assert pids, "the stage started no server"
        cmd = Path(f"/proc/{pids[0]}/cmdline").read_bytes().decode().split("\0")
        assert "--cb-num-blocks" in cmd, f"unsized KV cache: {' '.join(cmd)}"
        assert cmd[cmd.index("--cb-num-blocks") + 1] == str(budget["num_blocks"])
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert len((work / "data" / "regen" / "train.jsonl").read_text().splitlines()) == len(data)


@pytest.mark.slow
def test_stage_sigkill_then_rerun_has_each_id_exactly_once(trained_target, tmp_path):
    """`python stages/regen.py` as DVC runs it: SIGKILL it mid-run, rerun, compare."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    shutil.copytree(trained_target, work / "data" / "target")
    data = [c for c in SAMPLE_CONVERSATIONS] * 1
    write_split(work / "data" / "split" / "train.jsonl", data)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["sampling"]["max_tokens"] = 24
    params["regen"] = {"backend": "transformers", "concurrency": 2, "fraction": 1.0}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    env = project_env(REPO)
    cmd = [sys.executable, str(REPO / "stages" / "regen.py")]
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    journal = work / "data" / "regen" / "journal" / "rows.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:
        if journal.exists() and len(journal.read_bytes().splitlines()) >= 5:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {json.loads(line)["id"]: json.loads(line) for line in journal.read_bytes().splitlines()
              if line.endswith(b"}")}
    assert 5 <= len(before) < len(data)
    def our_servers():  # the stage's server must die with it (PR_SET_PDEATHSIG)
        pids = subprocess.run(["pgrep", "-f", "serve data/target"], stdout=subprocess.PIPE, text=True).stdout
        return [p for p in pids.split() if Path(f"/proc/{p}/cwd").exists()
                and Path(f"/proc/{p}/cwd").resolve() == work.resolve()]

    for _ in range(50):
        if not our_servers():
            break
        time.sleep(0.2)
    assert our_servers() == []
    subprocess.run(cmd, cwd=work, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = [json.loads(line) for line in open(work / "data" / "regen" / "train.jsonl")]
    ids = [r["id"] for r in out]
    assert ids == [f"{i:016x}" for i in range(len(data))]  # every id exactly once, in input order
    for row in out:
        if row["id"] in before:
            assert row["conversations"] == before[row["id"]]["conversations"]
    assert (work / "data" / "regen" / "errors.jsonl").read_text() == ""


@pytest.mark.parametrize("cfg, sampling, expected", [
    (RegenConfig(backend="transformers", concurrency=32), SamplingConfig(), False),
    (RegenConfig(backend="transformers", concurrency=1), SamplingConfig(temperature=0.0), True),
    (RegenConfig(backend="transformers", concurrency=1), SamplingConfig(), False),
    (RegenConfig(backend="sglang", launch_servers=8), SamplingConfig(), True),
    (RegenConfig(backend="sglang", launch_servers=8, deterministic=False), SamplingConfig(), False),
    (RegenConfig(backend="sglang", urls=["http://10.0.0.5:30000"]), SamplingConfig(), False),
    (RegenConfig(backend="openai", urls=["http://10.0.0.5:8000"]), SamplingConfig(temperature=0.0), False),
])
def test_the_report_says_per_backend_whether_answers_are_reproducible(cfg, sampling, expected):
    got = reproducibility(cfg, sampling)
    assert got["reproducible"] is expected and got["why"]


def test_launched_sglang_servers_run_deterministic_inference():
    plan = sglang_commands("m", 2, extra_args=DETERMINISTIC_SGLANG)
    assert all("--enable-deterministic-inference" in s["cmd"] for s in plan["servers"])
