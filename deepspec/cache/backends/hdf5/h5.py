"""What h5py needs to read an HDF5 part file (docs/cache-format.md §11) back: the Blosc plugin
registered, no cyclic garbage collection while it reads a file object on S3, and the name of the
dataset holding the file's chunk table. part.py writes the file; read.py reads it.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from functools import lru_cache

INDEX_DATASET = "chunk_index"

_GC_LOCK = threading.Lock()
_gc_holds = 0
_gc_was_enabled = False


@contextlib.contextmanager
def no_cyclic_gc():
    """No automatic cyclic garbage collection, in any thread, while h5py reads a file object on S3.
    h5py holds its global lock while it calls the file object's read(), and an S3 read waits for
    fsspec's IO thread; a collection that starts on that thread and frees an h5py object (one a
    reference cycle kept: a frame held by an exception's traceback, ...) waits for the same lock:
    both threads wait forever (h5py's File docs on file-like objects; h5py/h5py#2019)."""
    global _gc_holds, _gc_was_enabled
    with _GC_LOCK:
        if _gc_holds == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holds += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _gc_holds -= 1
            if _gc_holds == 0 and _gc_was_enabled:
                gc.enable()


@lru_cache(maxsize=1)
def register_plugins() -> None:
    """Importing hdf5plugin registers the Blosc filter with the HDF5 library h5py uses."""
    import hdf5plugin  # noqa: F401
