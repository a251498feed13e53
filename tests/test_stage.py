"""deepspec.stage: what every stage entry point shares."""
import shutil
import subprocess
import sys
import textwrap
import time

from tests.conftest import REPO, project_env

# a stage whose failure leaves a thread that never ends (as a C++ destructor joining a stuck thread would)
HANGING_STAGE = textwrap.dedent("""
    import threading
    import deepspec.stage as stage

    def main(params):
        threading.Thread(target=threading.Event().wait, name="stuck", daemon=False).start()
        raise {error}("the cache is empty")

    stage.EXIT_GRACE_S = {grace}
    stage.run_stage(main)
""")


def _run(tmp_path, error: str, grace: float) -> tuple[subprocess.CompletedProcess, float]:
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "stage.py").write_text(HANGING_STAGE.format(error=error, grace=grace))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "stage.py"], cwd=tmp_path, env=project_env(REPO), text=True,
                          capture_output=True, timeout=120)
    return proc, time.monotonic() - start


def test_a_failed_stage_whose_shutdown_hangs_exits_with_every_threads_stack(tmp_path):
    proc, took = _run(tmp_path, "stage.StageError", grace=1)
    assert proc.returncode == 1 and took < 60, (proc.returncode, took)
    assert "error: the cache is empty" in proc.stderr
    assert "Timeout" in proc.stderr and "threading.py" in proc.stderr, proc.stderr  # where it hung


def test_an_unexpected_exception_is_bounded_too(tmp_path):
    proc, took = _run(tmp_path, "RuntimeError", grace=1)  # a bug, not a user error
    assert proc.returncode == 1 and took < 60, (proc.returncode, took)
    assert "RuntimeError: the cache is empty" in proc.stderr and "Timeout" in proc.stderr, proc.stderr
