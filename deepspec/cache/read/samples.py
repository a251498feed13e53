"""Cache samples as tensors, read through the reader's fast shard path: what the loader's dataset
hands out and what an export to another format walks.

A sample is a dict of
    input_ids    int32    [T]
    loss_mask    uint8    [T]
    hidden       bfloat16 [L, T, H]  the requested layers, in the order asked for; each layer one
                                     contiguous slab, read straight into place
    last_hidden  bfloat16 [T, H]     post-norm final state
    sample_id    int                 the row id as an integer (format.sample_id_to_str)
"""
from __future__ import annotations

import numpy as np
import torch

from deepspec.cache.spec.format import decode_hidden, hidden_name, scale_name
from deepspec.cache.read.reader import CacheReader

FIELDS = ("input_ids", "loss_mask", "hidden", "last_hidden")


def read_samples(reader: CacheReader, indices: list[int], layers: list, fields: tuple[str, ...] = FIELDS) -> list[dict]:
    """Samples `indices` with only the requested layers and fields read. On a remote store the byte
    ranges of all of them are fetched together (`read_ahead` requests in flight); every array's
    checks are settled before any item is handed out."""
    r, H = reader, int(reader.manifest.hidden_size)
    items, requests, finish = [], [], []
    for index in indices:
        part, start, stop = r.locate(index)
        item: dict = {"sample_id": int(r.sample_id(index))}
        for f in ("input_ids", "loss_mask"):
            if f in fields:
                finish.append((item, f, len(requests)))
                requests.append((part, f, start, stop, None))
        for field, wanted in (("hidden", layers), ("last_hidden", ["last"])):
            if field not in fields:
                continue
            if reader.dtype == "bfloat16":  # each layer read straight into its slab of the item's tensor
                buf = np.empty((len(wanted), stop - start, H), dtype=np.uint16)
                requests += [(part, hidden_name(layer), start, stop, buf[k]) for k, layer in enumerate(wanted)]
                t = torch.from_numpy(buf).view(torch.bfloat16)
                item[field] = t if field == "hidden" else t[0]
            else:
                finish.append((item, field, len(requests)))
                for layer in wanted:
                    requests += [(part, hidden_name(layer), start, stop, None), (part, scale_name(layer), start, stop, None)]
        items.append(item)
    with r.checked():
        values = r.read_arrays(requests)
    for item, field, at in finish:
        if field in ("input_ids", "loss_mask"):
            item[field] = torch.from_numpy(values[at])
            continue
        n = len(layers) if field == "hidden" else 1
        out = torch.empty((n, len(values[at]), H), dtype=torch.bfloat16, device="cpu")
        for k in range(n):
            decode_hidden(values[at + 2 * k], values[at + 2 * k + 1], reader.dtype, out=out[k])
        item[field] = out if field == "hidden" else out[0]
    return [{k: item[k] for k in ("sample_id", *FIELDS) if k in item} for item in items]
