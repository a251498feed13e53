"""Inference servers the regen stage talks to: launch, wait for health, stop.

`transformers serve` is the CPU default (started on 127.0.0.1 by the stage). sglang is GPU-only;
`sglang_commands` spells out the per-GPU servers and the sglang router in front of them — the
router is the load balancer for many servers, nothing home-made. Child servers are tied to the
stage's lifetime (PR_SET_PDEATHSIG on Linux), so even a SIGKILLed stage leaves no server behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the parent dies (a server has nothing to save)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class ManagedServer:
    """A server process this stage started; `stop()` is idempotent."""
    url: str                     # base URL, e.g. http://127.0.0.1:8000
    model: str                   # the `model` value requests must carry
    proc: subprocess.Popen
    log_path: Path
    health_path: str = "/health"
    _stopped: bool = field(default=False, repr=False)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with code {self.proc.returncode} before becoming healthy; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):  # refused, reset, timed out, or an HTTP error status
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as resp:
                    if resp.status == 200:
                        return
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"server at {self.url} not healthy after {timeout:.0f}s; log {self.log_path}:\n"
                          f"{self.log_tail()}")

    def stop(self, grace: float = 15.0) -> None:
        # SIGTERM, not SIGINT: transformers serve with continuous batching hangs on SIGINT.
        if self._stopped:
            return
        self._stopped = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _spawn(cmd: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logf = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    finally:
        logf.close()


def cb_budget(request_tokens: int, concurrency: int) -> dict[str, int]:
    """The KV cache `transformers serve --continuous-batching` needs: room for `concurrency` requests of
    up to `request_tokens` tokens each, in whole pages. Left alone it takes 80-90% of the free memory
    (on CPU that is system RAM: 12-14 GB resident for the 7.6M-parameter embedded target)."""
    from transformers import ContinuousBatchingConfig

    page = ContinuousBatchingConfig().page_size  # tokens per block (all layers)
    per_request = -(-request_tokens // page)
    blocks = concurrency * per_request
    blocks += -(-blocks * 15 // 100)  # the scheduler admits no new prompt while under 15% of blocks are free
    # tokens per forward step: the server reserves activations and a [batch, cache + batch] attention
    # mask for this many (8192 by default); one longest request's worth is enough, since a longer
    # prefill is split across steps and decoding adds one token per request
    return {"num_blocks": blocks, "max_batch_tokens": min(8192, per_request * page)}


def transformers_serve_command(model_dir: str, port: int, host: str = "127.0.0.1",
                               continuous_batching: bool = True, cb: dict[str, int] | None = None) -> list[str]:
    exe = shutil.which("transformers", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                             os.environ.get("PATH", "")]))
    if exe is None:
        raise ServerError("`transformers` CLI not found (install transformers[serving])")
    cmd = [exe, "serve", model_dir, "--host", host, "--port", str(port), "--device", "cpu",
           "--dtype", "float32"]
    if continuous_batching:
        cmd.append("--continuous-batching")
        if cb:
            cmd += ["--cb-num-blocks", str(cb["num_blocks"]), "--cb-max-batch-tokens", str(cb["max_batch_tokens"])]
    return cmd


def launch_transformers_serve(model_dir: str | Path, port: int = 0, continuous_batching: bool = True,
                              log_dir: str | Path | None = None, timeout: float = 300.0,
                              cb: dict[str, int] | None = None) -> ManagedServer:
    """Start `transformers serve` on 127.0.0.1 with `model_dir` pinned and wait until it is healthy.
    `cb` (from `cb_budget`) sizes the continuous-batching KV cache; without it the server sizes it
    from free memory."""
    model = str(model_dir)
    port = port or free_port()
    log_path = Path(log_dir or tempfile.mkdtemp(prefix="deepspec-serve-")) / f"transformers-serve-{port}.log"
    cmd = transformers_serve_command(model, port, continuous_batching=continuous_batching, cb=cb)
    log.info("starting: %s (log %s)", " ".join(cmd), log_path)
    server = ManagedServer(f"http://127.0.0.1:{port}", model, _spawn(cmd, log_path), log_path)
    server.wait_healthy(timeout)
    return server


def sglang_commands(model_path: str, num_servers: int, base_port: int = 30000, router_port: int = 30080,
                    host: str = "127.0.0.1", extra_args: tuple[str, ...] = (),
                    python: str = os.environ.get("SGLANG_PYTHON", "python")) -> dict:
    """The commands a GPU user runs: one sglang server per GPU, and the sglang router in front.
    sglang lives in its own (GPU) environment: `python` is that environment's interpreter."""
    servers = []
    for i in range(num_servers):
        servers.append({
            "env": {"CUDA_VISIBLE_DEVICES": str(i)},
            "cmd": [python, "-m", "sglang.launch_server", "--model-path", model_path,
                    "--host", host, "--port", str(base_port + i), "--dtype", "bfloat16",
                    "--mem-fraction-static", "0.9", *extra_args],
            "url": f"http://{host}:{base_port + i}",
        })
    router = [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(router_port),
              "--worker-urls", *[s["url"] for s in servers]]
    return {"servers": servers, "router": {"cmd": router, "url": f"http://{host}:{router_port}"}}


# sglang's batch-invariant kernels: the same request gives the same answer whatever else is in flight
DETERMINISTIC_SGLANG = ("--enable-deterministic-inference",)


def launch_sglang(model_path: str, num_servers: int, log_dir: Path, timeout: float = 1800.0,
                  use_router: bool = True, deterministic: bool = True) -> tuple[list[ManagedServer], list[ManagedServer]]:
    """Launch N sglang servers (one per GPU) and, optionally, the sglang router in front of them.
    Returns (endpoints requests go to: the router alone or every server, every process started)."""
    plan = sglang_commands(model_path, num_servers, base_port=free_port(), router_port=free_port(),
                           extra_args=DETERMINISTIC_SGLANG if deterministic else ())
    started: list[ManagedServer] = []
    try:
        for i, s in enumerate(plan["servers"]):
            env = dict(os.environ, **s["env"])
            started.append(ManagedServer(s["url"], model_path, _spawn(s["cmd"], log_dir / f"sglang-{i}.log", env),
                                         log_dir / f"sglang-{i}.log"))
        for s in started:
            s.wait_healthy(timeout)
        if use_router and num_servers > 1:
            r = plan["router"]
            router = ManagedServer(r["url"], model_path, _spawn(r["cmd"], log_dir / "sglang-router.log"),
                                   log_dir / "sglang-router.log")
            started.append(router)
            router.wait_healthy(timeout)
            return [router], started
        return list(started), started
    except BaseException:
        for s in started:
            s.stop()
        raise
