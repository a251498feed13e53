"""Opening a cache store on local disk or any fsspec URL (s3://...), and its part listing."""
from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

import zarr
from zarr.storage import LocalStore

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


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the entries created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under `path`, deepest first, then `path` itself. Done once
    per part after all its files are written: the kernel writes them back together, so this costs
    about one journal commit instead of one per file."""
    for dirpath, _, files in os.walk(path, topdown=False):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def _durable_replace(path: Path, data) -> None:
    tmp = path.with_suffix(f".{uuid.uuid4().hex}.partial")  # zarr's own temp-file naming
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


class DurableLocalStore(LocalStore):
    """A LocalStore whose *replacements* of an existing key (the root manifest, a part's commit
    mark) are crash-atomic and durable: temp file, fsync, rename, fsync of the directory, so a power
    loss leaves the old or the new bytes, never an empty file. New files are written as zarr-python
    writes them and made durable in one batch before their part is committed (CacheWriter.write_part)."""

    async def _set(self, key: str, value, exclusive: bool = False) -> None:
        path = self.root / key
        if exclusive or not path.exists():
            return await super()._set(key, value, exclusive=exclusive)
        if not self._is_open:
            await self._open()
        self._check_writable()
        await asyncio.to_thread(_durable_replace, path, value.as_buffer_like())


def local_path(url: str) -> Path:
    return Path(url.removeprefix("file://"))


def open_store(url: str, mode: str = "r", storage_options: dict | None = None):
    if is_remote(url):
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(url, storage_options=storage_options_for(url, storage_options),
                                    read_only=mode == "r")
    path = local_path(url)
    if mode == "r":
        if not (path / "zarr.json").exists():
            raise CacheFormatError(f"{url}: not a cache store (no zarr.json)")
        return LocalStore(path, read_only=True)
    return DurableLocalStore(path)


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
