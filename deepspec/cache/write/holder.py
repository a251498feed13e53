"""Who holds a store's lease (write/lease.py): the holder's identity written into the lease body, its
bounded ttl, whether a holder on this machine has exited, and the `Lease` interface both kinds of
lease implement."""
from __future__ import annotations

import json
import os
import socket
import uuid
from abc import ABC, abstractmethod
from datetime import datetime, timezone
from pathlib import Path

from deepspec.cache.spec.format import CacheFormatError

LEASE_NAME = "lease.json"
DEFAULT_TTL_S = 300.0


class LeaseError(CacheFormatError):
    pass


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def now_utc() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def iso_utc(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def pid_namespace() -> str:
    """This process's PID namespace (`pid:[4026531836]`): two containers on one host (`--network host`)
    share its host name and boot id, and a PID means something only within one namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def owner(run_id: str, ttl: float, host: str | None = None) -> dict:
    return {"run_id": run_id, "host": host or socket.gethostname(), "boot_id": boot_id(),
            "pid_ns": pid_namespace(), "pid": os.getpid(), "created": iso_utc(now_utc()), "ttl_s": ttl,
            "token": uuid.uuid4().hex}


MAX_TTL_S = 86400.0  # a lease body is written by another job: its ttl is bounded, not trusted


def holder_ttl(holder: dict | None, default: float) -> float:
    """The holder's ttl in seconds: a stored value that is not a finite number in (0, MAX_TTL_S] (a
    hostile or broken body: NaN would never expire or always, 1e300 never) counts as MAX_TTL_S."""
    try:
        ttl = float((holder or {}).get("ttl_s", default))
    except (TypeError, ValueError):
        return MAX_TTL_S
    return ttl if 0.0 < ttl <= MAX_TTL_S else MAX_TTL_S


def describe(holder: dict | None) -> str:
    if not holder:
        return "an unknown writer (unreadable lease)"
    field = lambda k: str(holder.get(k))[:64]  # noqa: E731 - a stored body is anyone's text: shown, bounded
    return f"run {field('run_id')} (host {field('host')}, pid {field('pid')}, since {field('created')})"


def pid_gone(holder: dict) -> bool:
    """True when the holder ran on this very machine (same host name, boot and PID namespace) and has exited."""
    if holder.get("host") != socket.gethostname() or holder.get("boot_id") != boot_id() or not boot_id():
        return False
    if not pid_namespace() or holder.get("pid_ns") != pid_namespace():
        return False  # another container (or a holder that did not say which): its PID is not ours to look up
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError, TypeError):
        return False
    return False


# a lease body's fields and their types (the body is anyone's text: a pid of 10**20 must not reach
# os.kill, a run id of megabytes not a log line)
BODY_FIELDS = {"run_id": str, "host": str, "boot_id": str, "pid_ns": str, "created": str, "token": str,
               "pid": int}  # ttl_s: holder_ttl reads any value (one out of range counts as MAX_TTL_S)


def parse_body(data: bytes | None) -> dict | None:
    """The holder a lease body names, or None when it is unreadable: not JSON, not an object, or a
    known field of the wrong type or out of its range (what `describe` then calls an unknown writer)."""
    try:
        value = json.loads(data) if data else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    for key, kind in BODY_FIELDS.items():
        got = value.get(key)
        if got is None:
            continue
        if isinstance(got, bool) or not isinstance(got, kind) or (isinstance(got, str) and len(got) > 1024):
            return None
    if "pid" in value and not 0 < value["pid"] < 2**31:
        return None
    return value


class Lease(ABC):
    """A lease held (`acquire`) or joined (`join`) by this process. `check()` raises LeaseError
    unless this process's job still holds it; `release()` gives it up (holder only)."""

    url: str
    run_id: str

    @abstractmethod
    def check(self) -> None: ...

    @abstractmethod
    def release(self) -> None: ...


