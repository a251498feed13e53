"""dvc.yaml lists, for every stage, each deepspec module its script can import (else an edit to a
module does not rerun the stage, and `dvc repro` reports stale outputs as up to date)."""
import ast
import re
from pathlib import Path

import yaml

from tests.conftest import REPO

PACKAGE = "deepspec"


def module_file(name: str, root: Path = REPO) -> Path | None:
    """The file that defines module `name` under `root`, or None if it is not one of ours."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    base = root / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = REPO) -> set[str]:
    """Every module an `import` / `from ... import` anywhere in the file (functions included) names:
    relative imports resolved, and `from pkg import name` counted as `pkg.name` when that is a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    own = module_name(path, root) if path.is_relative_to(root / PACKAGE) else ""
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def has_code(path: Path) -> bool:
    """An `__init__.py` with nothing but a docstring changes no behaviour; anything else does."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body)


def import_closure(script: Path, root: Path = REPO) -> set[Path]:
    """The script and every deepspec module file it can load, transitively; a module's parent
    packages run their `__init__.py` first, so those count too when they hold code."""
    seen, todo = set(), [script]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in imported_modules(path, root):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                f = module_file(".".join(parts[:i]), root)
                if f is not None and f not in seen and (f.name != "__init__.py" or has_code(f)):
                    todo.append(f)
    return seen


def stage_scripts(dvc_yaml: dict) -> dict[str, str]:
    out = {}
    for name, stage in dvc_yaml["stages"].items():
        m = re.search(r"\bstages/[\w-]+\.py\b", str(stage.get("cmd", "")))
        if m:
            out[name] = m.group(0)
    return out


def covered(path: str, deps: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


def missing_deps(root: Path = REPO) -> dict[str, list[str]]:
    dvc_yaml = yaml.safe_load((root / "dvc.yaml").read_text())
    missing = {}
    for name, script in stage_scripts(dvc_yaml).items():
        deps = [str(d) for d in dvc_yaml["stages"][name].get("deps", [])]
        files = sorted(p.relative_to(root).as_posix() for p in import_closure(root / script, root))
        gaps = [f for f in files if not covered(f, deps)]
        if gaps:
            missing[name] = gaps
    return missing


def test_every_stage_depends_on_every_module_it_imports():
    assert missing_deps() == {}


def test_closure_follows_every_kind_of_import(tmp_path):
    """The checker itself: imports inside functions, relative imports, `from pkg import module`,
    package __init__ with code, and a directory dep covering its files."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""docstring only"""\n')
    (pkg / "sub" / "__init__.py").write_text("from .c import C\n")
    (pkg / "sub" / "c.py").write_text("C = 1\n")
    (pkg / "sub" / "d.py").write_text("def f():\n    from . import e\n")
    (pkg / "sub" / "e.py").write_text("from ..a import A\n")
    (pkg / "a.py").write_text("A = 1\nimport json\n")
    (pkg / "b.py").write_text("def g():\n    import deepspec.a\n")
    (pkg / "unused.py").write_text("")
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "s.py").write_text("from deepspec.sub import d\nfrom deepspec import b\n")
    files = {p.relative_to(tmp_path).as_posix() for p in import_closure(tmp_path / "stages" / "s.py", tmp_path)}
    assert files == {"stages/s.py", "deepspec/sub/__init__.py", "deepspec/sub/c.py", "deepspec/sub/d.py",
                     "deepspec/sub/e.py", "deepspec/a.py", "deepspec/b.py"}
    dvc = {"stages": {"s": {"cmd": "${x.launcher} stages/s.py",
                            "deps": ["stages/s.py", "deepspec/sub", "deepspec/a.py"]},
                      "other": {"cmd": "echo no script here"}}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    assert missing_deps(tmp_path) == {"s": ["deepspec/b.py"]}


def listed_modules_beyond_imports(root: Path = REPO) -> dict[str, list[str]]:
    """deepspec module files a stage lists but cannot import: an edit there would rerun it for nothing
    (the reason train does not list the writer, its lease or verify)."""
    dvc_yaml = yaml.safe_load((root / "dvc.yaml").read_text())
    extra = {}
    for name, script in stage_scripts(dvc_yaml).items():
        files = {p.relative_to(root).as_posix() for p in import_closure(root / script, root)}
        deps = [str(d) for d in dvc_yaml["stages"][name].get("deps", [])]
        beyond = [d for d in deps if d.startswith("deepspec/") and d.endswith(".py") and d not in files]
        if beyond:
            extra[name] = beyond
    return extra


def test_no_stage_lists_a_module_it_cannot_import():
    assert listed_modules_beyond_imports() == {}


# what writes a store: an edit there must not rerun an evaluation or an export (train writes the store
# in read-through mode, so it depends on them)
STORE_WRITING = {f"deepspec/cache/{m}.py" for m in ("write/writer", "write/lease", "tools/verify", "backends/writers",
                                                     "backends/zarr/write", "backends/zarr/shard", "backends/hdf5/write",
                                                     "backends/hdf5/part", "build/stage")}


def test_evaluation_and_export_depend_on_no_store_writing_code():
    assert all((REPO / f).exists() for f in STORE_WRITING)  # the names above are the modules' own
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name in ("eval", "export"):
        reached = {p.relative_to(REPO).as_posix() for p in import_closure(REPO / f"stages/{name}.py", REPO)}
        deps = {str(d) for d in stages[name]["deps"]}
        covered_by_dir = {f for f in STORE_WRITING for d in deps if f.startswith(d.rstrip("/") + "/")}
        assert not STORE_WRITING & (reached | deps | covered_by_dir), name
