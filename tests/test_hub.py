"""`hf:` sources and the offline switch: the user's environment decides, never the stage.

The embedded default and these tests run offline (conftest sets HF_HUB_OFFLINE=1); `hf:` sources then
resolve from a local hub cache laid out exactly as huggingface_hub writes one. With offline mode off
the stages really ask the hub (here HF_ENDPOINT points at a local server that knows no repo)."""
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, SAMPLE_CONVERSATIONS, project_env

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_snapshot(cache: Path, kind: str, repo: str) -> Path:
    """The folder huggingface_hub would have downloaded `repo` into (refs/main -> one snapshot)."""
    root = cache / f"{kind}s--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    return snap


class EmptyHub:
    """A stand-in for the hub (HF_ENDPOINT) that has no repos: every request is a 404, and counted."""

    def __init__(self):
        self.requests = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _404(self):
                outer.requests.append(self.path)
                body = b'{"error": "Repository not found"}'
                self.send_response(404)
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_HEAD = do_POST = _404

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def hub(tmp_path):
    server = EmptyHub()
    yield server
    server.close()


def stage_env(tmp_path: Path, offline: bool, endpoint: str | None = None) -> dict:
    env = project_env(REPO, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_CACHE=str(tmp_path / "hub"))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
        env.pop(var, None)
    if offline:
        env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return env


def run_stage(tmp_path: Path, stage: str, params: dict, env: dict) -> subprocess.CompletedProcess:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in params.items():
        base[section] = base[section] | values if isinstance(values, dict) else values
    (work / "params.yaml").write_text(yaml.safe_dump(base))
    return subprocess.run([sys.executable, str(REPO / "stages" / f"{stage}.py")], cwd=work, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)


# ---- target.source: hf:<repo> ----------------------------------------------------------------------

def test_hf_target_resolves_from_the_local_hub_cache_offline(tmp_path, small_model_dir):
    from deepspec.models.target import identity

    shutil.copytree(small_model_dir, hub_snapshot(tmp_path / "hub", "model", "acme/tiny"), dirs_exist_ok=True)
    proc = run_stage(tmp_path, "target", {"layers": [1, 2], "target": {"source": "hf:acme/tiny"}},
                     stage_env(tmp_path, offline=True))
    assert proc.returncode == 0, proc.stdout
    written = json.loads((tmp_path / "work" / "data" / "target" / "identity.json").read_text())
    assert written == identity(small_model_dir)


def test_missing_hf_target_offline_says_how_to_go_online(tmp_path):
    proc = run_stage(tmp_path, "target", {"layers": [1], "target": {"source": "hf:acme/absent"}},
                     stage_env(tmp_path, offline=True))
    assert proc.returncode == 2, proc.stdout
    assert "error: hf:acme/absent: cannot fetch" in proc.stdout
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in proc.stdout
    assert str(tmp_path / "hub") in proc.stdout and "HF_HUB_OFFLINE=0" in proc.stdout
    assert "Traceback" not in proc.stdout


def test_stages_do_not_force_offline_mode(tmp_path, hub):
    """With HF_HUB_OFFLINE unset a stage asks the hub (a 404 here) and its error says offline is off."""
    proc = run_stage(tmp_path, "target", {"layers": [1], "target": {"source": "hf:acme/absent"}},
                     stage_env(tmp_path, offline=False, endpoint=hub.url))
    assert hub.requests, proc.stdout  # the stage really went to the hub
    assert proc.returncode == 2, proc.stdout
    assert "error: hf:acme/absent: cannot fetch" in proc.stdout
    assert "offline mode is off" in proc.stdout and "HF_TOKEN" in proc.stdout
    assert "Traceback" not in proc.stdout


# ---- split.source: hf:<dataset> ----------------------------------------------------------------------

def write_parquet_dataset(snap: Path, n: int = 24) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"conversations": [{"from": "human" if t["role"] == "user" else "gpt", "value": t["content"]}
                               for t in conv]} for conv in SAMPLE_CONVERSATIONS[:n]]
    (snap / "data").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), snap / "data" / "train-00000-of-00001.parquet")


def test_hf_dataset_resolves_from_the_local_hub_cache_offline(tmp_path):
    write_parquet_dataset(hub_snapshot(tmp_path / "hub", "dataset", "acme/chat"))
    proc = run_stage(tmp_path, "split", {"split": {"source": "hf:acme/chat", "test_fraction": 0.0}},
                     stage_env(tmp_path, offline=True))
    assert proc.returncode == 0, proc.stdout
    train = (tmp_path / "work" / "data" / "split" / "train.jsonl").read_text().splitlines()
    assert len(train) == 24


@pytest.mark.parametrize("offline", [True, False])
def test_missing_hf_dataset_error_tells_the_offline_state(tmp_path, hub, offline):
    proc = run_stage(tmp_path, "split", {"split": {"source": "hf:acme/absent"}},
                     stage_env(tmp_path, offline=offline, endpoint=hub.url))
    assert proc.returncode == 2, proc.stdout
    assert "error: hf:acme/absent: cannot load dataset" in proc.stdout
    if offline:
        assert "offline mode is on (HF_HUB_OFFLINE=1)" in proc.stdout and "HF_HUB_OFFLINE=0" in proc.stdout
        assert not hub.requests
    else:
        assert "offline mode is off" in proc.stdout and hub.requests
    assert "Traceback" not in proc.stdout


# ---- the Makefile: offline by default, the environment decides --------------------------------------

@pytest.mark.parametrize("env_value, expected", [(None, "1"), ("0", "0")])
def test_makefile_offline_default_yields_to_the_environment(env_value, expected):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    if env_value is not None:
        env |= {"HF_HUB_OFFLINE": env_value, "HF_DATASETS_OFFLINE": env_value}
    # what a recipe of the Makefile sees in its environment (make -n would not run it)
    out = subprocess.run(["make", "-s", "--no-print-directory", "-f", str(REPO / "Makefile"), "-f", "-",
                          "show-offline"], input="show-offline:\n\t@echo $$HF_HUB_OFFLINE $$HF_DATASETS_OFFLINE\n",
                         cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    assert out.stdout.split() == [expected, expected], out.stdout
