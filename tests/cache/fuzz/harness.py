"""What ties the pieces together: `Case` (a pristine store, the mutations drawn for it, the modes it
is read in) and the strategy that draws one (`cases`), `Outcome` (how each mutation applied and what
each mode gave) and `Harness`, which runs a case: a copy of its store, the mutations applied, every
mode read and judged under the recorders and tracemalloc it installs."""
from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
import tracemalloc
from typing import Iterator

from hypothesis import strategies as st

from tests.cache.fuzz.check import MEMORY_BOUND, ModeResult, run_mode
from tests.cache.fuzz.edits import apply, huge_size
from tests.cache.fuzz.mutations import Mutation, mutation
from tests.cache.fuzz.stores import LocalPlace, Place, Pristine, S3Place, forget_listings
from tests.cache.fuzz.watch import install_recorders, library_roots, start_tracing, uninstall_recorders


@dataclasses.dataclass(frozen=True)
class Case:
    pristine: Pristine
    mutations: tuple[Mutation, ...]
    modes: tuple[str, ...]             # "fast" always; "slow" (fast=False), "verify" for some

    def __repr__(self) -> str:
        return f"Case({self.pristine.backend}/{self.pristine.variant}: " + "; ".join(map(str, self.mutations)) + \
            f"; modes {'+'.join(self.modes)})"

    def _repr_pretty_(self, printer, cycle) -> None:  # how hypothesis shows a failing case
        printer.text(repr(self))


def cases(pristines: list[Pristine]) -> st.SearchStrategy[Case]:
    """A case over one of `pristines` (the variants of one backend)."""
    @st.composite
    def draw_case(draw) -> Case:
        p = draw(st.sampled_from(pristines))
        muts = tuple(draw(st.lists(mutation(p), min_size=1, max_size=3)))
        # one case in eight (sixteen on S3) also reads through zarr-python/h5py (several times the
        # fast path's time: a request per chunk on S3), as many also run verify
        extra = draw(st.integers(0, 15 if p.remote else 7))
        modes = ("fast",) + (("slow",) if extra == 1 else ("verify",) if extra == 2 else ())
        return Case(p, muts, modes)

    return draw_case()


@dataclasses.dataclass
class Outcome:
    case: Case
    applied: list[str]
    results: list[ModeResult]
    seconds: float

    @property
    def failures(self) -> list[str]:
        return [f"{r.mode}: {f}" for r in self.results for f in r.failures]

    @property
    def summary(self) -> str:
        """The fast mode's outcome, for the table: "same", "refused <Error>" or "failed"."""
        r = self.results[0]
        return "failed" if r.failures else "same" if r.outcome == "same" else f"refused {r.error}"

    def report(self) -> str:
        p = self.case.pristine
        lines = [f"{p.backend}/{p.variant}: {len(self.case.mutations)} mutation(s)"]
        lines += [f"  {m}  [{a}]" for m, a in zip(self.case.mutations, self.applied)]
        for r in self.results:
            head = f"  {r.mode}: {r.outcome}" + (f" {r.error}: {r.message[:300]}" if r.error else "")
            lines.append(head + (f"  (raised at {r.where})" if r.where and r.failures else ""))
            lines += [f"    PROPERTY FAILURE {f}" for f in r.failures]
        return "\n".join(lines)


class Harness:
    """Runs cases: where local copies go, the S3 bucket and client for remote ones."""

    def __init__(self, work: str, s3_client=None, bucket: str | None = None):
        self.work = work
        self.client, self.bucket = s3_client, bucket
        self.copies: dict[tuple[str, str], S3Place] = {}
        self.roots = library_roots()
        install_recorders()
        self.started_tracing = start_tracing()

    def close(self) -> None:
        uninstall_recorders()
        if self.started_tracing:
            tracemalloc.stop()

    @contextlib.contextmanager
    def place(self, p: Pristine) -> Iterator[Place]:
        if p.remote:
            key = (p.backend, p.variant)
            if key not in self.copies:
                self.copies[key] = S3Place(p, self.client, self.bucket)
            place: Place = self.copies[key]
            forget_listings()
        else:
            place = LocalPlace(tempfile.mkdtemp(prefix="case-", dir=self.work), p)
        try:
            yield place
        finally:
            place.close()

    def run(self, case: Case) -> Outcome:
        p = case.pristine
        start = time.perf_counter()
        with self.place(p) as place:
            applied = [apply(place, p, m) for m in case.mutations]
            bound = MEMORY_BOUND
            for m, a in zip(case.mutations, applied):
                if m.kind == "huge_object" and a == "applied":
                    bound = min(bound, huge_size(m.key) // 4)
            results = [run_mode(place, p, mode, bound, self.roots) for mode in case.modes]
        return Outcome(case, applied, results, time.perf_counter() - start)
