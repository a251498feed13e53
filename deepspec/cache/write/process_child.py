"""Starting the writer process of process_writer.ProcessWriter, and naming how it ended."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from deepspec.cache.spec.format import CacheFormatError


def child_env() -> dict:
    """This environment, with the directory this package was imported from first on PYTHONPATH when
    it is a checkout (not an installation's site-packages, which must stay after the standard library)."""
    import site

    env = dict(os.environ)
    root = Path(__file__).resolve().parents[3]
    installed = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root not in installed:
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def start_child() -> tuple[subprocess.Popen, Connection, Connection]:
    """A fresh interpreter running process_serve (not a fork: this process may hold a GPU's context,
    and a spawn would import the user's __main__ again), and this side's (commands, events) channels."""
    ours, theirs = socket.socketpair(), socket.socketpair()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deepspec.cache.write.process_serve", str(ours[1].fileno()),
             str(theirs[1].fileno())], pass_fds=(ours[1].fileno(), theirs[1].fileno()), env=child_env())
    except BaseException:
        ours[0].close()
        theirs[0].close()
        raise
    finally:
        ours[1].close()
        theirs[1].close()
    return proc, Connection(ours[0].detach()), Connection(theirs[0].detach())


def how_it_ended(proc: subprocess.Popen, url: str, seen: BaseException | None) -> CacheFormatError:
    """The error of a writer process that stopped answering: how it exited, or (still running after
    a few seconds) what its channel raised (`seen`)."""
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return CacheFormatError(f"{url}: the cache writer process (pid {proc.pid}) stopped taking parts "
                                f"({type(seen).__name__}: {seen})")
    how = f"signal {-code}" if code < 0 else f"code {code}"
    return CacheFormatError(f"{url}: the cache writer process (pid {proc.pid}) exited with {how}")
