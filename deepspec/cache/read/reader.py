"""Reading cache samples: `CacheReader`, random access to the samples of every committed part of a
store, whichever backend holds it. Arrays whose layout the fast path recognises are read by
shards.ShardReader (one copy, preadv or range request per sample's chunk run, every chunk's
checksum checked, on helper threads with `check_threads`); the others are read through zarr-python
or h5py. A remote Zarr store with a `cache_dir` is read through a part mirror (mirror.py): whole
arrays downloaded once, samples read from local disk. Nothing unchecked leaves a
`CacheReader.read` or a dataset item.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import NamedTuple

import numpy as np

from deepspec.cache.backends.base import ArrayLayout, CacheStore, split_index
from deepspec.cache.storage.bounded import BoundedCache
from deepspec.cache.storage.naming import store_key
from deepspec.cache.storage.urls import is_remote
from deepspec.cache.spec.format import (CacheFormatError, array_shape, hidden_name, named, naming_the_store,
                                        sample_keys, scale_name)
from deepspec.cache.spec.manifest import Manifest, PartEntry, manifest_mismatch
from deepspec.cache.read.ranges import ByteRanges
from deepspec.cache.read.mirror import PartMirror
from deepspec.cache.read.shards import ShardReader
from deepspec.cache.backends.readers import open_cache
from deepspec.cache.backends.zarr.layout import parse_layout


_UNKNOWN = object()  # a layout not looked up yet (None is a known one: read through the library)
# a process's first read of a mirrored store goes to the store: one range per array (not cut at
# range_bytes), since the arrays download whole right after and every request counts
MIRROR_RANGE_BYTES = 64 << 20


class _ProcessState(NamedTuple):
    """What one process opens to read (CacheReader._process_state)."""
    pid: int
    store: CacheStore
    files: ByteRanges
    shards: ShardReader
    layouts: BoundedCache            # the layouts of the arrays this process touched (an HDF5 one holds its chunk table)
    mirror: PartMirror | None        # cache_dir of a remote Zarr store
    mirrored: ShardReader | None     # reads the mirror's local files


class CacheReader:
    """Random access to samples across all committed parts of a store, in manifest order, whichever
    backend holds it (stores.open_cache).

    Picklable and fork-safe: the store is opened lazily in whichever process first reads.
    `check_threads` (set_check_threads): threads that check crc32c of local reads, 0 = in the
    reading thread.
    """

    # one helper keeps up with one reading thread (crc32c runs at 2-3x a page-cache copy); a second
    # measured no faster (benchmarks/loader.py --checks, checks_on_2t); a single CPU checks inline
    check_threads: int = 1 if (os.cpu_count() or 1) > 1 else 0
    # remote stores: byte-range requests kept in flight by read_arrays (a sample's arrays, a batch's
    # samples), and the most bytes one request asks for (a large array is cut into several)
    read_ahead: int = 16
    range_bytes: int = 4 << 20
    # `cache_dir` of a remote Zarr store: the most bytes of mirrored arrays a process keeps (mirror.py)
    mirror_bytes: int = 100 << 30

    def __init__(self, url: str, storage_options: dict | None = None, expect: dict | None = None,
                 verify: bool = True, fast: bool = True, cache_dir: str | None = None,
                 manifest: dict | None = None, planned: tuple[Manifest, np.ndarray] | None = None):
        """`manifest`: read the parts and index this manifest lists (the one the cache stage recorded,
        data/cache/manifest.json) instead of the ones the store's root lists now: in a lake another
        experiment may have switched the root to its own samples since. Its content fields must be
        the store's. `cache_dir`: where a remote store's arrays are mirrored whole (Zarr: mirror.py;
        HDF5: fsspec's block cache keeps the byte ranges read). `planned`: (manifest, index rows) of a
        store being filled (cache.build.fill): its parts are read as listed there, each once its writer
        has committed it (the caller waits for that); the store's root is not read."""
        self.url = url
        self.storage_options = storage_options
        self.cache_dir = cache_dir
        self.verify = verify
        self.fast = fast
        self.store: CacheStore = open_cache(url, storage_options)
        self._opened_in = os.getpid()
        if planned is not None:
            self.manifest, planned_rows = planned
        else:
            self.manifest = self.store.read_manifest()
        if manifest is not None:
            pinned = Manifest.from_dict({k: v for k, v in manifest.items() if k != "url"}, url)
            why = manifest_mismatch(self.manifest, pinned)
            if why:
                raise CacheFormatError(f"{url}: the store's content is not the recorded manifest's ({why})")
            if pinned.format_version >= 3 and (pinned.index is None and pinned.parts):
                raise CacheFormatError(f"{url}: the recorded manifest lists parts but no index")
            self.manifest = pinned
        if expect:
            why = manifest_mismatch(self.manifest, dict(self.manifest, **expect))
            if why:
                raise CacheFormatError(f"{url}: cache does not match what this run expects ({why})")
        self.entries: list[PartEntry] = list(self.manifest.parts)
        self.parts = [p.name for p in self.entries]
        counts = np.array([p.samples for p in self.entries], dtype=np.int64)
        self.part_start = np.concatenate([[0], np.cumsum(counts)])
        self.layers = list(self.manifest.layers)
        self.dtype = self.manifest.dtype
        self.storage = self.manifest.storage
        self._state: _ProcessState | None = None  # opened lazily in the process that reads
        # v2: one read of the consolidated per-sample index (or the rows listed from an unconsolidated
        # store's commit records); v1: every part's offsets and sample ids, part by part
        if manifest is not None and self.manifest.format_version >= 3 and self.manifest.index is not None:
            key = self.manifest.index["key"]
            if key not in {self.store.index_key(n) for n in self.store.index_keys()}:
                raise CacheFormatError(f"{url}: the recorded manifest's index {key} is no longer in the store (it "
                                       "was rebuilt for other input since): rerun the cache stage")
        index = planned_rows if planned is not None else self.store.open_index(self.manifest)
        self._keys = None  # per part, uint64 [n, 2] content keys (v3); None for older stores
        if index is not None:
            self._offsets, self._ids, self._keys = split_index(index, self.entries, url)
        else:
            self._offsets = [self.read_array(p, "offsets", 0, e.samples + 1) for p, e in enumerate(self.entries)]
            self._ids = [self.read_array(p, "sample_id", 0, e.samples) for p, e in enumerate(self.entries)]
            for e, o in zip(self.entries, self._offsets):  # sample lengths size every read: they must tile the part
                if e.samples and (o[0] != 0 or o[-1] != e.tokens or (np.diff(o) < 1).any()):
                    raise CacheFormatError(f"{url}: parts/{e.name}: offsets do not tile its {e.tokens} tokens")

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_state"] = None
        return state

    def __len__(self) -> int:
        return int(self.part_start[-1])

    def _process_state(self) -> _ProcessState:
        pid = os.getpid()
        if self._state is None or self._state.pid != pid:
            mirrored = bool(self.cache_dir) and self.store.kind == "zarr" and self.fast and is_remote(self.url)
            files = ByteRanges(self.url, self.storage_options, None if mirrored else self.cache_dir,
                               connections=self.read_ahead)
            # one mirror directory per content (naming.store_key): part names come from the samples'
            # tokens alone, so stores of other targets, layers or dtypes reuse them
            mirror = (PartMirror(files, os.path.join(self.cache_dir, store_key(self.manifest.to_dict())), self.mirror_bytes,
                                 self.read_ahead) if mirrored else None)
            # a forked process (a DataLoader worker) opens the store again: zarr-python's and s3fs's
            # clients belong to the event loop of the process that made them
            store = self.store if pid == self._opened_in else open_cache(self.url, self.storage_options)
            self._state = _ProcessState(pid, store, files,
                                        ShardReader(files, self.verify, check_threads=self.check_threads),
                                        BoundedCache(self.LAYOUT_BYTES), mirror,
                                        mirror and ShardReader(mirror.local, self.verify, check_threads=self.check_threads))
        return self._state

    def lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(o) for o in self._offsets]) if self._offsets else np.zeros(0, np.int64)

    def sample_ids(self) -> np.ndarray:
        return np.concatenate(self._ids) if self._ids else np.zeros(0, np.uint64)

    def keys(self) -> np.ndarray | None:
        """uint64 [samples, 2]: every sample's content key (format.sample_key), in store order; None
        for a store written before format v3."""
        if self._keys is None:
            return None
        return np.concatenate(self._keys) if self._keys else np.zeros((0, 2), np.uint64)

    # ---- one part's rows (what derive, verify and convert need of a part) ------------------------
    def part_offsets(self, part: int) -> np.ndarray:
        """int64 [n + 1]: the token offsets of part `part`'s samples."""
        return self._offsets[part]

    def part_sample_ids(self, part: int) -> np.ndarray:
        return self._ids[part]

    def part_keys(self, part: int) -> np.ndarray:
        """uint64 [n, 2]: the content keys of part `part`'s samples: the index's (v3), else computed
        from the part's token ids and loss mask."""
        if self._keys is not None:
            return self._keys[part]
        tokens = int(self._offsets[part][-1])
        return sample_keys(self.read_array(part, "input_ids", 0, tokens), self.read_array(part, "loss_mask", 0, tokens),
                           np.diff(self._offsets[part]))

    def shard_reader(self) -> "ShardReader":
        """This process's shard reader (verify turns on its strict checks)."""
        return self._process_state().shards

    def array_layout(self, part: int, name: str) -> ArrayLayout | None:
        """The fast path's layout of one array of one part (None: read through the library)."""
        return self._layout(part, name)

    def sample_id(self, index: int) -> int:
        part, _, _ = self.locate(index)
        return int(self._ids[part][index - int(self.part_start[part])])

    def locate(self, index: int) -> tuple[int, int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range (store has {len(self)})")
        part = int(np.searchsorted(self.part_start, index, side="right") - 1)
        local = index - int(self.part_start[part])
        offsets = self._offsets[part]
        return part, int(offsets[local]), int(offsets[local + 1])

    def _expected(self, part: int, name: str) -> tuple[np.dtype, tuple]:
        e, m = self.entries[part], self.manifest
        return array_shape(name, e.samples, e.tokens, m.hidden_size, m.dtype)

    LAYOUT_BYTES = 16 << 20

    def _layout(self, part: int, name: str) -> ArrayLayout | None:
        state = self._process_state()
        store, layouts = state.store, state.layouts
        path = f"parts/{self.parts[part]}/{name}"
        layout = layouts.get(path, _UNKNOWN)
        if layout is not _UNKNOWN:
            return layout
        layout = store.layout(self.entries[part], name) if self.fast else None
        if layout is None:  # read through the library: what the array declares is checked all the same
            self._check_declared(part, name, *store.declared(self.entries[part], name))
        else:
            self._check_layout(part, name, layout)
        layouts[path] = layout
        return layout

    def _mirrored_layout(self, part: int, name: str) -> ArrayLayout | None:
        """The layout of an array from the zarr.json the mirror holds or fetched (checked as the
        store's would be)."""
        state = self._process_state()
        layouts, mirror = state.layouts, state.mirror
        path = f"parts/{self.parts[part]}/{name}"
        layout = layouts.get(("mirror", path), _UNKNOWN)
        if layout is not _UNKNOWN:
            return layout
        try:
            layout = parse_layout(path, json.loads(mirror.meta(self.parts[part], name)))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CacheFormatError(f"{self.url}: {path}/zarr.json: unreadable ({e.__class__.__name__}: {e})") from None
        if layout is not None:
            self._check_layout(part, name, layout)
        layouts[("mirror", path)] = layout
        return layout

    def _check_layout(self, part: int, name: str, layout: ArrayLayout) -> None:
        """What a fast-path layout declares, checked against the manifest before anything is sized by it."""
        self._check_declared(part, name, layout.dtype, tuple(layout.shape))
        c = layout.chunk_rows
        if not (isinstance(c, int) and c >= 1 and (layout.n_chunks - 1) * c < max(layout.shape[0], 1)
                <= layout.n_chunks * c) or (layout.table is not None and layout.table.shape != (layout.n_chunks, 2)):
            raise CacheFormatError(f"{self.url}: parts/{self.parts[part]}/{name}: chunking ({layout.n_chunks} chunks "
                                   f"of {c} rows) does not cover its {layout.shape[0]} rows")

    def _check_declared(self, part: int, name: str, dtype, shape: tuple) -> None:
        """A part's arrays are sized by what the manifest says, never by what they declare themselves."""
        want_dtype, want_shape = self._expected(part, name)
        if np.dtype(dtype).newbyteorder("=") != want_dtype or tuple(shape) != want_shape:
            raise CacheFormatError(f"{self.url}: parts/{self.parts[part]}/{name}: declares {np.dtype(dtype).str} "
                                   f"{list(shape)}; the manifest makes it {want_dtype.str} {list(want_shape)}")

    @naming_the_store
    def read_array(self, part: int, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of one array of one part (into `out` when given)."""
        state = self._process_state()
        store, shards = state.store, state.shards
        layout = self._layout(part, name)
        if layout is not None:
            if stop > layout.shape[0]:
                raise CacheFormatError(f"{layout.name or layout.key}: rows {start}..{stop} past its {layout.shape[0]} rows")
            return shards.read_rows(layout, start, stop, out)
        values = store.read_slow(self.entries[part], name, start, stop)
        if len(values) != stop - start:
            raise CacheFormatError(f"{self.url}: parts/{self.parts[part]}/{name}: rows {start}..{stop} past its end")
        if out is None:
            return values
        out[...] = values
        return out

    def read(self, index: int, layers: list[int] | None = None, fields=("input_ids", "loss_mask", "hidden",
                                                                      "last_hidden")) -> dict:
        """Raw stored arrays of one sample: bits stay bits (see format.decode_hidden)."""
        part, start, stop = self.locate(index)
        layers = self.layers if layers is None else layers
        missing = [i for i in layers if i not in self.layers]
        if missing:
            raise CacheFormatError(f"layers {missing} are not in this cache (cached layers: {self.layers})")
        keys = [f for f in ("input_ids", "loss_mask") if f in fields]
        arrays = list(keys)
        names = ([(i, i) for i in layers] if "hidden" in fields else []) + \
                ([("last", "last")] if "last_hidden" in fields else [])
        for key, layer in names:
            arrays.append(hidden_name(layer))
            if self.dtype != "bfloat16":
                arrays.append(scale_name(layer))
        with self.checked():
            values = dict(zip(arrays, self.read_arrays([(part, a, start, stop, None) for a in arrays])))
        out: dict = {k: values[k] for k in keys}
        for key, layer in names:
            out[key] = (values[hidden_name(layer)], values.get(scale_name(layer)))
        return out

    def memory(self) -> dict:
        """What this process keeps of the parts it has touched (cache/bounded.py), per cache: bytes,
        entries, evictions and the bound."""
        state = self._process_state()
        store = state.store
        caches = {"layouts": state.layouts, "shard_indexes": state.shards.tables}
        if state.mirrored is not None:
            caches["mirrored_shard_indexes"] = state.mirrored.tables
        if isinstance(getattr(store, "tables", None), BoundedCache):
            caches["hdf5_chunk_tables"] = store.tables
        return {name: {"bytes": c.bytes, "entries": len(c), "evictions": c.evictions, "max_bytes": c.max_bytes}
                for name, c in caches.items()}

    def set_check_threads(self, n: int) -> None:
        """Threads checking crc32c of local reads from now on (0: in the reading thread)."""
        self.check_threads = n
        if self._state is not None:  # the open-time reads already made this process's shard reader
            for shards in (self._state.shards, self._state.mirrored):
                if shards is not None:
                    shards.set_check_threads(n)

    def set_read_ahead(self, requests: int, range_bytes: int | None = None) -> None:
        """Requests in flight (and the bytes of each) for remote reads from now on."""
        if requests < 1 or (range_bytes is not None and range_bytes < 1):
            raise ValueError(f"read_ahead must be >= 1 request and range_bytes >= 1 (got {requests}, {range_bytes})")
        grow = requests > self.read_ahead
        self.read_ahead = requests
        self.range_bytes = range_bytes or self.range_bytes
        if grow and self._state is not None and self._state[2].remote:
            self._state = None  # a new client, with a connection pool that large, on the next read

    @naming_the_store
    def read_arrays(self, requests: list[tuple]) -> list[np.ndarray]:
        """read_array for each (part, name, start, stop, out) of `requests`. On a remote store the
        byte ranges of all of them are fetched with up to `read_ahead` requests in flight."""
        state = self._process_state()
        files, shards, mirror = state.files, state.shards, state.mirror
        direct = False
        if mirror is not None:
            wanted = list(dict.fromkeys((self.parts[r[0]], r[1]) for r in requests))
            if mirror.begun or all(mirror.ready(*w) for w in wanted):
                return self._read_mirrored(requests, wanted)
            # this process's first read: from the store, while its arrays download; the layouts come
            # from the zarr.json the mirror fetches for itself (checked first), each array's rows in one range
            for part, name, *_ in requests:
                self._mirrored_layout(part, name)
            mirror.start(wanted)
            direct = True
        if not files.remote or self.read_ahead <= 1:
            return [self.read_array(*r) for r in requests]
        results: list = [None] * len(requests)
        fast = []
        for i, (part, name, start, stop, out) in enumerate(requests):
            layout = self._mirrored_layout(part, name) if direct else self._layout(part, name)
            if layout is None:
                results[i] = self.read_array(part, name, start, stop, out)
                continue
            if stop > layout.shape[0]:
                raise CacheFormatError(f"{layout.name or layout.key}: rows {start}..{stop} past its {layout.shape[0]} rows")
            fast.append((i, (layout, start, stop, out)))
        got = shards.read_rows_many([r for _, r in fast], self.read_ahead,
                                    max(self.range_bytes, MIRROR_RANGE_BYTES) if direct else self.range_bytes)
        for (i, _), values in zip(fast, got):
            results[i] = values
        return results

    def _read_mirrored(self, requests: list[tuple], wanted: list[tuple[str, str]]) -> list[np.ndarray]:
        """read_arrays through the part mirror: the arrays downloaded where they are not yet, then
        read from local disk (an array whose layout the fast path does not know: from the store)."""
        state = self._process_state()
        mirror, local = state.mirror, state.mirrored
        for part, name, *_ in requests:  # each array's zarr.json checked against the manifest before
            self._mirrored_layout(part, name)  # the mirror sizes a download by it
        mirror.ensure(wanted)
        results = []
        for part, name, start, stop, out in requests:
            layout = self._mirrored_layout(part, name)
            if layout is None:
                results.append(self.read_array(part, name, start, stop, out))
                continue
            if stop > layout.shape[0]:
                raise CacheFormatError(f"{self.url}: parts/{self.parts[part]}/{name}: rows {start}..{stop} past "
                                       f"its {layout.shape[0]} rows")
            try:
                results.append(local.read_rows(layout, start, stop, out))
            except FileNotFoundError:  # dropped by another process's bound since: download it again
                mirror.ensure([(self.parts[part], name)])
                results.append(local.read_rows(layout, start, stop, out))
        return results

    @contextlib.contextmanager
    def checked(self):
        """A block of reads whose checksums run alongside the next reads and are all settled (a
        ChecksumError raised) when the block exits; arrays read inside are not to be used before."""
        try:
            with self._checks():
                yield
        except CacheFormatError as e:
            raise named(e, self.url) from None

    def _checks(self):
        state = self._process_state()
        if state.mirrored is None:
            return state.shards.deferred()
        stack = contextlib.ExitStack()
        stack.enter_context(state.shards.deferred())
        stack.enter_context(state.mirrored.deferred())
        return stack
