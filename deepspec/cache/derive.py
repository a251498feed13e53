"""Deriving a store from another one instead of running the target (docs/cache-format.md §12).

A store keeps every layer of a part in its own shard file, so a store with fewer layers is a
selection of files, and an fp8 (or recompressed) store is a re-encoding of the stored bfloat16 bits:
neither needs the target. The cache stage asks `prepare` for a source before it computes anything;
a part of the wanted store is taken from the source when the source holds a part of the same name
(parts are named by their content: the keys and ids of their samples, in order), else it is
computed as usual, so the result is the store a from-scratch build gives. Derived parts go through the ordinary writer
(create, then commit, then manifest), so a derive resumes after a kill like a build.

- same dtype, codec and chunking: every wanted array is linked (local: hardlink, else reflink, else
  a copy; S3: a server-side copy, created only if absent) — no byte is rewritten, and no existing
  file is ever opened for writing, so an object in DVC's cache that the workspace shares is safe;
- another dtype/codec/chunking: part by part, read (checksums on), re-encoded, written.

A local `cache.url` is one store that DVC versions: when its content changes, the derive writes
the new store next to it (`<url>.derive`), then swaps the two by renames and deletes the old one
(its previous version is in DVC's cache). A kill anywhere in between is repaired by the next run.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from deepspec.cache.format import (FORMAT, FORMAT_VERSION, READ_VERSIONS, CacheFormatError, bytes_per_token, encode_hidden,
                                   hidden_name, part_arrays, part_name, scale_name)
from deepspec.cache.lease import acquire
from deepspec.cache.reader import CacheReader
from deepspec.cache.store import (PartConflict, fsync_path, is_remote, list_stores, local_path, refused_as_existing,
                                  store_key, storage_options_for)
from deepspec.cache.stores import open_cache
from deepspec.cache.writer import CacheWriter, PartData, manifest_mismatch

log = logging.getLogger(__name__)

STAGING, OLD = ".derive", ".old"  # suffixes of the siblings of a local store during an in-place derive
FICLONE = 0x40049409  # ioctl: share the source's extents (btrfs, xfs, ...)


def why_not(src: dict, want: dict, by_name: bool = True) -> str | None:
    """Why a store with manifest `src` cannot give the store `want` describes, or None when it can.
    `by_name`: the parts are to be found by their content names (the cache stage), which stores
    written before format v3 do not have."""
    if src.get("format") != FORMAT or src.get("format_version") not in READ_VERSIONS:
        return f"not a deepspec cache of format version {' or '.join(map(str, READ_VERSIONS))}"
    if by_name and src.get("format_version", 0) < 3:
        return (f"a format v{src.get('format_version')} store: its parts are not cut and named by content, so none "
                "is a part of this build (`deepspec cache derive SRC DST` converts it by hand, part for part)")
    why = manifest_mismatch({"target": src.get("target")}, {"target": want["target"]})
    if why:
        return f"another target identity ({why})"
    if src.get("compute") != want.get("compute"):
        return f"compute: the source's states come from {src.get('compute')}, wanted {want.get('compute')}"
    if src.get("max_length") != want["max_length"]:
        return f"max_length: source has {src.get('max_length')}, wanted {want['max_length']}"
    missing = [i for i in want["layers"] if i not in (src.get("layers") or [])]
    if missing:
        return f"layers {missing} are not in the source (it has {src.get('layers')})"
    if src.get("dtype") != want["dtype"] and not (src.get("dtype") == "bfloat16" and want["dtype"] == "fp8"):
        return f"dtype: a {src.get('dtype')} source cannot give {want['dtype']} values"
    return None


def links_only(src: dict, want: dict) -> bool:
    """The wanted arrays are byte-identical files of the source: same encoding of every value, and
    both stores Zarr (an HDF5 part is one file holding every array, so it is re-encoded)."""
    return (all(src.get(k) == want[k] for k in ("dtype", "codec", "chunk_tokens"))
            and src.get("storage", "zarr") == want.get("storage", "zarr") == "zarr")


def provenance(url: str, src: dict) -> dict:
    return {"url": url, "store": store_key(src), "layers": list(src["layers"]), "dtype": src["dtype"],
            "codec": src["codec"]}


def _read_manifest(url: str, storage_options: dict | None) -> dict | None:
    try:
        return open_cache(url, storage_options).read_manifest().to_dict()
    except (CacheFormatError, FileNotFoundError, OSError, ValueError):
        return None


class Source:
    """A store parts are taken from. `part(name, samples)` is the wanted part when the source has one
    of the same composition (else None); `part_at(k, name)` is the source's k-th part, re-encoded."""

    def __init__(self, url: str, storage_options: dict | None, want: dict, lease: bool = False):
        self.url = url
        self.storage_options = storage_options
        # a local store the run will replace is leased like a writer's, so no other job writes it meanwhile
        self.lease = acquire(url, storage_options) if lease else None
        try:
            self.reader = CacheReader(url, storage_options)
        except BaseException:
            self.release()
            raise
        self.manifest = self.reader.manifest
        self.want = want
        self.link = links_only(self.manifest, want)
        self.remote = is_remote(url)
        self.by_name = {name: k for k, name in enumerate(self.reader.parts)}
        self.parts_derived = 0
        self.seconds = 0.0  # time spent deriving (reading, re-encoding, linking), in both threads
        self.methods: set[str] = set()
        self._fs = None

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def part(self, name: str, samples) -> PartData | None:
        """The planned part `name` from the source, when it holds it. A v3 part's name is a hash of
        its samples' keys and ids in order, so an equal name is an equal composition; the keys are
        compared anyway (a cheap guard against a hash collision or a damaged index)."""
        t0 = time.time()
        try:
            k = self.by_name.get(name)
            if k is None:
                return None
            want = np.array([s.key for s in samples], dtype=np.uint64).reshape(-1, 2)
            if not np.array_equal(self.reader.part_keys(k), want):
                return None
            part = self._assemble(k, name)
            self.parts_derived += 1
            return part
        finally:
            self.seconds += time.time() - t0

    def part_at(self, k: int) -> PartData:
        """The source's k-th part, named by its content (a part of a store written before v3 gets the
        v3 name of what it holds)."""
        t0 = time.time()
        try:
            r = self.reader
            part = self._assemble(k, part_name(r.part_keys(k), r.part_sample_ids(k)))
            self.parts_derived += 1
            return part
        finally:
            self.seconds += time.time() - t0

    def _assemble(self, k: int, name: str) -> PartData:
        r = self.reader
        offsets = r.part_offsets(k)
        tokens = int(offsets[-1])
        part = PartData(name=name, sample_ids=np.asarray(r.part_sample_ids(k), dtype=np.uint64),
                        keys=r.part_keys(k), lengths=np.diff(offsets).astype(np.int64),
                        input_ids=r.read_array(k, "input_ids", 0, tokens),
                        loss_mask=r.read_array(k, "loss_mask", 0, tokens))
        layers, dtype = self.want["layers"], self.want["dtype"]
        if self.link:
            # a part written before v3 has no sample_key array: the writer writes it (from `keys`)
            arrays = [a for a in part_arrays(layers, dtype) if a != "sample_key" or self.manifest.format_version >= 3]
            part.copied, part.copy = tuple(arrays), partial(self._copy, r.parts[k], arrays)
            return part
        part.batches = self._reencoded(k, tokens, [*layers, "last"], dtype)  # streamed by writer.submit
        return part

    # tokens of a part re-encoded at a time: a re-encode holds this much of a part, not the part
    REENCODE_TOKENS = 65536

    def _reencoded(self, k: int, tokens: int, keys: list, dtype: str):
        r = self.reader
        for a in range(0, max(tokens, 1), self.REENCODE_TOKENS):
            b = min(tokens, a + self.REENCODE_TOKENS)
            t0, out = time.time(), {}
            for layer in keys:
                bits = r.read_array(k, hidden_name(layer), a, b)
                if self.manifest["dtype"] == dtype:  # a codec or chunking change: the values stay as they are
                    scale = r.read_array(k, scale_name(layer), a, b) if dtype != "bfloat16" else None
                    out[layer] = (bits, scale)
                else:  # bfloat16 -> fp8: the same function of the bfloat16 values the stage applies
                    out[layer] = encode_hidden(torch.from_numpy(bits).view(torch.bfloat16), dtype)
            self.seconds += time.time() - t0
            yield out

    # ---- linking (runs on the writer's thread, between the part's creation and its commit) --------
    def _copy(self, src_part: str, arrays: list[str], writer: CacheWriter, group) -> None:
        t0 = time.time()
        keys = []
        for array in arrays:
            keys += [f"{array}/{rel}" for rel in self._files(f"parts/{src_part}/{array}")]
        for parent in sorted({a.rsplit("/", 1)[0] for a in arrays if "/" in a}):
            if self._files(f"parts/{src_part}/{parent}", "zarr.json"):  # zarr's implicit group node
                keys.append(f"{parent}/zarr.json")
        for key in keys:
            self._copy_key(f"parts/{src_part}/{key}", writer, f"{group.path}/{key}")
        self.seconds += time.time() - t0

    def _files(self, prefix: str, only: str | None = None) -> list[str]:
        """Keys under `prefix` (relative to it); with `only`, that one key if it exists."""
        if self.remote:
            fs, root = self._filesystem()
            base = f"{root}/{prefix}"
            if only:
                return [only] if fs.exists(f"{base}/{only}") else []
            return sorted(p[len(base) + 1:] for p in fs.find(base))
        base = local_path(self.url) / prefix
        if only:
            return [only] if (base / only).is_file() else []
        return sorted(str(p.relative_to(base)).replace(os.sep, "/") for p in base.rglob("*") if p.is_file())

    def _filesystem(self):
        if self._fs is None:
            import fsspec

            self._fs = fsspec.core.url_to_fs(self.url, **storage_options_for(self.url, self.storage_options))
        return self._fs

    def _copy_key(self, src_key: str, writer: CacheWriter, dst_key: str) -> None:
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        if not self.remote and not writer.remote:
            self.methods.add(link_file(local_path(self.url) / src_key, local_path(writer.url) / dst_key))
            return
        store = writer.root.store
        if (self.remote and writer.remote and self.url.startswith("s3://") and writer.url.startswith("s3://")
                and storage_options_for(self.url, self.storage_options)
                == storage_options_for(writer.url, writer.storage_options)):
            sync(_s3_copy(store, f"{self._filesystem()[1]}/{src_key}", dst_key))
            self.methods.add("s3-copy")
            return
        fs, root = self._filesystem() if self.remote else (None, None)
        data = fs.cat_file(f"{root}/{src_key}") if self.remote else (local_path(self.url) / src_key).read_bytes()
        sync(store.set(dst_key, default_buffer_prototype().buffer.from_bytes(data)))
        self.methods.add("copy")


async def _s3_copy(store, src_path: str, dst_key: str) -> None:
    """Server-side copy into a part, created only if absent (the writer's create-only rule, §7)."""
    if not store._is_open:
        await store._open()
    fs = store.fs
    src_bucket, src_name, _ = fs.split_path(src_path)
    dst_path = store._s3_path(dst_key)
    bucket, name, _ = fs.split_path(dst_path)
    try:
        await fs._call_s3("copy_object", Bucket=bucket, Key=name, CopySource={"Bucket": src_bucket, "Key": src_name},
                          IfNoneMatch="*")
    except OSError as e:
        if refused_as_existing(e):
            raise PartConflict(f"{dst_key}: another writer created this object meanwhile; not overwriting it") \
                from None
        raise
    finally:
        fs.invalidate_cache(dst_path)


def link_file(src, dst) -> str:
    """Give `dst` (new) the bytes of `src` without writing to `src`: a hardlink, else a reflink, else
    a copy. Returns which one it was."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)
        return "hardlink"
    except FileExistsError:
        raise PartConflict(f"{dst}: exists; a part is only ever created, never overwritten") from None
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
    import fcntl

    with open(src, "rb") as fin, open(dst, "xb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
            return "reflink"
        except OSError:
            shutil.copyfileobj(fin, fout, 1 << 22)
            return "copy"


# ---- the cache stage's side ----------------------------------------------------------------------

@dataclass
class Derivation:
    """What build_cache does: write the store at `url` (through `write_url`: the url itself, or a
    staging sibling swapped in by `finish`), taking parts from `source` where it can."""
    url: str
    write_url: str
    source: Source | None = None
    reason: str | None = None
    started: float = field(default_factory=time.time)

    @property
    def staging(self) -> bool:
        return self.write_url != self.url

    def manifest(self, want: dict) -> dict:
        if self.source is None:
            return want
        return dict(want, derived_from=provenance(self.source.url, self.source.manifest))

    def finish(self) -> None:
        """Swap a staging store into place (local in-place derive): rename the old store away,
        rename the new one in, delete the old. `recover` repairs a kill at any point of this."""
        if self.source is not None:
            self.source.release()
        if not self.staging:
            return
        url, old = local_path(self.url), local_path(self.url + OLD)
        parent = url.parent
        os.rename(url, old)
        fsync_path(parent)
        os.rename(local_path(self.write_url), url)
        fsync_path(parent)
        shutil.rmtree(old)

    def abort(self) -> None:
        if self.source is not None:
            self.source.release()

    def report(self, parts_computed: int) -> dict:
        out = {"source": self.source.url if self.source else None,
               "parts_derived": self.source.parts_derived if self.source else 0,
               "parts_computed": parts_computed}
        if self.source is not None:
            out["derived_from"] = provenance(self.source.url, self.source.manifest)
            out["method"] = sorted(self.source.methods) or (["re-encode"] if not self.source.link else [])
            if not self.source.link:
                out["method"] = sorted(set(out["method"]) | {"re-encode"})
            out["wall_s"] = round(self.source.seconds, 2)
        if self.reason:
            out["reason"] = self.reason
        return out


def recover(url: str) -> None:
    """Finish or undo what a killed in-place derive left next to a local store."""
    path, old = local_path(url), local_path(url + OLD)
    if old.exists() and not path.exists():  # killed between the two renames: the old store goes back
        os.rename(old, path)
        fsync_path(path.parent)
    elif old.exists():  # killed while deleting the old store: the new one is in place
        shutil.rmtree(old)


def drop_staging(url: str) -> None:
    staging = local_path(url + STAGING)
    if staging.exists():
        log.info("%s: deleting %s (an unfinished derive of other content)", url, staging)
        shutil.rmtree(staging)


def prepare(cfg, want: dict, url: str, world: int = 1) -> Derivation:
    """Decide where the store `want` at `url` comes from: a source it can be derived from (the store
    at a local `url` when its content differs, `cache.derive_from`, or another store of the lake),
    or the target alone (`reason` says why)."""
    remote = is_remote(url)
    want = dict(want, format=FORMAT, format_version=FORMAT_VERSION)
    if not remote:
        recover(url)
    choice = cfg.derive_from
    if choice and not remote and not is_remote(choice) and os.path.abspath(local_path(choice)) == \
            os.path.abspath(local_path(url)):
        choice = ""  # the store being replaced: derived next to itself, as by default
    if choice == "none":
        return _computed(url, remote, "cache.derive_from is none")
    if world > 1:
        return _computed(url, remote, "a derive runs in one process; this build has several ranks")
    so = cfg.storage_options
    if choice:
        src = _read_manifest(choice, so)
        why = "no deepspec cache there" if src is None else why_not(src, want)
        if choice.rstrip("/") == url.rstrip("/"):
            why = "it is the wanted store itself"
        if why:
            return _computed(url, remote, f"{choice}: {why}")
        if not remote:
            drop_staging(url)
        return Derivation(url, url, Source(choice, so, want))
    if remote:
        reasons, best = [], None
        try:
            stores = list_stores(cfg.url, so)
        except FileNotFoundError:  # a new lake
            stores = []
        for entry in stores:
            if entry["url"].rstrip("/") == url.rstrip("/"):
                continue
            src = _read_manifest(entry["url"], so) or {}
            why = why_not(src, want)
            if why:
                reasons.append(f"{entry['url']}: {why}")
                continue
            rank = (not links_only(src, want), -(src.get("num_samples") or 0))
            if best is None or rank < best[0]:
                best = (rank, entry["url"])
        if best is None:
            return _computed(url, remote, "; ".join(reasons) or f"no other store in the lake {cfg.url}")
        return Derivation(url, url, Source(best[1], so, want))
    src = _read_manifest(url, so)
    if src is None or src.get("format") != FORMAT:
        drop_staging(url)
        return _computed(url, remote, f"{url}: no store to derive from")
    if manifest_mismatch(src, want) is None:
        drop_staging(url)  # the store already has this content: an ordinary (resumed or changed-input) build
        return Derivation(url, url)
    why = why_not(src, want)
    if why:
        drop_staging(url)
        return _computed(url, remote, f"{url}: {why}")
    staging = local_path(url + STAGING)
    if staging.exists() and _read_manifest(str(staging), so) is None:
        shutil.rmtree(staging)  # a derive killed before its first manifest: nothing to resume
    return Derivation(url, url + STAGING, Source(url, so, want, lease=True))


def _computed(url: str, remote: bool, reason: str) -> Derivation:
    if not remote:
        drop_staging(url)
    return Derivation(url, url, reason=reason)


# ---- `deepspec cache derive SRC DST` ----------------------------------------------------------------

def derive_store(src: str, dst: str, layers: list[int] | None = None, dtype: str | None = None,
                 codec: str | None = None, chunk_tokens: int | None = None,
                 storage_options: dict | None = None) -> dict:
    """A store at `dst` with the parts and samples of `src`, holding `layers` (default: all of the
    source's) as `dtype`/`codec`/`chunk_tokens` (default: the source's). Resumable: rerun after a
    kill and it finishes what is missing (`dst` must be absent, empty, or this same derive)."""
    t0 = time.time()
    if src.rstrip("/") == dst.rstrip("/"):
        raise CacheFormatError(f"{dst}: the destination is the source")
    src_manifest = _read_manifest(src, storage_options)
    if src_manifest is None or src_manifest.get("format") != FORMAT:
        raise CacheFormatError(f"{src}: not a deepspec cache")
    want = {k: src_manifest[k] for k in ("target", "max_length", "hidden_size")}
    if src_manifest.get("compute"):
        want["compute"] = src_manifest["compute"]
    want.update(layers=list(layers if layers is not None else src_manifest["layers"]),
                dtype=dtype or src_manifest["dtype"], codec=codec or src_manifest["codec"],
                chunk_tokens=chunk_tokens or src_manifest["chunk_tokens"])
    want["bytes_per_token"] = bytes_per_token(want["hidden_size"], len(want["layers"]), want["dtype"])
    why = why_not(src_manifest, want, by_name=False)
    if why:
        raise CacheFormatError(f"{src}: cannot derive {dst} from it: {why}")
    source = Source(src, storage_options, want)
    want["derived_from"] = provenance(src, src_manifest)
    if not is_remote(dst) and local_path(dst).exists() and any(local_path(dst).iterdir()) \
            and _read_manifest(dst, storage_options) is None:
        raise CacheFormatError(f"{dst}: exists and is not a deepspec cache; refusing to write into it")
    with CacheWriter(dst, want, storage_options, prune_stale=False) as writer:
        done, order, r = writer.committed_parts(), [], source.reader
        for k in range(len(r.parts)):
            name = part_name(r.part_keys(k), r.part_sample_ids(k))
            order.append(name)
            if name not in done:
                writer.submit(source.part_at(k))
        writer.close(order=order)
    out = dict(_read_manifest(dst, storage_options))
    return {"url": dst, "source": src, "parts": len(out["parts"]), "parts_derived": source.parts_derived,
            "samples": out["num_samples"], "layers": out["layers"], "dtype": out["dtype"],
            "method": sorted(source.methods) or ["re-encode"], "wall_s": round(time.time() - t0, 2)}
