"""The store implementations by kind, read-only: the one place that knows both (a reader names a
kind, or finds it with backend.detect, and gets its class here), and whether a location is free
for a new store of either kind (refuse_existing). Their write side: writers.py."""
from __future__ import annotations

from pathlib import Path

from deepspec.cache.backends.base import CacheStore, detect
from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.backends.hdf5.read import HDF5Store
from deepspec.cache.spec.manifest import STORAGES
from deepspec.cache.storage.urls import is_remote
from deepspec.cache.backends.zarr.read import ZarrStore

BACKENDS: dict[str, type[CacheStore]] = {"zarr": ZarrStore, "hdf5": HDF5Store}
assert set(BACKENDS) == set(STORAGES)


def backend_class(kind: str) -> type[CacheStore]:
    try:
        return BACKENDS[kind]
    except KeyError:
        raise CacheFormatError(f"unknown cache storage {kind!r} (known: {list(STORAGES)})") from None


def open_cache(url: str, storage_options: dict | None = None) -> CacheStore:
    """The store at `url`, read-only, whichever backend wrote it."""
    kind = detect(url, storage_options)
    if kind is None:
        raise CacheFormatError(f"{url}: not a cache store (no zarr.json or manifest.json)")
    return backend_class(kind)(url, storage_options)


def refuse_existing(url: str, storage_options: dict | None) -> None:
    """Raise unless `url` is free for a new store: a local path must not exist or be an empty
    directory, and a remote location must hold no store of either kind (what an import or a
    convert writes into)."""
    if not is_remote(url):
        path = Path(url.removeprefix("file://"))
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise CacheFormatError(f"{url}: already exists and is not empty; import writes a new store")
        return
    if detect(url, storage_options) is not None:
        raise CacheFormatError(f"{url}: already holds a store; import writes a new store")
