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


def test_tests_import_no_private_name_of_the_library():
    """A test states a module's public behaviour: what it needs of a module is public (fault injection
    included), so a refactor that keeps behaviour keeps the tests."""
    import ast

    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspec"):
                found += [f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, "\n".join(found)
