"""One Zarr v3 shard file encoded without zarr-python (docs/cache-format.md §6): inner chunks of rows,
little-endian and optionally Blosc-compressed, each Blosc chunk followed by its crc32c, the
uncompressed ones back to back with their crc32cs in a table after them (format v4), then the
index of (offset, nbytes) pairs and the index's crc32c, written front to back as rows arrive
(`ShardAppender`) or at once (`encode_shard`). ZarrStoreWriter (write.py) writes every shard of a
part with it; layout.py is the reading side of the same layout.
"""
from __future__ import annotations

import math

import numpy as np
from crc32c import crc32c

from deepspec.cache.spec.format import BLOSC, CacheFormatError, crc_table


# crc32c's gil_release_mode that releases the GIL for a chunk of any size (by default only from
# 32 KB): a narrow array's checksums then leave it to the thread computing the next batch
RELEASE_GIL = 1

# Bytes of back-to-back chunks handed to one write(): far fewer calls than a write per chunk (a
# narrow array's chunk is a few KB), while single writes of 4 MB and more ran at a quarter of the
# speed on a VM's page cache (benchmarks/cache_write.py --parts).
RUN_BYTES = 1 << 20


class ShardAppender:
    """A Zarr v3 shard written front to back as rows arrive (docs/cache-format.md §6): every full inner
    chunk is encoded (little-endian, optionally Blosc-compressed) and written to `sink` at once,
    a Blosc chunk followed by its crc32c; `finish()` pads the last chunk with zeros and writes the
    crc32c table of uncompressed chunks (and the table's crc32c), then the index of (offset,
    nbytes) pairs and the index's crc32c. Only a chunk's worth of rows is ever held, so a
    part's shard is written without the part in memory. The bytes equal `encode_shard` of all rows."""

    def __init__(self, sink, rows: int, row_shape: tuple, dtype, chunk_rows: int, codec: str, name: str = "shard"):
        self.sink, self.rows, self.chunk_rows, self.name = sink, rows, chunk_rows, name
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.row_shape = tuple(row_shape)
        self.chunk_bytes = chunk_rows * math.prod(self.row_shape) * self.dtype.itemsize
        self.n_chunks = max(1, math.ceil(rows / chunk_rows))
        self.index = np.empty((self.n_chunks, 2), dtype="<u8")
        self.written = 0   # rows taken
        self._chunks = 0   # chunks written
        self._offset = 0   # bytes written
        self._carry: list[np.ndarray] = []  # rows of the chunk not yet full
        self._carried = 0
        self._blosc = None
        # uncompressed: chunk crc32cs go to the table, so the chunks' rows lie back to back
        self._crcs = np.empty(self.n_chunks, dtype="<u4") if crc_table(codec) else None
        if codec in BLOSC:
            import numcodecs

            cfg = BLOSC[codec]
            self._blosc = numcodecs.Blosc(cname=cfg["cname"], clevel=cfg["clevel"], blocksize=cfg["blocksize"],
                                          shuffle={"shuffle": 1, "bitshuffle": 2}[cfg["shuffle"]],
                                          typesize=self.dtype.itemsize)

    def append(self, values: np.ndarray) -> None:
        values = np.asarray(values)
        if values.shape[1:] != self.row_shape:
            raise CacheFormatError(f"{self.name}: rows of shape {values.shape[1:]} appended to an array of rows "
                                   f"{self.row_shape}")
        if self.written + len(values) > self.rows:
            raise CacheFormatError(f"{self.name}: {self.written + len(values)} rows appended to an array of "
                                   f"{self.rows}")
        self.written += len(values)
        values = values.astype(self.dtype, copy=False)
        at = 0
        if self._carried:  # complete the pending chunk first
            take = min(len(values), self.chunk_rows - self._carried)
            self._carry.append(values[:take])
            self._carried += take
            at = take
            if self._carried < self.chunk_rows:
                return
            self._write_chunk(np.concatenate(self._carry))
            self._carry, self._carried = [], 0
        full = (len(values) - at) // self.chunk_rows * self.chunk_rows
        if full and self._crcs is not None:  # back to back in the file: one write for the run
            self._write_run(values[at:at + full])
            at += full
        while len(values) - at >= self.chunk_rows:
            self._write_chunk(values[at:at + self.chunk_rows])
            at += self.chunk_rows
        if at < len(values):
            self._carry, self._carried = [values[at:].copy()], len(values) - at

    def _write_chunk(self, rows: np.ndarray) -> None:
        flat = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
        body = self._blosc.encode(flat) if self._blosc is not None else memoryview(flat)
        self.sink.write(body)
        if self._crcs is not None:
            self._crcs[self._chunks] = crc32c(body, 0, RELEASE_GIL)
            size = len(body)
        else:
            self.sink.write(crc32c(body, 0, RELEASE_GIL).to_bytes(4, "little"))
            size = len(body) + 4
        self.index[self._chunks] = (self._offset, size)
        self._chunks += 1
        self._offset += size

    def _write_run(self, rows: np.ndarray) -> None:
        """Whole uncompressed chunks in one write, each chunk's crc32c into the table."""
        flat = memoryview(np.ascontiguousarray(rows).reshape(-1).view(np.uint8))
        size = self.chunk_bytes
        step = max(1, RUN_BYTES // size) * size
        for a in range(0, len(flat), step):
            run = flat[a:a + step]
            # checksummed first, then written: the write's copy then reads bytes the checksum left
            # in the CPU's cache, instead of a second pass over the whole batch from memory
            for k in range(0, len(run), size):
                self._crcs[self._chunks] = crc32c(run[k:k + size], 0, RELEASE_GIL)
                self.index[self._chunks] = (self._offset, size)
                self._chunks += 1
                self._offset += size
            self.sink.write(run)

    @property
    def nbytes(self) -> int:
        """Bytes written to the sink so far."""
        return self._offset

    def finish(self) -> None:
        """The last (zero-padded) chunk, then the index: only once every row was appended."""
        if self.written != self.rows:
            raise CacheFormatError(f"{self.name}: {self.written} of {self.rows} rows appended when the shard was "
                                   "closed")
        if self._carried or self._chunks < self.n_chunks:  # no rows at all: one chunk of zeros
            last = np.zeros((self.chunk_rows, *self.row_shape), dtype=self.dtype)
            if self._carried:
                last[:self._carried] = np.concatenate(self._carry)
            self._write_chunk(last)
            self._carry, self._carried = [], 0
        if self._crcs is not None:
            table = self._crcs.tobytes()
            self.sink.write(table)
            self.sink.write(crc32c(table).to_bytes(4, "little"))
        idx = self.index.tobytes()
        self.sink.write(idx)
        self.sink.write(crc32c(idx).to_bytes(4, "little"))


def encode_shard(data: np.ndarray, chunk_rows: int, codec: str) -> bytes:
    """One Zarr v3 shard holding all of `data` (ShardAppender's bytes, in memory)."""
    import io

    buf = io.BytesIO()
    shard = ShardAppender(buf, data.shape[0], data.shape[1:], data.dtype, chunk_rows, codec)
    shard.append(data)
    shard.finish()
    return buf.getvalue()
