"""Where a store lives: local paths and fsspec URLs, the options a remote filesystem is opened with,
and the rule that a local store's files lie inside it (no symlink out)."""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from deepspec.cache.spec.format import CacheFormatError


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def storage_options_for(url: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Explicit options win; for s3 an endpoint from the environment (AWS_ENDPOINT_URL) is honoured.
    Credentials are botocore's to find, instance-profile credentials (the EC2 metadata service) included:
    nothing here changes the process's environment (off EC2, `AWS_EC2_METADATA_DISABLED=true` in the
    environment skips that probe, which is the user's choice to make)."""
    opts = dict(options or {})
    if url.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_url" not in opts and "endpoint_url" not in opts.get("client_kwargs", {}):
            opts["endpoint_url"] = endpoint
    return opts


def local_path(url: str) -> Path:
    return Path(url.removeprefix("file://"))


@functools.lru_cache(maxsize=256)
def link_roots(root: str | Path) -> tuple[str, ...]:
    """Where a local store's files may resolve to: the store itself and, for a store checked out by
    DVC with `cache.type: symlink`, the DVC cache of the repository it lies in (`.dvc/cache`)."""
    real = os.path.realpath(root)
    roots = [real]
    for parent in Path(real).parents:
        if (parent / ".dvc").is_dir():
            roots.append(os.path.realpath(parent / ".dvc" / "cache"))
            break
    return tuple(roots)


def inside_store(root: str | Path, key: str, roots: tuple[str, ...] | None = None) -> str:
    """The local path of store key `key`, refused (CacheFormatError) when a symlink on the way takes
    it outside the store (a store written by someone else must not make deepspec read other files)."""
    path = os.path.join(root, key)
    real = os.path.realpath(path)
    if real != path and not any(real == r or real.startswith(r + os.sep) for r in roots or link_roots(root)):
        raise CacheFormatError(f"{root}: {key} is a link to {real}, outside the store; a store's files must "
                               "lie inside it (or in the DVC cache of its repository)")
    return path
