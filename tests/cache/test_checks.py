"""Checksum work on helper threads (deepspec/cache/read/checks.py) and the reader's run-at-a-time crc32c
checks: any corrupt byte of a chunk a read touches is named by its chunk, in every mode."""
import gc
import os
import platform
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from crc32c import crc32c

import deepspec.cache.read.checks as checks
import deepspec.cache.read.shards as shard_reader_mod
from deepspec.cache.read.checks import Checker, ChecksumError, crc32c_concat, first_bad
from deepspec.cache.read.reader import CacheReader
from tests.cache.old_layout import to_trailer_layout
from tests.loader.test_loader import H, synthetic_parts, write_store


@pytest.mark.parametrize("size", [1, 7, 4096, 16 * H * 2])
@pytest.mark.parametrize("count", [1, 2, 5])
def test_crc32c_concat_is_the_crc32c_of_the_buffers_end_to_end(size, count):
    bufs = [os.urandom(size) for _ in range(count)]
    assert crc32c_concat([crc32c(b) for b in bufs], size) == crc32c(b"".join(bufs))


def test_a_batch_raises_the_earliest_failure_in_submission_order():
    checker = Checker(2)
    batch = checker.batch()

    def fail(msg, delay):
        time.sleep(delay)
        raise ValueError(msg)

    batch.submit(lambda: None)
    batch.submit(fail, "first", 0.2)  # fails last in time
    batch.submit(fail, "second", 0.0)
    with pytest.raises(ValueError, match="first"):
        batch.wait()
    batch.wait()  # a batch waited for is empty again


def test_the_waiting_thread_checks_what_no_helper_has_started():
    checker = Checker(1)
    started, release = threading.Event(), threading.Event()
    busy = checker.batch()
    busy.submit(lambda: (started.set(), release.wait(30)))
    assert started.wait(30)  # the only helper is now held
    ran = []
    batch = checker.batch()
    for _ in range(3):
        batch.submit(lambda: ran.append(threading.get_ident()))
    batch.wait()  # returns although the helper never got to these
    assert ran == [threading.get_ident()] * 3
    release.set()
    busy.wait()


def test_helper_threads_end_with_their_checker():
    before = {t for t in threading.enumerate() if t.name == "crc32c"}
    checker = Checker(2)
    threads = [t for t in threading.enumerate() if t.name == "crc32c" and t not in before]
    assert len(threads) == 2
    del checker
    gc.collect()
    for t in threads:
        t.join(10)
        assert not t.is_alive()


def chunked(sizes: list[int], chunk: int, n: int):
    """n chunks of random bytes cut into buffers of `sizes` (the last takes the rest), and the
    little-endian crc32c of each chunk."""
    data = os.urandom(n * chunk)
    stored = np.array([crc32c(data[j * chunk:(j + 1) * chunk]) for j in range(n)], "<u4")
    bufs, at = [], 0
    for size in sizes:
        bufs.append(bytearray(data[at:at + size]))
        at += size
    bufs.append(bytearray(data[at:]))
    return bufs, stored


@pytest.mark.parametrize("bad", [[], [0], [3], [1, 2], [4]])
def test_a_batch_names_the_first_bad_chunk_of_buffers_that_cross_chunk_edges(bad):
    chunk, n = 1000, 5
    bufs, stored = chunked([1, 1499, 0, 2000], chunk, n)  # edges inside buffers, an empty buffer
    for j in bad:
        stored[j] ^= 1 << j
    batch = checks.checker(1).batch()
    batch.check(memoryview(stored.tobytes()), chunk, [memoryview(b) for b in bufs], "hidden/9", 20)
    clean, stored_clean = chunked([300], chunk, 2)
    batch.check(stored_clean.tobytes(), chunk, clean, "hidden/3", 0)
    if bad:
        with pytest.raises(ChecksumError, match=rf"^hidden/9: chunk {20 + bad[0]} checksum mismatch"):
            batch.wait()
    else:
        batch.wait()
    assert first_bad(stored.tobytes(), chunk, bufs) == (bad[0] if bad else -1)  # the inline check agrees


BODY = 16 * H * 2  # a chunk's rows: chunk_tokens 16, bf16


@pytest.fixture(scope="module", params=["v4", "trailers"])
def store(request, tmp_path_factory):
    """The same store in v4's layout (crc32cs in a table after the chunks) and in the one before
    (each chunk followed by its crc32c): damage is placed by the layout's own arithmetic."""
    parts = synthetic_parts(parts=1, samples=8)
    url = write_store(str(tmp_path_factory.mktemp("checks") / "c.zarr"), parts)
    if request.param == "trailers":
        assert to_trailer_layout(url)
    shard = Path(url) / "parts" / "p000000" / "hidden" / "7" / "c" / "0" / "0"
    return url, shard, shard.read_bytes(), request.param


def chunk_at(layout: str, raw: bytes, chunk: int) -> int:
    return chunk * (BODY + (4 if layout == "trailers" else 0))


def stored_crc_at(layout: str, raw: bytes, chunk: int) -> int:
    if layout == "trailers":
        return chunk_at(layout, raw, chunk) + BODY
    n = (len(raw) - 8) // (BODY + 20)  # chunks, a table entry and an index entry each, two crc32cs
    return n * BODY + 4 * chunk


# (bytes to flip, the chunk named) for a read of rows 20..70: chunks 1..4, with rows 16..19 of
# chunk 1 and rows 70..79 of chunk 4 outside the range (read to scratch, or only checked)
DAMAGE = {
    "a row before the range in the first chunk": (lambda k, r: [chunk_at(k, r, 1) + 1 * H * 2 + 3], 1),
    "inside a middle chunk": (lambda k, r: [chunk_at(k, r, 2) + 100], 2),
    "a stored checksum": (lambda k, r: [stored_crc_at(k, r, 3) + 1], 3),
    "a row after the range in the last chunk": (lambda k, r: [chunk_at(k, r, 4) + 11 * H * 2 + 5], 4),
    "two chunks (the first in read order is named)": (lambda k, r: [chunk_at(k, r, 4) + 9, chunk_at(k, r, 2) + 9], 2),
}


@pytest.mark.parametrize("native", [True, False], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("threads,run_chunks", [(0, None), (1, 1), (2, 2), (1, 3), (1, None)])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_corrupt_byte_a_read_touches_is_named_by_its_chunk(store, monkeypatch, damage, threads, run_chunks,
                                                                  native):
    url, shard, clean, layout = store
    if native and not checks.NATIVE_COPY:
        pytest.skip("the copy-and-checksum kernel is not built here (test_the_kernel_is_built_on_x86_64)")
    # v4's local reads copy and checksum in one pass (the kernel) or two (the copy, then crc32c)
    monkeypatch.setattr(shard_reader_mod, "NATIVE_COPY", native)
    if run_chunks:  # runs of one or two chunks, each checked by whichever thread takes it
        monkeypatch.setattr(shard_reader_mod, "CHECK_BYTES", run_chunks * (BODY + (4 if layout == "trailers" else 0)))
    else:  # the default: one run for the whole read (not worth a thread at this size)
        monkeypatch.setattr(shard_reader_mod, "CHECK_BYTES", 64 << 20)
    reader = CacheReader(url)
    reader.set_check_threads(threads)
    want, first = reader.read_array(0, "hidden/7", 20, 70), reader.read_array(0, "hidden/7", 0, 16)
    where, chunk = DAMAGE[damage]
    data = bytearray(clean)
    for p in where(layout, clean):
        data[p] ^= 0x04
    try:
        shard.write_bytes(bytes(data))
        reader = CacheReader(url)
        reader.set_check_threads(threads)
        table = damage == "a stored checksum" and layout == "v4"  # the table's own crc32c names it first
        named = "chunk crc32c table checksum mismatch" if table else f"chunk {chunk} checksum mismatch"
        with pytest.raises(ChecksumError, match=rf"p000000/hidden/7/c/0/0: {named}"):
            with reader.checked():
                reader.read_array(0, "hidden/7", 20, 70)
                reader.read_array(0, "hidden/3", 20, 70)  # a clean array read after it, same block
        if threads and run_chunks and not table:  # the checks ran on the helpers asked for
            assert isinstance(reader._process_state()[3]._checker, checks.Checker)
        if not table:  # chunk 0 is intact and reads (a corrupt table leaves no chunk checkable)
            assert np.array_equal(reader.read_array(0, "hidden/7", 0, 16), first)
    finally:
        shard.write_bytes(clean)
    assert np.array_equal(CacheReader(url).read_array(0, "hidden/7", 20, 70), want)


def test_the_kernel_is_built_on_x86_64():
    """make setup compiles it (pyproject's optional ext-module): on x86-64 a missing kernel is a broken
    build, not a slower machine."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the kernel is x86-64 only")
    assert checks.NATIVE_COPY


@pytest.mark.skipif(not checks.NATIVE_COPY, reason="the copy-and-checksum kernel is not built here")
def test_the_kernel_copies_and_returns_the_crc32c_continued():
    from deepspec.cache.read._copycrc import copy_crc32c

    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 31, 32, 33, 4099):
        src = rng.integers(0, 256, n, dtype=np.uint8)
        for crc in (0, 0xDEADBEEF):
            dst = np.zeros(n, np.uint8)
            assert copy_crc32c(dst, src, crc) == crc32c(src.tobytes(), crc) and np.array_equal(dst, src)
    src = rng.integers(0, 256, 6 * 40, dtype=np.uint8)
    rows = np.zeros((6, 3, 40), np.uint8)  # rows of 40 bytes, 120 apart: only the middle third is written
    assert copy_crc32c(rows[:, 1], src, 5) == crc32c(src.tobytes(), 5)
    assert np.array_equal(rows[:, 1].reshape(-1), src) and not rows[:, [0, 2]].any()
    for bad in (np.zeros(len(src) - 1, np.uint8), rows[:, :, :20], np.zeros(len(src), np.uint8)[::2]):
        with pytest.raises((ValueError, BufferError)):
            copy_crc32c(bad, src, 0)
    with pytest.raises((ValueError, TypeError, BufferError)):
        copy_crc32c(src.tobytes(), src, 0)  # a read-only destination
