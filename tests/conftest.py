"""Shared fixtures: a throwaway clone of this repo for end-to-end DVC runs, and process env."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import deepspec.embedded  # noqa: F401  (registers the builtin:chat source the tests split)

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def project_env(root: Path, **extra: str) -> dict:
    """Environment for a subprocess that must import the code under `root`, not the installed copy."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(root)
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, env: dict | None = None, check: bool = True,
        timeout: float = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env or project_env(cwd), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc


def clone_project(dest: Path) -> Path:
    """A git clone of the working tree as it is now (tracked + untracked, minus ignored files)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           check=True, stdout=subprocess.PIPE).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "clone"]):
        subprocess.run(cmd, cwd=dest, check=True, stdout=subprocess.DEVNULL)
    return dest


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return clone_project(tmp_path / "repo")


SAMPLE_CONVERSATIONS = [
    [{"role": "user", "content": f"What is {a} plus {b}?"},
     {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
    for a in range(2, 12) for b in range(3, 9)
] + [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke"},
     {"role": "assistant", "content": "Why did the chicken cross the road? To get to the other side."}],
]


def make_model_dir(path: Path, num_layers: int = 4, hidden: int = 32, vocab: int = 400, seed: int = 0) -> Path:
    """A small random-weight Qwen3 target with the builtin tokenizer: a real model, seconds to build."""
    import torch
    from transformers import Qwen3ForCausalLM

    from deepspec.config import TinyTargetConfig
    from deepspec.models.target import default_generation_config
    from deepspec.embedded.tiny import build_config, build_tokenizer, conversation_text

    tok = build_tokenizer([conversation_text(c) for c in SAMPLE_CONVERSATIONS], vocab)
    cfg = TinyTargetConfig(hidden_size=hidden, num_layers=num_layers, num_heads=2, num_kv_heads=1,
                           head_dim=16, intermediate_size=2 * hidden)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(build_config(cfg, tok))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = default_generation_config(eos, tok.pad_token_id)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("small_target") / "model")


SMALL_TINY = dict(vocab_size=600, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=16,
                  intermediate_size=64, seq_len=64, batch_size=4, steps=80, warmup_steps=5, lr=1e-2,
                  heldout_fraction=0.1)


def write_split(path: Path, conversations=None) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, conv in enumerate(conversations or SAMPLE_CONVERSATIONS):
            f.write(json.dumps({"id": f"{i:016x}", "task": "math", "source": "unit",
                                "conversations": conv}) + "\n")
    return path


@pytest.fixture(scope="session")
def trained_target(tmp_path_factory) -> Path:
    """A 4-layer builtin-tiny target trained for a few seconds: answers are words, not noise."""
    from deepspec.config import TargetConfig, TinyTargetConfig
    from deepspec.embedded.tiny import trainer_on
    from deepspec.models.prepare import prepare_target

    root = tmp_path_factory.mktemp("trained_target")
    out = root / "target"
    rows = [{"id": f"{i:016x}", "conversations": c} for i, c in enumerate(SAMPLE_CONVERSATIONS)]
    prepare_target(TargetConfig(tiny=TinyTargetConfig(**SMALL_TINY)), [0, 1, 2], trainer_on(rows), out)
    return out


class MotoServer:
    """A real S3-compatible server (moto_server) on 127.0.0.1, started for the test session."""

    def __init__(self, log_dir: Path):
        import time

        import requests

        from deepspec.data.servers import free_port

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).parent / "moto_server"
        self.log = open(log_dir / "moto.log", "wb")
        self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                requests.get(self.endpoint, timeout=1)
                break
            except requests.RequestException:
                time.sleep(0.2)
        else:
            raise RuntimeError("moto_server did not start")
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="session")
def moto(tmp_path_factory):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def small_cache(tmp_path_factory, trained_target) -> Path:
    """A cache.zarr (layers -1, 0, 2) of the trained small target over SAMPLE_CONVERSATIONS."""
    import json

    from deepspec.cache.build.stage import build_cache
    from deepspec.config import CacheConfig

    root = tmp_path_factory.mktemp("small_cache")
    regen = root / "regen.jsonl"
    with open(regen, "w") as f:
        for i, conv in enumerate(SAMPLE_CONVERSATIONS):
            f.write(json.dumps({"id": f"{i + 1:016x}", "conversations": conv}) + "\n")
    build_cache(CacheConfig(url=str(root / "cache.zarr"), part_tokens=400), [-1, 0, 2], regen, trained_target)
    return root / "cache.zarr"


def pytest_collection_modifyitems(items):
    """Longest files first: the end-to-end pipeline module, then files with slow tests (each file's
    own order kept). Under `make test`'s pytest-xdist (one file per worker) the longest file then
    starts at once instead of last."""
    rank: dict[str, int] = {}
    for item in items:
        r = 0 if item.module.__name__.endswith("test_e2e_pipeline") else 1 if item.get_closest_marker("slow") else 2
        rank[item.fspath] = min(rank.get(item.fspath, 2), r)
    items.sort(key=lambda item: rank[item.fspath])


E2E_TIMINGS: dict = {}


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == "e2e_timings":
            E2E_TIMINGS.update(value)


def pytest_terminal_summary(terminalreporter):
    """The end-to-end workflow timings, in every run's output (CI logs included), not only with -s."""
    import json

    if E2E_TIMINGS:
        terminalreporter.write_sep("-", "data-lake workflow timings (s) and facts")
        terminalreporter.write_line(json.dumps({k: round(v, 1) if isinstance(v, float) else v
                                                for k, v in E2E_TIMINGS.items()}))
