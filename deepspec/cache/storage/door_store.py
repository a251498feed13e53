"""zarr-python's reads of a store through the door (door.py): `DoorStore` for a local store (zarr's
own `LocalStore` follows links and opens whatever a key names), `BoundedFsspecStore` for a remote
one (a whole-object read asks the object's size first, so a document of gigabytes is refused
before it is fetched)."""
from __future__ import annotations

import asyncio
import os

from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import FsspecStore, LocalStore

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.storage import door


def document_limit(key: str) -> int | None:
    """The most bytes a whole read of `key` may fetch when nothing declares its size: a JSON document
    is bounded; a shard or chunk read whole is sized by its array, which the reader checks first."""
    return door.DOCUMENT_BYTES if key.rsplit("/", 1)[-1] == "zarr.json" else None


def read_local(root: str, key: str, byte_range) -> bytes:
    fd = door.open_fd(root, key, limit=document_limit(key) if byte_range is None else None)
    try:
        size = os.fstat(fd).st_size
        if byte_range is None:
            return door.read_exactly(fd, size, 0, root, key)
        if isinstance(byte_range, RangeByteRequest):
            return door.pread_checked(fd, byte_range.start, byte_range.end, root, key)
        if isinstance(byte_range, OffsetByteRequest):
            return door.pread_checked(fd, byte_range.offset, size, root, key)
        if isinstance(byte_range, SuffixByteRequest):
            return door.pread_checked(fd, max(0, size - byte_range.suffix), size, root, key)
        raise TypeError(f"unexpected byte range {byte_range!r}")
    finally:
        os.close(fd)


class DoorStore(LocalStore):
    """A LocalStore whose every read goes through the door. Listing is zarr's own (names only)."""

    async def get(self, key: str, prototype=None, byte_range=None):
        prototype = prototype or default_buffer_prototype()
        if not self._is_open:
            await self._open()
        try:
            data = await asyncio.to_thread(read_local, str(self.root), key, byte_range)
        except FileNotFoundError:
            return None
        return prototype.buffer.from_bytes(data)

    async def get_partial_values(self, prototype, key_ranges):
        return list(await asyncio.gather(*(self.get(key, prototype, r) for key, r in key_ranges)))

    async def getsize(self, key: str) -> int:
        return await asyncio.to_thread(door.file_size, str(self.root), key)

    async def exists(self, key: str) -> bool:
        try:
            await asyncio.to_thread(lambda: os.close(door.open_fd(str(self.root), key)))
            return True
        except (FileNotFoundError, CacheFormatError):
            return False


class BoundedFsspecStore(FsspecStore):
    """An FsspecStore whose whole-object reads of documents ask the object's size first (one HEAD)."""

    async def bounded(self, key: str) -> bool:
        """Whether `key` exists, refused (CacheFormatError) when it is larger than a document may be."""
        if not self._is_open:
            await self._open()
        path = f"{self.path.rstrip('/')}/{key}"
        try:
            size = int((await self.fs._info(path)).get("size") or 0)
        except FileNotFoundError:
            return False
        limit = document_limit(key)
        if limit is not None and size > limit:
            raise CacheFormatError(f"{self.fs.unstrip_protocol(path)}: {size} bytes, more than the {limit} a "
                                   "document may have")
        return True

    async def get(self, key: str, prototype=None, byte_range=None):
        if byte_range is None and document_limit(key) is not None and not await self.bounded(key):
            return None
        return await super().get(key, prototype or default_buffer_prototype(), byte_range)
