"""`deepspec cache convert SRC DST`: the same store in another backend (Zarr <-> HDF5).

Part by part: every array of a source part is read whole (checksums on) and written, bits unchanged,
as the part of the same name, so the destination has the same parts, packing, sample ids and
manifest content; only `storage` (and, when asked, `codec`/`chunk_tokens`) differ. (A part of a
store written before format v3 gets the v3 name of what it holds, and its samples their keys.) The loader then
returns bitwise equal samples from both. Memory: one part (the writer holds at most one more).
"""
from __future__ import annotations

import numpy as np

from deepspec.cache.spec.format import CacheFormatError, hidden_name, part_name, scale_name
from deepspec.cache.spec.manifest import STORAGES
from deepspec.cache.read.reader import CacheReader


def convert(src: str, dst: str, storage: str | None = None, codec: str | None = None,
            chunk_tokens: int | None = None, storage_options: dict | None = None,
            dst_storage_options: dict | None = None) -> dict:
    """Write `src` as a new store at `dst`; `storage` defaults to the other backend."""
    from deepspec.cache.write.part_data import PartData
    from deepspec.cache.backends.readers import refuse_existing
    from deepspec.cache.write.writer import CacheWriter

    reader = CacheReader(src, storage_options, verify=True)
    storage = storage or next(s for s in STORAGES if s != reader.storage)
    if storage not in STORAGES:
        raise CacheFormatError(f"unknown storage {storage!r} (known: {list(STORAGES)})")
    dst_options = storage_options if dst_storage_options is None else dst_storage_options
    refuse_existing(dst, dst_options)
    m = reader.manifest.content()
    m["storage"] = storage
    if codec is not None:
        m["codec"] = codec
    if chunk_tokens is not None:
        m["chunk_tokens"] = chunk_tokens
    fp8 = reader.dtype != "bfloat16"
    order = []
    with CacheWriter(dst, m, dst_options, queue_size=1, prune_stale=False) as writer:
        for p, entry in enumerate(reader.entries):
            keys, ids = reader.part_keys(p), reader.part_sample_ids(p)
            order.append(part_name(keys, ids))
            t = entry.tokens
            hidden = {}
            for layer in [*reader.layers, "last"]:
                bits = reader.read_array(p, hidden_name(layer), 0, t)
                hidden[layer] = (bits, reader.read_array(p, scale_name(layer), 0, t) if fp8 else None)
            writer.submit(PartData(
                name=order[-1], sample_ids=np.asarray(ids, dtype=np.uint64), keys=keys,
                lengths=np.diff(reader.part_offsets(p)).astype(np.int64),
                input_ids=reader.read_array(p, "input_ids", 0, t), loss_mask=reader.read_array(p, "loss_mask", 0, t),
                hidden=hidden, computed_by=reader.store.computed_by(entry.name)))  # its origin travels with its bits
        writer.close(order=order)
    return {"src": src, "dst": dst, "storage": storage, "parts": len(reader.parts), "samples": len(reader),
            "tokens": int(reader.manifest.num_tokens)}
