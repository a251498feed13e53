"""The cache writer in a process of its own (deepspec.cache.write.process_writer): the files of a
CacheWriter, its failures raised in the computing process, and either process killed without losing
a committed part or keeping an uncommitted one."""
import inspect
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from deepspec.cache.backends.readers import open_cache
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.spec.format import CacheFormatError, hidden_name
from deepspec.cache.write.lease import LEASE_NAME, LeaseError
from deepspec.cache.write.part_data import PartData
from deepspec.cache.write.process_writer import ProcessWriter
from deepspec.cache.write.writer import CacheWriter
from tests.cache.test_conformance import H, LAYERS, expect_equal, files, make_part, manifest, where, write  # noqa: F401
from tests.conftest import REPO


def header(part: PartData, batches=None) -> PartData:
    return PartData(part.name, part.sample_ids, part.lengths, part.input_ids, part.loss_mask, batches=batches)


def cut(part: PartData, cuts: list[int]):
    """The part's states in batches of rows cut at `cuts` (not on chunk boundaries)."""
    edges = [0, *cuts, part.tokens]
    for a, b in zip(edges, edges[1:]):
        yield {k: (bits[a:b], None if scale is None else scale[a:b]) for k, (bits, scale) in part.hidden.items()}


def wait_committed(w, name: str) -> None:
    deadline = time.time() + 60
    while name not in w.committed_parts():
        assert time.time() < deadline, f"{name} was never committed"
        time.sleep(0.02)


def test_a_writer_process_offers_the_writers_methods_with_their_signatures():
    """The cache stage takes either (part_data.PartWriter): each method of the interface, and the
    writer's other public ones, are called the same way on both."""
    shared = {n for n in dir(CacheWriter) if not n.startswith("_") and callable(getattr(CacheWriter, n))} & \
        {n for n in dir(ProcessWriter) if not n.startswith("_")}
    assert {"submit", "close", "abort", "release", "committed_parts", "write_manifest"} <= shared
    for name in shared:
        assert inspect.signature(getattr(ProcessWriter, name)) == inspect.signature(getattr(CacheWriter, name)), name


@pytest.mark.parametrize("dtype,codec", [("bfloat16", "none"), ("fp8", "blosc-zstd")])
def test_a_writer_process_writes_the_files_of_a_writer_thread(where, dtype, codec):
    """Streamed parts (batches cut inside chunks, on several threads) and a part handed over whole;
    commits reported as they happen."""
    kind, url, options = where
    if url.startswith("s3://") and dtype != "fp8":
        pytest.skip("the values do not depend on the location: one combination on S3")
    parts = [make_part("p000000", 1, dtype, samples=5), make_part("p000001", 2, dtype, samples=1),
             make_part("p000002", 3, dtype, samples=2)]
    write((kind, url + "-thread", options), parts, dtype=dtype, codec=codec)
    seen = []
    with ProcessWriter(url, manifest(kind, dtype=dtype, codec=codec), options, threads=3) as w:
        w.on_commit = seen.append
        w.submit(header(parts[0], cut(parts[0], [1, 2, 9, parts[0].tokens - 3])))
        w.submit(header(parts[1], cut(parts[1], [])))
        w.submit(parts[2])
    assert seen == ["p000000", "p000001", "p000002"]
    assert files(url, options) == files(url + "-thread", options)
    expect_equal(CacheReader(url, options), parts)


def test_a_batch_larger_than_every_buffer_so_far_gets_a_larger_one(tmp_path):
    """Buffers are reused batch after batch and grow with them: at most depth + 1 exist, so a larger
    batch takes the place of a smaller free buffer; the files are still a writer thread's."""
    rng = np.random.default_rng(5)
    lengths = np.array([6000, 6000], np.int64)  # 12,000 rows of 3 arrays: more than the first 1 MiB buffers
    long = PartData("p000001", np.array([7, 8], np.uint64), lengths, rng.integers(0, 4096, 12000).astype(np.int32),
                    np.ones(12000, np.uint8), {k: (rng.integers(0, 1 << 16, (12000, H), dtype=np.uint16), None)
                                               for k in [*LAYERS, "last"]})
    parts = [make_part("p000000", 1, samples=5), long, make_part("p000002", 3, samples=5)]
    man = manifest("zarr", max_length=8192)
    with CacheWriter(str(tmp_path / "thread"), man) as w:
        for p in parts:
            w.submit(p)
    with ProcessWriter(str(tmp_path / "process"), man, depth=1) as w:
        for p in parts:
            w.submit(header(p, cut(p, [4, 9])))
    assert files(str(tmp_path / "process"), None) == files(str(tmp_path / "thread"), None)


def test_a_failure_in_the_writer_process_is_raised_naming_the_array_and_the_store_resumes(where):
    """Rows of the wrong width: the computing process gets the writer's own error, the part is not
    committed, the one before it is, and a rerun ends byte-identical to an uninterrupted build."""
    kind, url, options = where
    parts = [make_part(f"p{i:06d}", i + 1, samples=4) for i in range(2)]
    write((kind, url + "-clean", options), parts)
    w = ProcessWriter(url, manifest(kind), options, threads=3)
    w.submit(header(parts[0], cut(parts[0], [5])))
    bad = list(cut(parts[1], [6]))
    bad[0][LAYERS[-1]] = (np.zeros((6, H + 1), np.uint16), None)
    with pytest.raises(CacheFormatError, match=rf"{hidden_name(LAYERS[-1])}: rows of shape \({H + 1},\)"):
        w.submit(header(parts[1], iter(bad)))
        w.submit(make_part("p000009", 9))
        w.close()
    w.abort()
    w.release()
    with CacheWriter(url, manifest(kind), options) as again:
        assert sorted(again.committed_parts()) == ["p000000"]
        again.submit(parts[1])
    assert files(url, options) == files(url + "-clean", options)


class FailedCopies:
    """A batch whose device-to-host copies fail when waited for (a CUDA fault surfaces there)."""

    def result(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("at", ["middle", "last"])
def test_a_batch_whose_copies_fail_fails_the_writer_at_once_and_drops_its_part(tmp_path, at):
    """As a CacheWriter: the failure is raised at the next hand-over or at close, naming its cause;
    the part is not committed, nothing is consolidated, and abort and release return at once."""
    url = str(tmp_path / "store")
    parts = [make_part(f"p{i:06d}", i + 1, samples=4) for i in range(2)]
    w = ProcessWriter(url, manifest("zarr"))
    w.submit(header(parts[0], cut(parts[0], [5])))
    wait_committed(w, "p000000")

    def batches():
        it = cut(parts[1], [4, 8])
        yield next(it)
        if at == "middle":
            yield FailedCopies()
            time.sleep(0.5)  # the sending thread meets it while the part goes on
            yield from it
        else:
            yield from it
            yield FailedCopies()

    t = time.time()
    with pytest.raises(CacheFormatError, match="writing a part failed: CUDA error: an illegal memory access"):
        w.submit(header(parts[1], batches()))
        w.close()
    w.abort()
    w.release()
    assert time.time() - t < 5
    assert sorted(open_cache(url).committed_parts()) == ["p000000"]
    assert CacheReader(url).manifest.parts == []  # never consolidated


def test_on_commit_may_ask_the_writer_and_a_failing_one_fails_the_close(tmp_path):
    """on_commit runs on a thread of the writer's, as on a CacheWriter's commit thread: it may call
    the writer, close returns once it has run for every part, and one that raises fails the close
    (no consolidation)."""
    parts = [make_part(f"p{i:06d}", i + 1) for i in range(2)]
    seen = []
    with ProcessWriter(str(tmp_path / "asks"), manifest("zarr")) as w:
        w.on_commit = lambda name: seen.append((name, sorted(w.committed_parts())))
        for p in parts:
            w.submit(header(p, cut(p, [4])))
        w.close()
        assert [name for name, _ in seen] == ["p000000", "p000001"] and all(name in have for name, have in seen)

    def refuse(name):
        raise RuntimeError(f"the trainer refused {name}")

    url = str(tmp_path / "refuses")
    w = ProcessWriter(url, manifest("zarr"))
    w.on_commit = refuse
    w.submit(header(parts[0], cut(parts[0], [4])))
    with pytest.raises(CacheFormatError, match="writing a part failed: the trainer refused p000000"):
        w.close()
    w.abort()
    w.release()
    assert CacheReader(url).manifest.parts == []


def test_a_store_another_writer_holds_is_refused_with_the_writers_own_error(tmp_path):
    url = str(tmp_path / "store")
    with CacheWriter(url, manifest("zarr")):
        with pytest.raises(LeaseError, match="another job is writing this cache"):
            ProcessWriter(url, manifest("zarr"))


class Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_the_writer_process_logs_through_the_computing_process_loggers(tmp_path):
    """A warning of the child's CacheWriter (a stale store pruned) reaches the handler and level this
    process set on that logger, names the writer process, and keeps its arguments formatted."""
    url = str(tmp_path / "store")
    write(("zarr", url, None), [make_part("p000000", 1)])
    logger = logging.getLogger("deepspec.cache.write.writer")
    kept, old_level = Kept(), logger.level
    logger.addHandler(kept)
    try:
        for level, expect in ((logging.ERROR, 0), (logging.WARNING, 1)):
            logger.setLevel(level)
            w = ProcessWriter(url, manifest("zarr", codec="blosc-lz4" if expect else "blosc-zstd"))
            w.close()
            w.release()
            stale = [r for r in kept.records if "existing cache is stale" in r.getMessage()]
            assert len(stale) == expect
    finally:
        logger.removeHandler(kept)
        logger.setLevel(old_level)
    assert stale[0].levelno == logging.WARNING and stale[0].process == w.pid
    assert stale[0].getMessage().startswith(f"{url}: existing cache is stale (codec")


def test_a_killed_writer_process_fails_the_computation_and_its_store_resumes(tmp_path):
    """kill -9 of the writer process in the middle of a part: the next batch handed over raises,
    naming the process and the signal; the store keeps the parts committed before, and the next
    writer takes the dead process's lease over and drops the unfinished part."""
    url = str(tmp_path / "store")
    parts = [make_part(f"p{i:06d}", i + 1, samples=4) for i in range(3)]
    write(("zarr", str(tmp_path / "clean"), None), parts)
    w = ProcessWriter(url, manifest("zarr"))
    w.submit(header(parts[0], cut(parts[0], [5])))
    wait_committed(w, "p000000")

    def batches():
        it = cut(parts[1], [3, 6, 9])
        yield next(it)
        os.kill(w.pid, signal.SIGKILL)
        yield from it
        while True:  # the computation goes on until the writer's death reaches it
            time.sleep(0.05)
            yield next(cut(parts[1], []))

    with pytest.raises(CacheFormatError, match=rf"cache writer process \(pid {w.pid}\) exited with signal 9"):
        w.submit(header(parts[1], batches()))
    t = time.time()
    w.abort()
    w.release()
    assert time.time() - t < 5
    with CacheWriter(url, manifest("zarr")) as again:
        assert sorted(again.committed_parts()) == ["p000000"]
        for p in parts[1:]:
            again.submit(p)
    assert files(url, None) == files(str(tmp_path / "clean"), None)


def test_host_copies_are_waited_for_off_the_computing_thread(tmp_path):
    """As with a writer thread: a batch is handed over while its device-to-host copies may still be in
    flight (devices.HostBatch), and the writer's sending thread waits for them, not the computing one."""
    url = str(tmp_path / "store")
    part = make_part("p000000", 1)
    waited_on = []

    class InFlight:
        def __init__(self, batch):
            self.batch = batch

        def result(self):
            waited_on.append(threading.get_ident())
            return self.batch

    with ProcessWriter(url, manifest("zarr")) as w:
        w.submit(header(part, (InFlight(b) for b in cut(part, [4]))))
    assert len(waited_on) == 2 and threading.get_ident() not in waited_on
    expect_equal(CacheReader(url), [part])


COMPUTING = """
import os, sys, time
from tests.cache.test_conformance import make_part, manifest
from tests.cache.test_process_writer import cut, header, wait_committed
from deepspec.cache.write.process_writer import ProcessWriter

parts = [make_part(f"p{i:06d}", i + 1, samples=4) for i in range(2)]
w = ProcessWriter(sys.argv[1], manifest("zarr"))
w.submit(header(parts[0], cut(parts[0], [5])))
wait_committed(w, "p000000")
worker = os.fork()  # a process forked while the writer runs (a DataLoader worker) outlives the kill
if worker == 0:
    time.sleep(60)
    os._exit(0)

def batches():
    it = cut(parts[1], [3])
    yield next(it)
    print(w.pid, worker, flush=True)
    time.sleep(600)  # killed here, in the middle of the part
    yield from it

w.submit(header(parts[1], batches()))
"""


def test_the_writer_process_of_a_killed_computation_stops_releases_the_lease_and_keeps_no_unfinished_part(tmp_path):
    url = str(tmp_path / "store")
    proc = subprocess.Popen([sys.executable, "-c", COMPUTING, url], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        child, worker = map(int, proc.stdout.readline().split())
        time.sleep(0.3)  # the first batch reaches the writer
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 30
        while Path(f"/proc/{child}").exists() and "zombie" not in Path(f"/proc/{child}/status").read_text():
            assert time.time() < deadline, "the writer process outlived its computation"
            time.sleep(0.05)
        assert Path(f"/proc/{worker}").exists()  # the writer did not wait for the forked process
    finally:
        proc.kill()
        os.kill(worker, signal.SIGKILL)
    assert not (Path(url) / LEASE_NAME).exists()  # released, not left for the next writer to take over
    assert sorted(open_cache(url).committed_parts()) == ["p000000"]  # the unfinished one is left uncommitted
    with CacheWriter(url, manifest("zarr")) as again:
        assert sorted(again.committed_parts()) == ["p000000"]
