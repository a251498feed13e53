"""Batches read from the store straight into their collated layout: `read_batch` makes what
`collate(read_samples(...))` makes, with each row copied once, from the store into its place in the
batch, where reading the samples and then collating them copies every byte twice. On a local
uncompressed Zarr part (format v4) that one copy comes out of the file's map and the crc32c checks
read the map beside it (shards.ShardReader); every other layout is read and checked as for a
sample, then put in place.

All of a batch's tensors are views of one buffer, allocated in shared memory inside a DataLoader
worker, and a worker hands the batch over as that one buffer (`SharedBatch`): torch sends each
tensor of a batch on its own (a file descriptor passed over a socket, then mapped, per tensor),
which costs the loading process more than a batch's copy at small batches (benchmarks/loader_peers.py).

`Batches` is the map-style dataset a DataLoader reads batches through: its items are a batch
sampler's index lists (`DataLoader(Batches(ds), sampler=batch_sampler, batch_size=None)`).
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset, get_worker_info

from deepspec.cache.read.reader import CacheReader
from deepspec.cache.read.samples import FIELDS
from deepspec.cache.spec.format import decode_hidden, hidden_name, scale_name
from deepspec.loader.collate import host_empty

ALIGN = 64  # each view starts on a cache line (and so on its dtype's size)


def _views(buffer: torch.Tensor, specs: list[tuple[str, torch.dtype, tuple, int]]) -> dict:
    return {k: buffer[at:at + dtype.itemsize * math.prod(shape)].view(dtype).view(shape) for k, dtype, shape, at in specs}


def _carve(wanted: list[tuple[str, torch.dtype, tuple]]) -> tuple[torch.Tensor, list, dict]:
    """One uninitialised host buffer (host_empty) holding a tensor per (key, dtype, shape): the buffer,
    where each lies in it, and the views."""
    specs, at = [], 0
    for key, dtype, shape in wanted:
        specs.append((key, dtype, tuple(shape), at))
        at += -(-dtype.itemsize * math.prod(shape) // ALIGN) * ALIGN
    buffer = host_empty((max(at, 1),), torch.uint8)
    return buffer, specs, _views(buffer, specs)


class SharedBatch:
    """A batch as its one buffer on the way out of a DataLoader worker; unpickled, a plain dict of
    views of that buffer again."""

    def __init__(self, buffer: torch.Tensor, specs: list, plain: dict, order: list[str]):
        self.buffer, self.specs, self.plain, self.order = buffer, specs, plain, order

    def __reduce__(self):
        return _unpack, (self.buffer, self.specs, self.plain, self.order)


def _unpack(buffer: torch.Tensor, specs: list, plain: dict, order: list[str]) -> dict:
    views = _views(buffer, specs)
    return {k: views[k] if k in views else plain[k] for k in order}


def _read(reader: CacheReader, indices: list[int], layers: list, fields: tuple[str, ...], multiple: int = 1):
    r, H = reader, int(reader.manifest.hidden_size)
    located = [r.locate(i) for i in indices]
    sizes = [stop - start for _, start, stop in located]
    B, T = len(indices), -(-max(sizes) // multiple) * multiple
    wanted = {f: w for f, w in (("hidden", list(layers)), ("last_hidden", ["last"])) if f in fields}
    shapes = [("lengths", torch.int64, (B,))]
    shapes += [(f, dtype, (B, T)) for f, dtype in (("input_ids", torch.int32), ("loss_mask", torch.uint8)) if f in fields]
    shapes += [(f, torch.bfloat16, (B, T, len(w) * H)) for f, w in wanted.items()]
    buffer, specs, outs = _carve(shapes)
    outs["lengths"].copy_(torch.tensor(sizes, dtype=torch.int64, device="cpu"))
    requests, decode = [], []  # decode: (slot, index of its bits in requests) of 8-bit stores
    for b, ((part, start, stop), n) in enumerate(zip(located, sizes)):
        for f in ("input_ids", "loss_mask"):
            if f in outs:
                requests.append((part, f, start, stop, outs[f][b, :n].numpy()))
        for f, names in wanted.items():
            slots = outs[f][b, :n].view(n, len(names), H)
            for k, layer in enumerate(names):
                if reader.dtype == "bfloat16":  # straight into place: rows of H, L*H apart
                    requests.append((part, hidden_name(layer), start, stop, slots[:, k].view(torch.uint16).numpy()))
                else:
                    decode.append((slots[:, k], len(requests)))
                    requests += [(part, hidden_name(layer), start, stop, None), (part, scale_name(layer), start, stop, None)]
    with r.checked():
        values = r.read_arrays(requests)
    for slot, at in decode:
        decode_hidden(values[at], values[at + 1], reader.dtype, out=slot)
    for key in FIELDS:  # only the padding after each row is written
        for b, n in enumerate(sizes):
            if key in outs:
                outs[key][b, n:].zero_()
    plain = {"tokens": sum(sizes), "sample_id": [int(r.sample_id(i)) for i in indices]}
    order = ["lengths", "tokens", "sample_id", *(k for k in FIELDS if k in outs)]
    return buffer, specs, plain, order


def read_batch(reader: CacheReader, indices: list[int], layers: list, fields: tuple[str, ...] = FIELDS,
               multiple: int = 1) -> dict:
    """Samples `indices` as one right-padded batch (collate.collate's layout: hidden [B, T, L*H],
    token-major, the layers side by side), every array's checks settled before it returns. `multiple`:
    T is the longest row rounded up to a multiple of it (zeros after every row, as for the shorter rows)."""
    return _unpack(*_read(reader, indices, layers, fields, multiple))


class Batches(Dataset):
    """A dataset's batches by index list: `Batches(ds)[indices] == collate([ds[i] for i in indices])`,
    read with read_batch; inside a DataLoader worker, handed over as a SharedBatch. `ds` is a
    loader.dataset.TargetCacheDataset. `multiple`: each batch's token axis padded to a multiple of it
    (read_batch), so that the shapes a trainer meets repeat."""

    def __init__(self, dataset, multiple: int = 1):
        self.dataset = dataset
        self.multiple = multiple

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]):
        ds = self.dataset
        parts = _read(ds.reader_here(), list(indices), ds.layers, ds.fields, self.multiple)
        return SharedBatch(*parts) if get_worker_info() is not None else _unpack(*parts)
