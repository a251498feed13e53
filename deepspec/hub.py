"""The Hugging Face hub's offline switch, as the user's environment sets it (stages never set it).

`make repro` / `make test` default it to on (the embedded default needs no hub); a `dvc repro` of an
`hf:` source runs with whatever the shell exports. Errors about a missing model or dataset end with
`offline_hint()`, so the fix (turn offline off, log in, fix the id) is in the message.
"""
from __future__ import annotations

import os

OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def offline_hint() -> str:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        set_by = next((f"{v}={os.environ[v]}" for v in OFFLINE_VARS[:2] if os.environ.get(v)), "HF_HUB_OFFLINE")
        return (f"offline mode is on ({set_by}): only the local hub cache {constants.HF_HUB_CACHE} was searched. "
                "To download, turn it off: `HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0 dvc repro` (make repro "
                "defaults both to 1; `make repro HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0`), and set HF_TOKEN "
                "for a gated or private repo")
    return (f"offline mode is off: the hub at {constants.ENDPOINT} was asked. Check the id and revision, the "
            "network, and HF_TOKEN for a gated or private repo (or put the files in the hub cache "
            f"{constants.HF_HUB_CACHE} and set HF_HUB_OFFLINE=1)")
