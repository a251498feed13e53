"""The writable store of each kind (stores.py's read classes with their write side): what a writer
opens a store with. Nothing that only reads imports this module, nor the write side below it."""
from __future__ import annotations

from deepspec.cache.backend import WritableStore
from deepspec.cache.hdf5_write import HDF5StoreWriter
from deepspec.cache.stores import BACKENDS, backend_class
from deepspec.cache.zarr_write import ZarrStoreWriter

WRITERS: dict[str, type[WritableStore]] = {"zarr": ZarrStoreWriter, "hdf5": HDF5StoreWriter}
assert all(issubclass(WRITERS[kind], cls) for kind, cls in BACKENDS.items())


def open_for_write(url: str, kind: str, storage_options: dict | None = None) -> WritableStore:
    """The store at `url` of backend `kind`, to write (a new store is created by its first write)."""
    backend_class(kind)  # an unknown kind is refused as a reader refuses it
    return WRITERS[kind](url, storage_options)
