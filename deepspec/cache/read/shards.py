"""The fast read path: row ranges of one array of one part read straight from its shard file (Zarr)
or part file (HDF5), checked and decoded without zarr-python; CacheReader (reader.py) hands it the
arrays whose layout it recognises and reads the others through the store's library.

zarr-python's array API pays Python overhead per inner chunk; reading one sample through it is
several times slower than reading the same bytes from a flat file. The fast path stays inside the
Zarr v3 format: it caches each shard's index (and v4's crc32c table), reads a sample's contiguous
chunk range with one copy out of the file's map (v4, uncompressed: the rows lie back to back),
one `os.preadv` (older local shards, whose chunks each end with a crc32c) or one range request
(fsspec), checks every chunk's crc32c and decodes with the array's own codec chain.

A crc32c costs about as much CPU as the copy it checks, so done in the reading thread it would
nearly halve a local read's speed (benchmarks/loader.py --checks). With `check_threads` the checks
of uncompressed local arrays run on helper threads (deepspec/cache/read/checks.py; crc32c releases
the GIL): an array is copied in runs and each run's check overlaps the copy of the next; inside
`ShardReader.deferred()` the checks of one array overlap the copies of the next array too. The
block's exit checks what is left on its own thread as well, waits for the rest and raises the
first mismatch, so nothing unchecked leaves a
`CacheReader.read` or a dataset item.
"""
from __future__ import annotations

import contextlib

import numpy as np

from deepspec.cache.backends.base import ArrayLayout, fletcher32_matches
from deepspec.cache.storage.bounded import BoundedCache
from deepspec.cache.read.checks import NATIVE_COPY, Batch, ChecksumError, checker, copy_checked, first_bad, mismatch
from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.read.ranges import ByteRanges, preadv_all
from deepspec.cache.backends.zarr.layout import EMPTY, split_suffix

from crc32c import crc32c as _crc32c


# Bytes of chunks one checksum task checks: big enough that a task's overhead (a queue put and two
# GIL hand-overs) is small next to its crc32c (~0.1 ms), small enough that the last array of a
# sample splits between a helper and the waiting thread.
CHECK_BYTES = 2 << 20


def row_bytes_view(out: np.ndarray) -> np.ndarray | None:
    """`out` as uint8 [rows, bytes a row], sharing its memory, when each of its rows is contiguous
    (a C-contiguous array, or a 2-D one whose rows lie apart, as a layer's rows in a collated batch);
    None otherwise."""
    if out.ndim == 0 or len(out) == 0:
        return None
    if out.flags.c_contiguous:
        return out.reshape(-1).view(np.uint8).reshape(len(out), -1)
    if out.ndim == 2 and out.strides[1] == out.itemsize and out.strides[0] > 0:
        return out.view(np.uint8)
    return None


# what a stored chunk may add to its rows' bytes: Blosc's header and its worst-case expansion
BLOSC_OVERHEAD = 64


def check_index(layout: ArrayLayout, idx: np.ndarray, size: int | None, where: str) -> None:
    """Every written chunk of a shard's index (or an HDF5 chunk table) is sized as its layout allows
    (uncompressed: exactly its rows and trailer; Blosc: at most that plus the header), lies inside
    the file (`size`, where known; else below 2**62) and shares no byte with another chunk: a hostile
    entry must not size a read (an nbytes of 2**64 - 1 is no allocation, no pread and no billion
    range requests), nor point at another chunk's bytes (whose own checksum holds)."""
    if idx.shape != (layout.n_chunks, 2):
        raise CacheFormatError(f"{where}: an index of {idx.shape[0]} entries for {layout.n_chunks} chunks")
    written = idx[:, 0] != EMPTY
    off, n = idx[written, 0], idx[written, 1]
    full = layout.chunk_rows * layout.row_bytes + layout.trailer
    wrong = ((n > full + BLOSC_OVERHEAD) if layout.blosc else (n != full)) | (off >= 2**62)
    if size is not None:
        wrong |= (off + n) > size  # a sum that wraps has an n or an offset that is wrong already
    order = np.argsort(off, kind="stable")  # chunks never share bytes: one pointing into another's reads its bytes
    overlap = np.flatnonzero(off[order][1:] < off[order][:-1] + n[order][:-1])
    if len(overlap):
        wrong[order[overlap[0] + 1]] = True
    if wrong.any():
        c = int(np.flatnonzero(written)[np.argmax(wrong)])
        raise CacheFormatError(f"{where}: chunk {c} declares {int(idx[c, 1])} bytes at {int(idx[c, 0])}; a chunk is "
                               f"{full} bytes{' or fewer' if layout.blosc else ''}"
                               f"{'' if size is None else f' in a file of {size}'}")


class ShardReader:
    """Row ranges of single-shard arrays, read and checked without zarr-python on the hot path."""

    def __init__(self, files: ByteRanges, verify: bool = True, strict: bool = False, check_threads: int = 0):
        self.files = files
        self.verify = verify
        self.check_threads = check_threads
        self._checker = None    # created on first use, in the process that reads
        self._pending = None    # the checks.Batch of an open deferred() block
        # strict (`deepspec cache verify`): an HDF5 chunk's own Fletcher-32 is checked as well as
        # the crc32c recorded for it in the chunk table
        self.strict = strict
        # per array: (chunk index [n_chunks, 2], dense: every chunk present and stored back to back, in
        # order, crc32c per chunk from a table (Zarr v4, HDF5) or None (in each chunk's trailer));
        # bounded, least recently used out (bounded.py): a process reads a whole store per epoch
        self.tables = BoundedCache(self.TABLE_BYTES)

    # chunk indexes kept per process (a reference-size part's array: ~256 KB). A sampler that draws from
    # thousands of parts misses whatever the bound; a larger one only helps reads that stay in a part
    TABLE_BYTES = 16 << 20

    def index(self, layout: ArrayLayout) -> np.ndarray:
        return self._table(layout)[0]

    def _table(self, layout: ArrayLayout) -> tuple[np.ndarray, bool, np.ndarray | None]:
        got = self.tables.get(layout.key if layout.table is None else layout.name)
        if got is not None:
            return got
        if layout.table is not None:  # recorded when the part committed (HDF5)
            idx = layout.table
            check_index(layout, idx, None, f"{self.files.url}: {layout.name or layout.key}")
            if layout.crcs is not None and layout.crcs.shape != (layout.n_chunks,):
                raise CacheFormatError(f"{self.files.url}: {layout.name}: crc32cs of shape {list(layout.crcs.shape)} "
                                       f"for {layout.n_chunks} chunks")
            row = layout.chunk_rows * layout.row_bytes + 4
            got = (idx, bool(len(idx) and (idx[1:, 0] == idx[:-1, 0] + idx[:-1, 1]).all() and (idx[:, 1] == row).all()),
                   layout.crcs)
            self.tables[layout.name] = got
            return got
        nbytes = layout.suffix_bytes
        size = self.files.size(layout.key)
        if size < nbytes:
            raise CacheFormatError(f"{layout.name or layout.key}: {size} bytes cannot hold the index of its "
                                   f"{layout.n_chunks} chunks")
        return self._keep_index(layout, self.files.read(layout.key, size - nbytes, size), size - nbytes)

    def _keep_index(self, layout: ArrayLayout, raw: bytes, size: int | None = None) -> tuple[np.ndarray, bool,
                                                                                           np.ndarray | None]:
        """A Zarr shard's index and, in v4, its crc32c table (the last layout.suffix_bytes bytes of
        its file, whose chunks lie in its first `size` bytes), checked and kept."""
        try:
            idx, crcs = split_suffix(layout, raw)
        except ValueError as e:
            raise ChecksumError(f"{layout.key}: {e}") from None
        check_index(layout, idx, size, f"{self.files.url}: {layout.key}")
        dense = bool((idx[:, 0] != EMPTY).all() and idx[0, 0] == 0 and (idx[1:, 0] == idx[:-1, 0] + idx[:-1, 1]).all())
        if layout.crc_table:  # v4, uncompressed: rows back to back, every chunk full size
            dense = dense and bool((idx[:, 1] == layout.chunk_rows * layout.row_bytes).all())
        got = (idx, dense, crcs)
        self.tables[layout.key] = got
        return got

    def prefetch_indexes(self, layouts: list[ArrayLayout], in_flight: int) -> None:
        """Zarr shard indexes not read yet, fetched together: one suffix-range request each (the
        file's size is not needed), up to `in_flight` at a time. Only on an async filesystem; elsewhere
        index() reads each when first used."""
        todo = list({lay.key: lay for lay in layouts if lay.table is None and lay.key not in self.tables}.values())
        if len(todo) < 2 or not self.files.remote or not self.files.async_reads:
            return
        raws = self.files.read_ranges([(lay.key, -lay.suffix_bytes, None) for lay in todo], in_flight)
        for lay, raw in zip(todo, raws):
            self._keep_index(lay, raw)

    def _decode(self, layout: ArrayLayout, payload: memoryview, chunk: int, crcs: np.ndarray | None) -> np.ndarray:
        body = payload[:-4] if layout.trailer else payload
        if self.verify:
            if crcs is not None:  # crc32c from a table: Zarr v4's, or HDF5's chunk table (+ Fletcher-32 when strict)
                ok = _crc32c(body) == int(crcs[chunk])
                ok = ok and (layout.crc_table or not self.strict or fletcher32_matches(body, bytes(payload[-4:])))
            elif layout.checksum == "fletcher32":
                ok = fletcher32_matches(body, bytes(payload[-4:]))
            else:
                ok = _crc32c(body) == int.from_bytes(payload[-4:], "little")
            if not ok:
                raise mismatch(layout.name or layout.key, chunk)
        if layout.blosc:
            from numcodecs import blosc

            body = bytes(body)
            # Blosc's 16-byte header: version, versionlz, flags, typesize, then nbytes, blocksize, cbytes
            # (uint32 LE); decompress() allocates nbytes, so the chunk's size comes from the layout
            declared = int.from_bytes(body[4:8], "little") if len(body) >= 16 else -1
            if declared != layout.chunk_rows * layout.row_bytes or int.from_bytes(body[12:16], "little") != len(body):
                raise CacheFormatError(f"{layout.name or layout.key}: chunk {chunk}: its Blosc header declares "
                                       f"{declared} bytes in {len(body)}; a chunk is {layout.chunk_rows * layout.row_bytes}")
            body = blosc.decompress(body)
        if len(body) != layout.chunk_rows * layout.row_bytes:  # the bytes of another array (a link within the store)
            raise CacheFormatError(f"{layout.name or layout.key}: chunk {chunk} holds {len(body)} bytes; a chunk is "
                                   f"{layout.chunk_rows * layout.row_bytes}")
        return np.frombuffer(body, dtype=layout.dtype)

    def read_rows(self, layout: ArrayLayout, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) into `out` (a new array when None)."""
        row_shape = layout.shape[1:]
        if out is None:
            out = np.empty((stop - start, *row_shape), dtype=layout.dtype.newbyteorder("="))
        if stop <= start:
            return out
        c0, c1 = start // layout.chunk_rows, (stop - 1) // layout.chunk_rows
        idx, dense, crcs = self._table(layout)
        offs, sizes = idx[c0:c1 + 1, 0], idx[c0:c1 + 1, 1]
        local = not layout.blosc and not self.files.remote and layout.dtype.isnative
        if local and layout.crc_table and dense and (rows := row_bytes_view(out)) is not None:
            return self._copy(layout, start, stop, c0, c1, crcs, rows, out)
        if local and out.flags.c_contiguous and not layout.crc_table and not (self.verify and layout.checksum == "fletcher32"
                                                   and (self.strict or layout.crcs is None)):
            gaps = None
            if not dense and layout.table is not None:  # HDF5 puts a few KB of metadata after a chunk or two
                gaps = offs[1:].astype(np.int64) - (offs[:-1] + sizes[:-1]).astype(np.int64)
                full = layout.chunk_rows * layout.row_bytes + 4
                dense = bool((sizes == full).all() and (gaps >= 0).all() and gaps.sum() <= (64 << 10))
            if dense:
                return self._scatter(layout, start, stop, c0, c1, int(idx[c0, 0]), out, gaps)
        spans = self._spans(layout, c0, c1, offs, sizes)
        payloads = [memoryview(self.files.read(layout.key, a, b)) for a, b in spans]
        return self._fill(layout, start, stop, c0, c1, offs, sizes, spans, payloads, out, crcs)

    def read_rows_many(self, requests: list[tuple], in_flight: int, range_bytes: int) -> list[np.ndarray]:
        """read_rows for each (layout, start, stop, out) of `requests`, with their byte ranges (cut to
        at most `range_bytes`) fetched up to `in_flight` at a time (ByteRanges.read_ranges); each array
        is then checked and decoded exactly as read_rows does."""
        self.prefetch_indexes([r[0] for r in requests if r[2] > r[1]], in_flight)
        plans, ranges = [], []
        for layout, start, stop, out in requests:
            if out is None:
                out = np.empty((max(0, stop - start), *layout.shape[1:]), dtype=layout.dtype.newbyteorder("="))
            if stop <= start:
                plans.append((layout, start, stop, out, None))
                continue
            c0, c1 = start // layout.chunk_rows, (stop - 1) // layout.chunk_rows
            idx, _, crcs = self._table(layout)
            offs, sizes = idx[c0:c1 + 1, 0], idx[c0:c1 + 1, 1]
            spans = self._spans(layout, c0, c1, offs, sizes)
            pieces = []  # per span: the indices of its pieces in `ranges`
            for a, b in spans:
                pieces.append(range(len(ranges), len(ranges) + -(-(b - a) // range_bytes)))
                ranges += [(layout.key, x, min(b, x + range_bytes)) for x in range(a, b, range_bytes)]
            plans.append((layout, start, stop, out, (c0, c1, offs, sizes, spans, pieces, crcs)))
        data = self.files.read_ranges(ranges, in_flight)
        result = []
        for layout, start, stop, out, plan in plans:
            if plan is not None:
                c0, c1, offs, sizes, spans, pieces, crcs = plan
                payloads = [memoryview(data[p[0]] if len(p) == 1 else b"".join(data[i] for i in p)) for p in pieces]
                for (a, b), payload in zip(spans, payloads):
                    if len(payload) != b - a:
                        raise CacheFormatError(f"{layout.key}: short read ({len(payload)} of {b - a} bytes at {a})")
                self._fill(layout, start, stop, c0, c1, offs, sizes, spans, payloads, out, crcs)
            result.append(out)
        return result

    @staticmethod
    def _spans(layout: ArrayLayout, c0: int, c1: int, offs: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
        """The byte ranges holding chunks c0..c1: one for the whole run of chunks, also across small
        gaps (HDF5 may place a few KB of metadata between two chunks), since one request beats
        several on an object store; else one per chunk."""
        if (offs == EMPTY).any():
            raise CacheFormatError(f"{layout.name or layout.key}: chunks {c0}..{c1} include an unwritten chunk")
        base, end = int(offs.min()), int((offs + sizes).max())
        if end - base <= int(sizes.sum()) + (64 << 10):
            return [(base, end)]
        return [(int(o), int(o + n)) for o, n in zip(offs, sizes)]

    def _fill(self, layout: ArrayLayout, start: int, stop: int, c0: int, c1: int, offs: np.ndarray,
              sizes: np.ndarray, spans: list, payloads: list, out: np.ndarray, crcs: np.ndarray | None) -> np.ndarray:
        """Check and decode chunks c0..c1, held by the bytes of `spans` (_spans), into rows
        [start, stop) of `out`."""
        row_shape, per_chunk = layout.shape[1:], layout.chunk_rows
        base = spans[0][0]
        for k, c in enumerate(range(c0, c1 + 1)):
            off, size = int(offs[k]), int(sizes[k])
            payload = payloads[0][off - base:off - base + size] if len(spans) == 1 else payloads[k]
            values = self._decode(layout, payload, c, crcs).reshape(per_chunk, *row_shape)
            lo, hi = max(start, c * per_chunk), min(stop, (c + 1) * per_chunk)
            out[lo - start:hi - start] = values[lo - c * per_chunk:hi - c * per_chunk]
        return out

    def _copy(self, layout: ArrayLayout, start: int, stop: int, c0: int, c1: int, crcs: np.ndarray,
              rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Uncompressed local chunks of a v4 Zarr shard, whose rows lie back to back in the file: rows
        [start, stop) are copied out of the file's map (ByteRanges.view) into `rows` (row_bytes_view
        of `out`: its rows may lie apart, as a sample's layer does in a collated batch), in runs of
        about CHECK_BYTES, and each run's whole chunks are checked in the map against the table's
        crc32cs (checks.first_bad). A copy of page-cache bytes is fastest as one large memcpy (the
        kernel's copy of a pread, or many chunk-sized copies, run at about half of it:
        benchmarks/copy_pieces.py), which the rows' adjacency allows; checking the map rather than the
        copy lets the rows land anywhere, and a file's bytes are the ones copied (parts are never
        rewritten in place). With the native kernel (checks.NATIVE_COPY) a run is copied and
        checksummed in one pass, and with checksum threads the runs go to whichever thread is free,
        the reading thread included; without it each run's check is handed off as soon as the
        reading thread has copied it, as in _scatter."""
        C, row_bytes = layout.chunk_rows, layout.row_bytes
        chunk_bytes = C * row_bytes
        view = self.files.view(layout.key)
        if (c1 + 1) * chunk_bytes > len(view):
            raise CacheFormatError(f"{layout.name or layout.key}: chunks {c0}..{c1} end past its {len(view)} bytes")
        src = np.frombuffer(view, np.uint8)
        if not self.verify:
            np.copyto(rows, src[start * row_bytes:stop * row_bytes].reshape(-1, row_bytes))
            return out
        n_chunks = c1 - c0 + 1
        threaded = self.check_threads and (stop - start) * row_bytes >= CHECK_BYTES // 8
        step = max(1, CHECK_BYTES // chunk_bytes) if threaded else n_chunks
        name = layout.name or layout.key
        stored = memoryview(crcs[c0:c1 + 1].astype("<u4", copy=False).tobytes())
        batch = (self._pending or self._batch()) if threaded else None
        for k in range(0, n_chunks, step):
            k1 = min(k + step, n_chunks)
            lo, hi = max(start, (c0 + k) * C), min(stop, (c0 + k1) * C)
            run, at = src[(c0 + k) * chunk_bytes:(c0 + k1) * chunk_bytes], (c0 + k) * chunk_bytes
            if NATIVE_COPY:  # copied and checksummed in one pass; a run on whichever thread is free first
                args = (rows[lo - start:hi - start], run, lo * row_bytes - at, hi * row_bytes - at, stored[4 * k:4 * k1],
                        chunk_bytes, name, c0 + k)
                batch.copy(*args) if batch is not None else copy_checked(*args)
                continue
            np.copyto(rows[lo - start:hi - start], src[lo * row_bytes:hi * row_bytes].reshape(-1, row_bytes))
            segments = [run]
            if batch is not None:
                batch.check(stored[4 * k:4 * k1], chunk_bytes, segments, name, c0 + k)
            elif (bad := first_bad(stored[4 * k:4 * k1], chunk_bytes, segments)) >= 0:
                raise mismatch(name, c0 + k + bad)
        if batch is not None and batch is not self._pending:
            batch.wait()
        return out

    def _scatter(self, layout: ArrayLayout, start: int, stop: int, c0: int, c1: int, base: int,
                 out: np.ndarray, gaps: np.ndarray | None = None) -> np.ndarray:
        """Uncompressed local chunks: preadv puts the requested rows straight into `out` (rows of
        the first/last chunk outside the range, the checksum trailers and any bytes between two
        chunks (`gaps`) go to scratch), and the chunks are checked against their crc32c trailers
        (Zarr) or the chunk table's crc32c (HDF5, whose trailer is Fletcher-32) a run of chunks at
        a time (checks.first_bad): after one preadv in this thread, or, with checksum threads, one
        preadv per run of about CHECK_BYTES, each run's check handed off as soon as it is read."""
        C = layout.chunk_rows
        row_bytes = layout.row_bytes
        dst = memoryview(out.reshape(-1).view(np.uint8))
        lead_rows = start - c0 * C
        tail_rows = (c1 + 1) * C - stop
        lead = memoryview(bytearray(lead_rows * row_bytes))
        tail = memoryview(bytearray(tail_rows * row_bytes))
        crcs = bytearray(4 * (c1 - c0 + 1))
        crc_view = memoryview(crcs)
        iov = []
        ends = []  # per chunk: (iov entries, file bytes) up to the end of its trailer
        pos = 0  # byte position within `dst`
        skipped = 0
        for k, c in enumerate(range(c0, c1 + 1)):
            lo, hi = max(start, c * C), min(stop, (c + 1) * C)
            n = (hi - lo) * row_bytes
            if k and gaps is not None and gaps[k - 1]:
                iov.append(memoryview(bytearray(int(gaps[k - 1]))))
                skipped += int(gaps[k - 1])
            if k == 0 and lead_rows:
                iov.append(lead)
            iov.append(dst[pos:pos + n])
            if k == c1 - c0 and tail_rows:
                iov.append(tail)
            pos += n
            iov.append(crc_view[4 * k:4 * k + 4])
            ends.append((len(iov), (k + 1) * (C * row_bytes + 4) + skipped))
        want = ends[-1][1]  # uncompressed: every chunk is full size + trailer
        fd = self.files.fd(layout.key)
        n_chunks = c1 - c0 + 1
        threaded = self.verify and self.check_threads and want >= CHECK_BYTES // 8  # not worth a thread for a few KB
        step = max(1, CHECK_BYTES // (C * row_bytes + 4)) if threaded else n_chunks
        if self.verify:
            # chunk k's bytes: lead (k = 0) + dst[first[k]:first[k + 1]] + tail (last k)
            first = [0] + [((c + 1) * C - start) * row_bytes for c in range(c0, c1)] + [pos]
            stored = crc_view if layout.crcs is None else memoryview(layout.crcs[c0:c1 + 1].astype("<u4").tobytes())
            name = layout.name or layout.key
        batch = (self._pending or self._batch()) if threaded else None
        for k in range(0, n_chunks, step):
            # threaded: a run's check is handed off as soon as its bytes are in, so at the end of a
            # read only the last run is left to check, not the whole array
            k1 = min(k + step, n_chunks)
            (i0, b0), (i1, b1) = ends[k - 1] if k else (0, 0), ends[k1 - 1]
            got = preadv_all(fd, iov[i0:i1], base + b0)
            if got != b1 - b0:
                raise CacheFormatError(f"{layout.key}: short read ({b0 + got} of {want} bytes at {base})")
            if not self.verify:
                continue
            segments = [lead] if k == 0 and lead_rows else []
            segments.append(dst[first[k]:first[k1]])
            if k1 == n_chunks and tail_rows:
                segments.append(tail)
            if batch is not None:
                batch.check(stored[4 * k:4 * k1], C * row_bytes, segments, name, c0 + k)
            elif (bad := first_bad(stored[4 * k:4 * k1], C * row_bytes, segments)) >= 0:
                raise mismatch(name, c0 + k + bad)
        if batch is not None and batch is not self._pending:
            batch.wait()
        return out

    def set_check_threads(self, n: int) -> None:
        if n != self.check_threads:
            self.check_threads, self._checker = n, None  # the old checker's threads end with it

    def _batch(self) -> Batch:
        if self._checker is None:
            self._checker = checker(self.check_threads)
        return self._checker.batch()

    @contextlib.contextmanager
    def deferred(self):
        """Checks of the arrays read inside the block may still be running when a read returns; the
        block's exit waits for all of them and raises the first mismatch. Nested blocks join the outer one."""
        if self._pending is not None or not (self.verify and self.check_threads):
            yield
            return
        self._pending = self._batch()
        try:
            yield
        except BaseException:
            self._pending = None  # its checks still run; nobody waits for them
            raise
        batch, self._pending = self._pending, None
        batch.wait()
