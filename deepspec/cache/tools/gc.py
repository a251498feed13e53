"""`deepspec cache gc URL --keep MANIFEST...`: reclaim the parts of a store that no kept manifest lists.

A local store sheds the parts its new root no longer lists when the cache stage consolidates. A store
on S3 keeps them (docs/cache-format.md §7): another workspace's manifest (another branch, a teammate's
experiment) may still list them, and whether it does is known to the people who keep those
manifests, not to the store. This tool makes that decision explicit: the store's own root and every
manifest given with `--keep` (a `data/cache/manifest.json` of each workspace or commit that should
stay readable, e.g. `git show <rev>:data/cache/manifest.json > m.json`) are kept; every other
committed part, and every index object none of them names, is listed, and with `delete=True`
deleted, under the store's lease (no cache stage writes meanwhile).

The lease is taken *before* the root is read: a cache stage that committed parts and switched the
root to them between gc's read and its lease would otherwise have those parts deleted (and on S3
every reader then fails on them). A dry run takes no lease, so what it lists can be stale.
"""
from __future__ import annotations

import json
import logging

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.write.lease import acquire_waiting
from deepspec.cache.spec.manifest import Manifest
from deepspec.cache.backends.writers import open_for_write
from deepspec.cache.backends.readers import open_cache

log = logging.getLogger(__name__)


def _kept_manifest(path: str, url: str, storage_options: dict | None) -> Manifest:
    import fsspec

    try:
        with fsspec.open(path, "rb", **({} if "://" not in path else (storage_options or {}))) as f:
            raw = json.loads(f.read())
    except FileNotFoundError:
        raise CacheFormatError(f"--keep {path}: no such manifest") from None
    except ValueError:
        raise CacheFormatError(f"--keep {path}: not JSON") from None
    if not isinstance(raw, dict):
        raise CacheFormatError(f"--keep {path}: not a manifest")
    named = raw.get("url")
    if named is not None and str(named).rstrip("/") != url.rstrip("/"):
        raise CacheFormatError(f"--keep {path}: a manifest of {named}, not of {url}")
    return Manifest.from_dict(raw, f"--keep {path}")


def collect(url: str, keep: list[str], storage_options: dict | None = None, delete: bool = False,
            wait: float = 0.0) -> dict:
    """The committed parts and index objects of `url` that neither its root nor any `keep` manifest
    lists; deleted when `delete`, under the store's lease, waited for up to `wait` seconds (a cache
    stage holds it for minutes). Else a dry run: no lease, so a cache stage writing meanwhile can
    make its list stale. Returns what was found (and removed)."""
    kept = [_kept_manifest(path, url, storage_options) for path in keep]  # a bad --keep fails before any wait
    open_cache(url, storage_options)  # a path with no store fails here: taking a lease would create its directory
    lease = acquire_waiting(url, storage_options, wait) if delete else None
    try:
        # everything that decides what is deleted is read under the lease: the root a writer switched
        # while gc waited lists the parts it just committed
        root = open_cache(url, storage_options).read_manifest()
        manifests = [root] + kept
        for m, path in zip(kept, keep):
            if m.storage != root.storage:
                raise CacheFormatError(f"--keep {path}: a {m.storage} manifest; {url} is a {root.storage} store")
        listed = {p.name for m in manifests for p in m.parts}
        indexes = {m.index["key"] for m in manifests if m.index}
        writable = open_for_write(url, root.storage, storage_options)
        committed = set(writable.committed_parts())
        unlisted = sorted(committed - listed)
        stale_indexes = sorted(n for n in writable.index_keys() if writable.index_key(n) not in indexes)
        missing = sorted(listed - committed)
        if delete:
            for name in unlisted:
                lease.check()
                writable.delete_part(name)
            for name in stale_indexes:
                lease.check()
                writable.delete_index(name)
            if unlisted or stale_indexes:
                log.info("%s: deleted %d unlisted parts and %d index objects", url, len(unlisted), len(stale_indexes))
    finally:
        if lease is not None:
            lease.release()
    out = {"url": url, "kept_manifests": len(manifests), "parts_committed": len(committed),
           "parts_listed": len(listed & committed), "unlisted_parts": unlisted, "unlisted_indexes": stale_indexes,
           "listed_but_missing": missing, "deleted": delete}
    if not delete:
        out["note"] = "dry run, no lease taken: a cache stage writing meanwhile can make this list stale"
    return out
