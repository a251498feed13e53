"""Store naming in a lake (docs/cache-format.md §9): a store's key from its content, the store a
cache.url names, the stores a lake holds, and the store the cache stage recorded for `train`."""
from __future__ import annotations

from pathlib import Path

from deepspec.cache.spec.format import CONTENT_KEYS, FORMAT, FORMAT_VERSION, CacheFormatError
from deepspec.cache.storage.urls import is_remote, storage_options_for


# ---- store naming (docs/cache-format.md §9) ----------------------------------------------------

def content_of(manifest: dict) -> dict:
    """The fields that decide a store's content (format.CONTENT_KEYS), as manifest_mismatch compares
    them: the target by its hashes and shape (its `id` is derived from those)."""
    content = {k: manifest.get(k) for k in CONTENT_KEYS if k != "compute"}
    if manifest.get("compute"):  # absent in stores written before it was recorded: they keep their names
        content["compute"] = manifest["compute"]
    content["format_version"] = manifest.get("format_version", FORMAT_VERSION)
    content["target"] = {k: v for k, v in sorted((manifest.get("target") or {}).items()) if k != "id"}
    if manifest.get("storage", "zarr") != "zarr":  # absent for Zarr, so Zarr stores keep their names
        content["storage"] = manifest["storage"]
    return content


def store_key(manifest: dict) -> str:
    """The name of the store for this content inside a lake: readable fields, then a hash of all
    content fields, e.g. `3f9a2c1b7d4e5f60-L1.9.17.25.33-bf16-5d41402abc4b` (`emb` = layer -1;
    `-zstd`/`-lz4` after the dtype when a codec is set). Equal content <=> equal key."""
    import re

    from deepspec.io import fingerprint

    target = re.sub(r"[^A-Za-z0-9._]+", "_", str((manifest.get("target") or {}).get("id") or "target"))
    layers = ".".join("emb" if int(i) == -1 else str(int(i)) for i in manifest["layers"])
    dtype = {"bfloat16": "bf16"}.get(manifest["dtype"], manifest["dtype"])
    codec = "" if manifest.get("codec", "none") == "none" else "-" + manifest["codec"].removeprefix("blosc-")
    storage = "-h5" if manifest.get("storage", "zarr") == "hdf5" else ""
    return f"{target}-L{layers}-{dtype}{codec}{storage}-{fingerprint(content_of(manifest))[:12]}"


def store_url(url: str, manifest: dict) -> str:
    """The store the cache stage writes for `cache.url`. A local path *is* the store (one store,
    versioned by DVC: data/cache.zarr); a remote URL names a *lake*, a prefix holding one store per
    content, `<url>/<store_key>`, so experiments with other layers/dtype/... write siblings and never
    touch a store another experiment or teammate uses."""
    if not is_remote(url):
        return url
    return f"{url.rstrip('/')}/{store_key(manifest)}"


def _root_manifest(fs, root: str) -> dict | None:
    """The manifest JSON at a store root of either backend (Zarr: root zarr.json attributes; HDF5:
    manifest.json), or None."""
    import json

    for name in ("zarr.json", "manifest.json"):
        try:
            meta = json.loads(fs.cat_file(f"{root.rstrip('/')}/{name}"))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError):
            continue
        if not isinstance(meta, dict):
            continue
        return (meta.get("attributes") or {}) if name == "zarr.json" else meta
    return None


def check_lake(url: str, storage_options: dict | None = None) -> None:
    """A lake must not itself be a store (a cache.url written before lakes existed)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options))
    attrs = _root_manifest(fs, root) or {}
    if attrs.get("format") != FORMAT:
        return
    parent = url.rstrip("/").rsplit("/", 1)[0]
    raise CacheFormatError(
        f"{url} is a cache store, but a remote cache.url names a lake: a prefix with one store per content "
        f"(docs/cache-format.md §9). Move the store to {parent}/{store_key(attrs)} and set cache.url to "
        f"{parent}, or set cache.url to a new prefix")


def list_stores(url: str, storage_options: dict | None = None) -> list[dict]:
    """The stores directly under a lake prefix: {"url", "layers", "dtype", "codec", "storage", "samples", "tokens"}."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options))
    fs.invalidate_cache(root)
    out = []
    for child in sorted(fs.ls(root, detail=False)):
        name = child.rstrip("/").rsplit("/", 1)[-1]
        attrs = _root_manifest(fs, child) or {}
        if attrs.get("format") != FORMAT:
            continue
        out.append({"url": f"{url.rstrip('/')}/{name}", "layers": attrs.get("layers"), "dtype": attrs.get("dtype"),
                    "codec": attrs.get("codec"), "storage": attrs.get("storage", "zarr"), "samples": attrs.get("num_samples"),
                    "tokens": attrs.get("num_tokens"), "target": (attrs.get("target") or {}).get("id")})
    return out


def read_through_url(cache_url: str) -> str:
    """The cache.url a read-through run (train.capture: read-through) plans and fills: for a local
    cache.url a store beside it, `<name>-read-through<suffix>` (data/cache-read-through.zarr), which
    the train stage finishes and DVC records as its output, while the cache stage records `cache.url`
    as the run leaves it; each path is then recorded by the stage that finished it, and `dvc status`
    stays clean. A remote lake is its own (its stores are named by content, not versioned by DVC)."""
    if is_remote(cache_url):
        return cache_url
    path = Path(cache_url.rstrip("/"))
    return str(path.with_name(f"{path.stem}-read-through{path.suffix}"))


def built_store_url(cache_url: str, manifest_path: str | Path = "data/cache/manifest.json") -> str:
    """The store the cache stage wrote, which `train` reads: the URL its manifest records (a DVC
    dependency of train); without one (a stage run by hand), a local cache.url is the store itself."""
    import json

    path = Path(manifest_path)
    if not path.exists():
        if not is_remote(cache_url):
            return cache_url
        raise CacheFormatError(f"{path}: missing; it names the store inside the lake {cache_url} "
                               "(run the cache stage first: dvc repro cache)")
    try:
        return json.loads(path.read_text())["url"]
    except (ValueError, KeyError):
        raise CacheFormatError(f"{path}: no store url recorded (rerun the cache stage)") from None


def built_manifest(manifest_path: str | Path = "data/cache/manifest.json") -> dict | None:
    """The manifest the cache stage recorded for its store (parts, index and their checksums), or
    None where the stage has not run (a store built by hand). `train` reads exactly these parts
    (CacheReader's `manifest`): a store on S3 is a pool another experiment may have switched since."""
    import json

    path = Path(manifest_path)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise CacheFormatError(f"{path}: not valid JSON (rerun the cache stage)") from None
