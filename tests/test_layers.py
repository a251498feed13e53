"""The import contracts in pyproject.toml ([tool.importlinter]): layers of the library, of the cache
and of the models, and no import cycle anywhere in the package."""
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_imports_run_one_way():
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout
