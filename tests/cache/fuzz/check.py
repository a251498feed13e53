"""The property, mode by mode: a case's store read in one mode (`read_mode`: CacheReader's fast path,
fast=False, or tools.verify) and judged (`run_mode`): the pristine samples or a CacheFormatError naming
the store, nothing opened outside it, a tracemalloc peak under the bound, no hang; what it gave is a
`ModeResult`, with the frame that raised (`raised_at`)."""
from __future__ import annotations

import dataclasses
import os
import time
import tracemalloc
import traceback

from deepspec.cache.spec.format import CacheFormatError
from tests.cache.fuzz.mutations import short
from tests.cache.fuzz.stores import Place, Pristine, close_reader, differs
from tests.cache.fuzz.watch import (RECORDER, REPO, CaseTimeout, cancel_background, outside, s3_outside,
                                    time_limit)

# the peak a mode may allocate over what it started with: a pristine store's reads need under 1 MiB,
# and the sizes hostile fields declare (2**31 and up) or oversized files hold lie far above it
MEMORY_BOUND = 64 << 20
TIMEOUT_LOCAL_S = 5.0
TIMEOUT_S3_S = 10.0          # a case reads ~30 ranges from moto in well under a second


@dataclasses.dataclass
class ModeResult:
    mode: str                   # "fast" | "slow" | "verify"
    outcome: str                # "same" | "refused" | "failed"
    error: str = ""             # the exception's class ("" when none)
    message: str = ""
    where: str = ""             # the frame that raised (deepspec's innermost, else the last)
    failures: list[str] = dataclasses.field(default_factory=list)   # property failures: "class: detail"
    peak: int = 0               # tracemalloc peak over the mode's start, bytes
    seconds: float = 0.0


def raised_at(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if f"{os.sep}deepspec{os.sep}" in f.filename and "site-packages" not in f.filename]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return ""
    name = os.path.relpath(frame.filename, REPO) if frame.filename.startswith(str(REPO)) else \
        frame.filename.split("site-packages/")[-1]
    return f"{name}:{frame.lineno} in {frame.name}"


def read_mode(place: Place, p: Pristine, mode: str) -> str | None:
    """Read the case's store in `mode`; None when it gave the pristine samples, else what differs."""
    from deepspec.cache.read.reader import CacheReader

    if mode == "verify":
        from deepspec.cache.tools.verify import verify

        got = verify(place.url, place.options)
        return None if got.get("ok") and got.get("samples") == len(p.samples) else f"verify returned {short(got)}"
    reader = CacheReader(place.url, place.options, fast=mode == "fast")
    try:
        n = len(reader)
        if n != len(p.samples):
            return f"{n} samples where the store has {len(p.samples)}"
        for k in range(n):
            why = differs(p.samples[k], reader.read(k))
            if why:
                return f"sample {k}: {why}"
            if reader.sample_id(k) != p.ids[k]:
                return f"sample {k}: id {reader.sample_id(k):#x} where it is {p.ids[k]:#x}"
        return None
    finally:
        close_reader(reader)


def run_mode(place: Place, p: Pristine, mode: str, bound: int, roots: tuple[str, ...]) -> ModeResult:
    result = ModeResult(mode, "same")
    timeout = TIMEOUT_S3_S if p.remote else TIMEOUT_LOCAL_S
    RECORDER.opened.clear()
    RECORDER.s3.clear()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    try:
        with time_limit(timeout):
            RECORDER.active = True
            try:
                why = read_mode(place, p, mode)
            finally:
                RECORDER.active = False
        if why:
            result.outcome = "failed"
            result.failures.append(f"different-samples: {why}")
    except CaseTimeout as e:
        result.outcome, result.error, result.message = "failed", "CaseTimeout", str(e)
        result.where = raised_at(e)
        result.failures.append(f"hang: {e}")
        cancel_background()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - every other exception is the property's to judge
        result.error, result.message, result.where = type(e).__name__, str(e), raised_at(e)
        if isinstance(e, CacheFormatError):
            result.outcome = "refused"
            if not any(name in result.message for name in place.names()):
                result.failures.append(f"message-without-store: {type(e).__name__}: {result.message[:200]}")
        else:
            result.outcome = "failed"
            result.failures.append(f"wrong-exception: {type(e).__name__}: {result.message[:200]}")
    finally:
        RECORDER.active = False
        result.seconds = time.perf_counter() - start
        place.release_fifos()
    result.peak = tracemalloc.get_traced_memory()[1] - base
    if result.peak > bound:
        result.failures.append(f"memory: peak {result.peak / 2**20:.1f} MiB over the {bound / 2**20:.0f} MiB bound")
    store = None if p.remote else place.url
    bad = outside(RECORDER.opened, store, roots) + (s3_outside(RECORDER.s3, place.url) if p.remote else [])
    if bad:
        result.failures.append("read-outside: " + "; ".join(bad[:5]) + (f" (+{len(bad) - 5})" if len(bad) > 5 else ""))
    return result
