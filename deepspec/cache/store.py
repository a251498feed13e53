"""Opening a cache store on local disk or any fsspec URL (s3://...), and its part listing."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import zarr

from deepspec.cache.format import FORMAT, FORMAT_VERSION, CacheFormatError


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def storage_options_for(url: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Explicit options win; for s3 an endpoint from the environment (AWS_ENDPOINT_URL) is honoured.
    Never let a client fall back to the instance-metadata address."""
    opts = dict(options or {})
    if url.startswith("s3://"):
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_url" not in opts and "endpoint_url" not in opts.get("client_kwargs", {}):
            opts["endpoint_url"] = endpoint
    return opts


def open_store(url: str, mode: str = "r", storage_options: dict | None = None):
    if is_remote(url):
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(url, storage_options=storage_options_for(url, storage_options),
                                    read_only=mode == "r")
    from zarr.storage import LocalStore

    path = Path(url.removeprefix("file://"))
    if mode == "r" and not (path / "zarr.json").exists():
        raise CacheFormatError(f"{url}: not a cache store (no zarr.json)")
    return LocalStore(path, read_only=mode == "r")


def open_root(url: str, mode: str = "r", storage_options: dict | None = None) -> zarr.Group:
    store = open_store(url, mode, storage_options)
    try:
        return zarr.open_group(store=store, mode="r" if mode == "r" else "a", zarr_format=3)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        raise CacheFormatError(f"{url}: not a cache store (no root group)") from None


def read_manifest(root: zarr.Group, url: str) -> dict:
    attrs = dict(root.attrs)
    if attrs.get("format") != FORMAT:
        raise CacheFormatError(f"{url}: not a deepspec cache (format attribute is {attrs.get('format')!r})")
    if attrs.get("format_version") != FORMAT_VERSION:
        raise CacheFormatError(f"{url}: format_version {attrs.get('format_version')} is not supported "
                               f"(this reader knows {FORMAT_VERSION})")
    return attrs
