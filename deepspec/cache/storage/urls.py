"""Where a store lives: local paths and fsspec URLs, and the options a remote filesystem is opened
with. What a local store's files may be read as: door.py."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any



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
