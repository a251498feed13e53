"""The writable store of each kind (readers.py's classes with their write side): what a writer
opens a store with. Nothing that only reads imports this module, nor the write side below it."""
from __future__ import annotations

from deepspec.cache.backends.base import WritableStore
from deepspec.cache.backends.hdf5.write import HDF5StoreWriter
from deepspec.cache.backends.readers import BACKENDS, backend_class
from deepspec.cache.backends.zarr.write import ZarrStoreWriter

WRITERS: dict[str, type[WritableStore]] = {"zarr": ZarrStoreWriter, "hdf5": HDF5StoreWriter}
assert all(issubclass(WRITERS[kind], cls) for kind, cls in BACKENDS.items())


def open_for_write(url: str, kind: str, storage_options: dict | None = None) -> WritableStore:
    """The store at `url` of backend `kind`, to write (a new store is created by its first write)."""
    backend_class(kind)  # an unknown kind is refused as a reader refuses it
    return WRITERS[kind](url, storage_options)
