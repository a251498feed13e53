"""A store from anyone is safe to open (docs/cache-format.md §13, DESIGN.md §12), proved by a property-based
fuzzer rather than a list of cases: tests/cache/fuzz/ copies a small real store (Zarr and HDF5,
locally and on S3), mutates it as a hostile or broken writer would (fields, bytes, sizes, links,
devices, FIFOs, directories, duplicated and missing names) and reads every sample. Whatever the
bytes, reading gives the store's original samples or raises CacheFormatError naming the store,
opens nothing outside it, allocates far less than any size a field declares, and never hangs.

CI runs a fixed, seeded set (`CASES`, derandomized) and reports every case that breaks the property,
grouped by class and by where it was raised; benchmarks/fuzz_stores.py runs thousands. The harness
checks its own detectors first (the recorder sees what a reader opens, a FIFO is cut short, every
mutation kind applies)."""
from __future__ import annotations

import os
import shutil
import time
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.cache import fuzz as F
from tests.cache.fuzz import check

# ~0.08 s a case locally (Zarr; HDF5 ~0.03 s), ~0.4 s on moto, on two loaded cores: about a minute in all;
# at least 300 (benchmarks/fuzz_stores.py runs ten thousand)
CASES = {"zarr-local": 110, "hdf5-local": 130, "zarr-s3": 35, "hdf5-s3": 35}
assert sum(CASES.values()) >= 300


class Lab:
    """One harness and the pristine stores of each backend, built on first use, for the module."""

    def __init__(self):
        self.work = F.scratch("fuzz-")
        self.harness = F.Harness(self.work)
        self.stores: dict[str, list[F.Pristine]] = {}

    def stores_of(self, backend: str, request) -> list[F.Pristine]:
        if backend not in self.stores:
            if backend.endswith("-s3"):
                moto = request.getfixturevalue("moto")
                if self.harness.client is None:
                    self.harness.client = moto.client()
                    self.harness.bucket = moto.bucket(f"fuzz-{uuid.uuid4().hex[:12]}")
                self.stores[backend] = [F.build_pristine(backend, v, f"s3://{self.harness.bucket}/pristine-{backend}-{v}",
                                                         moto.storage_options) for v in F.VARIANTS]
            else:
                self.stores[backend] = [F.build_pristine(backend, v, os.path.join(self.work, f"{backend}-{v}", "store"),
                                                         None) for v in F.VARIANTS]
        return self.stores[backend]

    def close(self) -> None:
        self.harness.close()
        shutil.rmtree(self.work, ignore_errors=True)


@pytest.fixture(scope="module")
def lab():
    lab = Lab()
    yield lab
    lab.close()


# ---- the harness's own detectors ----------------------------------------------------------------------

def test_the_recorder_sees_what_a_reader_opens_and_flags_what_lies_outside(lab, request, tmp_path):
    p = lab.stores_of("zarr-local", request)[0]
    with lab.harness.place(p) as place:
        F.install_recorders()
        F.RECORDER.opened.clear()
        F.RECORDER.active = True
        try:
            assert F.read_mode(place, p, "fast") is None
            stray = tmp_path / "stray.h5"
            import h5py

            with h5py.File(stray, "w"):
                pass
            open(tmp_path / "stray.txt", "w").close()
        finally:
            F.RECORDER.active = False
        real = os.path.realpath(place.url)
        inside = [path for _, path in F.RECORDER.opened if path.startswith(real + "/")]
        assert any(path.endswith("zarr.json") for path in inside), F.RECORDER.opened   # zarr's I/O threads
        assert any("/c/" in path for path in inside), F.RECORDER.opened                # the fast path's shards
        bad = F.outside(F.RECORDER.opened, place.url, lab.harness.roots)
    assert bad == sorted([f"h5py.File {os.path.realpath(stray)}", f"open {os.path.realpath(tmp_path / 'stray.txt')}"])


def test_a_mode_blocked_on_a_fifo_is_stopped_and_reported_as_a_hang(lab, request, monkeypatch):
    p = lab.stores_of("zarr-local", request)[0]
    monkeypatch.setattr(check, "TIMEOUT_LOCAL_S", 0.5)  # where run_mode looks them up

    def blocked(place, pristine, mode):
        os.close(os.open(place.fifos[0], os.O_RDONLY))  # blocks: no writer

    monkeypatch.setattr(check, "read_mode", blocked)
    with lab.harness.place(p) as place:
        F.apply(place, p, F.Mutation("fifo", "zarr.json"))
        start = time.monotonic()
        result = F.run_mode(place, p, "fast", F.MEMORY_BOUND, lab.harness.roots)
    assert time.monotonic() - start < 5
    assert result.error == "CaseTimeout" and any(f.startswith("hang") for f in result.failures), result


def test_other_samples_are_told_apart_by_dtype_shape_and_bytes(lab, request):
    sample = lab.stores_of("zarr-local", request)[0].samples[0]
    assert F.differs(sample, sample) is None
    flipped = dict(sample, input_ids=sample["input_ids"] ^ 1)
    widened = dict(sample, loss_mask=sample["loss_mask"].astype(np.int16))
    assert F.differs(sample, flipped) and F.differs(sample, widened)


@pytest.mark.parametrize("backend", F.BACKENDS)
def test_every_mutation_kind_applies_to_a_fresh_copy(lab, request, backend):
    pristines = lab.stores_of(backend, request)

    @settings(max_examples=1, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def each_kind(data):
        for p in pristines:
            for kind in F.kinds_for(p):
                m = data.draw(F.mutation_of(p, kind), label=kind)
                with lab.harness.place(p) as place:
                    assert F.apply(place, p, m) == "applied", (p, str(m))

    each_kind()


# ---- the property ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", F.BACKENDS)
def test_a_store_from_anyone_reads_as_written_or_is_refused_naming_it(lab, request, backend):
    pristines = lab.stores_of(backend, request)
    outcomes: list[F.Outcome] = []

    # derandomized: the same cases on every run; no shrinking: every case counts, failures are collected
    @settings(max_examples=CASES[backend], derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=F.cases(pristines))
    def one(case):
        outcomes.append(lab.harness.run(case))

    start = time.perf_counter()
    one()
    seconds = time.perf_counter() - start
    failed = [o for o in outcomes if o.failures]
    print(f"{backend}: {len(outcomes)} cases in {seconds:.1f} s, {len(failed)} breaking the property; largest "
          f"tracemalloc peak {max(r.peak for o in outcomes for r in o.results) / 2**20:.1f} MiB")
    if failed:
        pytest.fail(f"{len(failed)} of {len(outcomes)} cases break the property on {backend}:\n"
                    + F.format_groups(F.failure_groups(failed), examples=1), pytrace=False)
