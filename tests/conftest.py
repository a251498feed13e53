"""Shared fixtures: a throwaway clone of this repo for end-to-end DVC runs, and process env."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
