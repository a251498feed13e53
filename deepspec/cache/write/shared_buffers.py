"""Memory two processes share, for handing a batch's arrays from the process that computes them to a
writer process (process_writer.py) without sending their bytes through a pipe.

A buffer is an anonymous memory file (memfd): its size is not bounded by the /dev/shm mount, which
containers often keep at 64 MiB. The computing side packs a batch's arrays into one buffer; the writer
side copies them out and hands the buffer back, so a buffer is reused batch after batch (its pages
are touched once).
"""
from __future__ import annotations

import mmap
import os

import numpy as np

ALIGN = 64  # each array starts on a cache line


def round_size(nbytes: int) -> int:
    """A new buffer's size: the next power of two from 1 MiB, so a slightly larger batch reuses it."""
    size = 1 << 20
    while size < nbytes:
        size <<= 1
    return size


def packed_size(arrays: list[np.ndarray]) -> int:
    return sum(-(-a.nbytes // ALIGN) * ALIGN for a in arrays)


class SharedBuffer:
    """One memory file mapped into this process. `create` makes one; the other process maps the same
    file from its descriptor (`attach`)."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self._map = mmap.mmap(fd, size)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, size: int) -> "SharedBuffer":
        fd = os.memfd_create("deepspec-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, size: int) -> "SharedBuffer":
        st = os.fstat(fd)
        if st.st_size < size:
            os.close(fd)
            raise ValueError(f"a shared buffer of {st.st_size} bytes was announced as {size}")
        return cls(fd, size)

    def pack(self, arrays: list[np.ndarray]) -> list[tuple[int, str, tuple]]:
        """Copy `arrays` in, back to back; returns each one's (offset, dtype, shape) for `unpack`."""
        out, at = [], 0
        for a in arrays:
            a = np.asarray(a)
            if at + a.nbytes > self.size:
                raise ValueError(f"{packed_size(arrays)} bytes do not fit a shared buffer of {self.size}")
            np.copyto(self._bytes[at:at + a.nbytes].view(a.dtype).reshape(a.shape), a)
            out.append((at, a.dtype.str, a.shape))
            at += -(-a.nbytes // ALIGN) * ALIGN
        return out

    def unpack(self, layout: list[tuple[int, str, tuple]]) -> list[np.ndarray]:
        """Copies of the arrays `pack` described: the buffer can be reused as soon as this returns."""
        out = []
        for at, dtype, shape in layout:
            dt = np.dtype(dtype)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if at < 0 or at + n > self.size:
                raise ValueError(f"an array of {n} bytes at offset {at} lies outside a shared buffer of {self.size}")
            out.append(self._bytes[at:at + n].view(dt).reshape(shape).copy())
        return out

    def close(self) -> None:
        self._bytes = None
        self._map.close()
        os.close(self.fd)
