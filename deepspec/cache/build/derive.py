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

import logging
import os
import shutil
import time
from dataclasses import dataclass, field

from deepspec.cache.build.derive_source import Source, links_only
from deepspec.cache.spec.format import FORMAT, FORMAT_VERSION, READ_VERSIONS, CacheFormatError, bytes_per_token, part_name
from deepspec.cache.spec.manifest import manifest_mismatch
from deepspec.cache.storage.urls import is_remote, local_path
from deepspec.cache.storage.naming import list_stores, store_key
from deepspec.io import fsync_path
from deepspec.cache.backends.readers import open_cache
from deepspec.cache.write.writer import CacheWriter

log = logging.getLogger(__name__)

STAGING, OLD = ".derive", ".old"  # suffixes of the siblings of a local store during an in-place derive


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


def provenance(url: str, src: dict) -> dict:
    return {"url": url, "store": store_key(src), "layers": list(src["layers"]), "dtype": src["dtype"],
            "codec": src["codec"]}


def _read_manifest(url: str, storage_options: dict | None) -> dict | None:
    try:
        return open_cache(url, storage_options).read_manifest().to_dict()
    except (CacheFormatError, FileNotFoundError, OSError, ValueError):
        return None


# ---- the cache stage's side ----------------------------------------------------------------------

@dataclass
class Derivation:
    """What build_cache does: write the store at `url` (through `write_url`: the url itself, or a
    staging sibling swapped in by `finish`), taking parts from `source` where it can. Rank 0 decides
    (`prepare`); every other rank of a multi-rank build follows its decision (`follow`), and only
    rank 0, the `lead`, swaps a staging store into place."""
    url: str
    write_url: str
    source: Source | None = None
    reason: str | None = None
    started: float = field(default_factory=time.time)
    lead: bool = True

    @property
    def plan(self) -> tuple[str, str | None]:
        """What another rank needs to follow this derivation: (write_url, source url or None)."""
        return self.write_url, self.source.url if self.source else None

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
        if not self.staging or not self.lead:
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

    def report(self, parts_computed: int, parts_derived: int) -> dict:
        """`parts_computed` / `parts_derived`: summed over every rank of the build."""
        out = {"source": self.source.url if self.source else None, "parts_derived": parts_derived,
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


def follow(url: str, plan: tuple[str, str | None], storage_options: dict | None, want: dict) -> Derivation:
    """A rank > 0's side of rank 0's derivation (`Derivation.plan`): it writes into the same store and
    reads derivable parts from the same source (unleased: rank 0 holds the lease of a source it replaces)."""
    write_url, source_url = plan
    want = dict(want, format=FORMAT, format_version=FORMAT_VERSION)
    source = Source(source_url, storage_options, want) if source_url else None
    return Derivation(url, write_url, source, lead=False)


def prepare(cfg, want: dict, url: str, also: tuple[str, ...] = ()) -> Derivation:
    """Decide where the store `want` at `url` comes from: a source it can be derived from (the store
    at a local `url` when its content differs, `cache.derive_from`, or another store of the lake),
    or the target alone (`reason` says why). `also`: other local stores to derive from when the one at
    a local `url` cannot serve (none, or one of content it cannot be derived from), the first that
    can (the project's other store: the cache stage's and a read-through run's). Rank 0 decides;
    the other ranks `follow`."""
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
        return _from_other(url, also, so, want) or _computed(url, remote, f"{url}: no store to derive from")
    if manifest_mismatch(src, want) is None:
        drop_staging(url)  # the store already has this content: an ordinary (resumed or changed-input) build
        return Derivation(url, url)
    why = why_not(src, want)
    if why:
        drop_staging(url)
        return _from_other(url, also, so, want) or _computed(url, remote, f"{url}: {why}")
    staging = local_path(url + STAGING)
    if staging.exists() and _read_manifest(str(staging), so) is None:
        shutil.rmtree(staging)  # a derive killed before its first manifest: nothing to resume
    return Derivation(url, url + STAGING, Source(url, so, want, lease=True))


def _from_other(url: str, also: tuple[str, ...], so: dict, want: dict) -> Derivation | None:
    """A derivation of the store at `url` from the first of the local stores `also` it can come from."""
    for other in also:
        if os.path.abspath(local_path(other)) == os.path.abspath(local_path(url)):
            continue
        src = _read_manifest(other, so)
        if src is not None and src.get("format") == FORMAT and why_not(src, want) is None:
            return Derivation(url, url, Source(other, so, want))
    return None


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
