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


def test_the_cache_package_names_its_public_api_and_each_subpackage_says_what_it_holds():
    import importlib

    import deepspec.cache as cache

    for name in cache.__all__:  # each loads from its subpackage on first use
        assert getattr(cache, name).__name__ == name
    for sub in ("spec", "storage", "backends", "backends.zarr", "backends.hdf5", "read", "write", "build", "tools"):
        doc = importlib.import_module(f"deepspec.cache.{sub}").__doc__
        assert doc and len(doc.split()) > 15, sub
    lines = {p.relative_to(REPO): len(p.read_text().splitlines()) for p in (REPO / "deepspec").rglob("*.py")}
    assert max(lines.values()) <= 420, max(lines.items(), key=lambda kv: kv[1])
