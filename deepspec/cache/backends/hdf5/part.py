"""One HDF5 part file written through h5py (docs/cache-format.md §11), complete: every array of the
part a chunked dataset with Fletcher-32 per chunk, after the Blosc filter when a codec is set; rows
handed over whole or streamed from a feed (into the file as they come, or, compressed, through spool
files); the file's own chunk table stored
inside it as the dataset `chunk_index`, whose byte range and crc32c the caller records.
HDF5StoreWriter (write.py) commits it; h5.py is what h5py needs to read one back.
"""
from __future__ import annotations

import contextlib
import json
import os

import numpy as np
from crc32c import crc32c

from deepspec.cache.backends.base import ArraySpec
from deepspec.cache.spec.format import BLOSC, FORMAT, CacheFormatError
from deepspec.cache.backends.hdf5.h5 import INDEX_DATASET


def h5_compression(codec: str) -> dict:
    """h5py create_dataset keywords of a codec (hdf5plugin's Blosc filter, id 32001)."""
    if codec == "none":
        return {}
    if codec not in BLOSC:
        raise CacheFormatError(f"unknown codec {codec!r}")
    import hdf5plugin

    cfg = BLOSC[codec]
    shuffle = {"shuffle": hdf5plugin.Blosc.SHUFFLE, "bitshuffle": hdf5plugin.Blosc.BITSHUFFLE}[cfg["shuffle"]]
    return dict(hdf5plugin.Blosc(cname=cfg["cname"], clevel=cfg["clevel"], shuffle=shuffle))


def _fed(rows: dict, name: str, shape: tuple, dtype) -> np.ndarray:
    """One array's rows of a fed batch, refused (naming the array) unless they have its row shape."""
    values = np.asarray(rows[name])
    if values.shape[1:] != tuple(shape[1:]):
        raise CacheFormatError(f"{name}: rows of shape {values.shape[1:]} fed to an array of rows {tuple(shape[1:])}")
    return np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<"))


def _spool(arrays: list[ArraySpec], feed, where: str) -> dict:
    """The rows of the arrays without `data`, taken from `feed` batch by batch into one raw file
    each beside the part file: HDF5 places a compressed dataset's chunks as they are written, so
    the datasets are then written one after another, as a part handed over whole is, and the file
    is byte-identical to it. Holds a batch in memory, the part on disk."""
    import tempfile

    streamed = [spec for spec in arrays if spec.data is None]
    spools = {spec.name: tempfile.TemporaryFile(dir=where, prefix=".spool-") for spec in streamed}
    taken = 0
    for rows in feed:
        for spec in streamed:
            values = _fed(rows, spec.name, spec.shape, spec.dtype)
            spools[spec.name].write(memoryview(values).cast("B"))
        taken += len(rows[streamed[0].name]) if streamed else 0
    if streamed and taken != streamed[0].shape[0]:
        for f in spools.values():
            f.close()
        raise CacheFormatError(f"{taken} of {streamed[0].shape[0]} rows fed to the part")
    return spools


def _stream(dsets: dict, shapes: dict, chunk_rows: dict, feed) -> None:
    """The rows of the streamed datasets `dsets` (name -> h5py dataset, created with their chunks
    allocated in place), taken from `feed` batch by batch and written where they belong, whole
    chunks at a time (HDF5 reads a filtered chunk back before a partial write, and these chunks
    hold nothing yet); the rows of a chunk split between two batches wait in memory."""
    taken = dict.fromkeys(dsets, 0)
    carry: dict = dict.fromkeys(dsets)
    for rows in feed:
        for name, d in dsets.items():
            values = _fed(rows, name, shapes[name], d.dtype)
            total, chunk, start = shapes[name][0], chunk_rows[name], taken[name]
            if carry[name] is not None:  # first the chunk the last batch began: a chunk's rows copied, not the batch's
                head = np.concatenate([carry[name], values[:chunk - len(carry[name])]])
                values, carry[name] = values[len(head) - len(carry[name]):], None
                if start + len(head) > total:
                    raise CacheFormatError(f"{start + len(head)} of {total} rows fed to the part")
                if len(head) < chunk and start + len(head) < total:
                    carry[name] = head
                    continue
                d[start:start + len(head)] = head
                start += len(head)
            end = start + len(values)
            if end > total:
                raise CacheFormatError(f"{end} of {total} rows fed to the part")
            whole = end if end == total else start + (len(values) // chunk) * chunk
            if whole > start:
                d[start:whole] = values[:whole - start]
            carry[name] = values[whole - start:].copy() if whole < end else None  # not a view: the batch may go
            taken[name] = whole
    short = [name for name in dsets if taken[name] != shapes[name][0]]
    if short:
        got = taken[short[0]] + (0 if carry[short[0]] is None else len(carry[short[0]]))
        raise CacheFormatError(f"{got} of {shapes[short[0]][0]} rows fed to the part")


def write_part_file(path: str, arrays: list[ArraySpec], attrs: dict, feed=None) -> list[int]:
    """Write one complete part file; returns [offset, nbytes, crc32c] of its chunk table. The rows
    of arrays without `data` come from `feed` ({name: rows} per batch, in order): written in place
    as they come when no array is compressed (every chunk is allocated when its dataset is created,
    so the file is the one a part handed over whole gives), else through spool files (_spool)."""
    import h5py

    direct = feed is not None and all(spec.codec == "none" for spec in arrays)
    spools = _spool(arrays, feed, os.path.dirname(os.path.abspath(path))) if feed is not None and not direct else {}
    streamed: dict = {}
    table: dict[str, dict] = {}
    # v110 objects (HDF5 >= 1.10 reads them): fixed-array chunk indexes and compact headers, a
    # fraction of the v1 B-trees the default "earliest" writes (~2 KB per dataset)
    with contextlib.ExitStack() as stack, h5py.File(path, "w", libver=("v110", "v110")) as f:
        for spool in spools.values():
            stack.callback(spool.close)
        dsets = []
        for spec in arrays:
            data = None if spec.data is None else np.ascontiguousarray(spec.data)
            shape = tuple(spec.shape)
            rows = max(shape[0], 1)
            chunks = (min(spec.chunk_rows, rows),) + shape[1:]
            dcpl = None
            if spec.codec == "none":
                # chunks allocated when the dataset is created: back to back in row order. Allocated
                # as they are written, a dataset's later chunks can land tens of MB away (after other
                # datasets' data), which costs an extra request per sample on an object store.
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # every chunk is written right after
            # track_times off: the same part written twice is byte-identical (resume repeats a build)
            d = f.create_dataset(spec.name, shape=shape, dtype=np.dtype(spec.dtype), data=data, chunks=chunks,
                                 fletcher32=True, track_times=False, dcpl=dcpl, **h5_compression(spec.codec))
            if data is None and direct:
                streamed[spec.name] = d
            elif data is None and shape[0]:  # from its spool, whole chunks at a time, in row order
                dtype = np.dtype(spec.dtype).newbyteorder("<")
                row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
                step = max(1, (64 << 20) // max(1, row_bytes * chunks[0])) * chunks[0]
                spool = spools[spec.name]
                for a in range(0, shape[0], step):
                    n = min(step, shape[0] - a)
                    spool.seek(a * row_bytes)
                    d[a:a + n] = np.frombuffer(spool.read(n * row_bytes), dtype=dtype).reshape(n, *shape[1:])
            dsets.append((spec, d, chunks[0]))
        if direct:
            by_name = {spec.name: spec for spec in arrays}
            _stream(streamed, {n: tuple(by_name[n].shape) for n in streamed},
                    {n: min(by_name[n].chunk_rows, max(by_name[n].shape[0], 1)) for n in streamed}, feed)
        f.flush()
        raw = os.open(path, os.O_RDONLY)
        for spec, d, chunk_rows in dsets:
            entries: list[tuple[int, int, int, int]] = []
            d.id.chunk_iter(lambda info: entries.append((info.chunk_offset[0], info.byte_offset, info.size,
                                                         info.filter_mask)))
            entries.sort()
            table[spec.name] = {
                "dtype": np.dtype(spec.dtype).newbyteorder("<").str, "shape": list(spec.shape),
                "chunk_rows": chunk_rows, "blosc": spec.codec != "none",
                "filtered": all(e[3] == 0 for e in entries),  # every chunk went through every filter
                "chunks": [[e[1], e[2]] for e in entries],
                # crc32c of each chunk's stored bytes (its trailing Fletcher-32 excluded): the loader
                # checks these, at crc32c's hardware speed, instead of Fletcher-32 in numpy
                "crc32c": [crc32c(os.pread(raw, e[2] - 4, e[1])) for e in entries],
            }
        os.close(raw)
        blob = json.dumps(table, separators=(",", ":"), sort_keys=True).encode()
        idx = f.create_dataset(INDEX_DATASET, data=np.frombuffer(blob, dtype=np.uint8), track_times=False)
        f.flush()
        where = [int(idx.id.get_offset()), len(blob), crc32c(blob)]
        f.attrs.update({**attrs, "format": FORMAT, INDEX_DATASET: where})
    return where
