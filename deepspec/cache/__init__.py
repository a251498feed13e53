"""The cache: a chunked, sharded, checksummed store of a target's hidden states (docs/cache-format.md).

Subpackages, top to bottom (each imports only those below it; pyproject.toml's import contracts):
`tools` (verify, gc, convert, estimate, reference format), `build` (the cache stage, deriving), `read`
and `write` (the two paths), `backends` (Zarr and HDF5 behind one interface), `storage` (locations,
durable and conditional writes, naming), `spec` (the format's vocabulary, the manifest, the plan).

The public names below are importable from here; each is loaded on first use, so importing one
subpackage does not load the others.
"""
from __future__ import annotations

import importlib

_PUBLIC = {
    "CacheFormatError": "spec.format", "Manifest": "spec.manifest",
    "CacheReader": "read.reader", "read_samples": "read.samples",
    "CacheWriter": "write.writer", "ProcessWriter": "write.process_writer", "PartData": "write.part_data", "LeaseError": "write.lease",
    "open_cache": "backends.readers", "open_for_write": "backends.writers",
    "store_url": "storage.naming", "list_stores": "storage.naming", "built_store_url": "storage.naming",
    "build_cache": "build.stage", "derive_store": "build.derive",
    "verify": "tools.verify", "info": "tools.verify", "recompute": "tools.verify", "collect": "tools.gc",
    "convert": "tools.convert", "estimate": "tools.estimate",
    "import_reference": "tools.reference", "export_reference": "tools.reference",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
