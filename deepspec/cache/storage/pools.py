"""Thread pools that live as long as the process: the writer's fsyncs and shard appends run on
threads started once, not once per part (starting a part's threads again took the GIL from the
capture loop for every part). A forked child starts its own: it inherits the pool objects but none
of their threads, and a task submitted to an inherited pool would never run."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_POOLS: dict[tuple[str, int], ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def thread_pool(name: str, threads: int) -> ThreadPoolExecutor:
    """This process's pool of `threads` threads named `name`_k, started at its first use."""
    with _LOCK:
        pool = _POOLS.get((name, threads))
        if pool is None:
            pool = _POOLS[(name, threads)] = ThreadPoolExecutor(threads, thread_name_prefix=name)
        return pool


def _forget_after_fork() -> None:
    global _LOCK
    _POOLS.clear()
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
