"""Turn the uncompressed arrays of a local Zarr store back into the chunk layout written before format
v4 (each chunk followed by its crc32c, the codec chain ending in crc32c, no crc32c table): the
layout a v3 writer left, and a v4 store derived from a v3 one still holds (hard-linked arrays), so
the reader's path for it is tested with the same damage as v4's."""
import json
from pathlib import Path

import numpy as np
from crc32c import crc32c

from deepspec.cache.spec.format import CHUNK_CRC32C


def to_trailer_layout(url: str) -> int:
    """Rewrite every table-layout array under `url`; returns how many were rewritten."""
    done = 0
    for meta_path in sorted(Path(url).rglob("zarr.json")):
        meta = json.loads(meta_path.read_text())
        if meta.get("node_type") != "array" or (meta.get("attributes") or {}).get(CHUNK_CRC32C) != "table":
            continue
        cfg = meta["codecs"][0]["configuration"]
        n = meta["chunk_grid"]["configuration"]["chunk_shape"][0] // cfg["chunk_shape"][0]
        shard = meta_path.parent / "c" / "/".join("0" for _ in meta["shape"])
        raw = shard.read_bytes()
        index = np.frombuffer(raw[-(16 * n + 4):-4], dtype="<u8").reshape(n, 2)
        table = np.frombuffer(raw[-(20 * n + 8):-(16 * n + 8)], dtype="<u4")
        out, new_index = bytearray(), np.empty((n, 2), dtype="<u8")
        for c in range(n):
            off, size = int(index[c, 0]), int(index[c, 1])
            new_index[c] = (len(out), size + 4)
            out += raw[off:off + size] + int(table[c]).to_bytes(4, "little")
        out += new_index.tobytes() + crc32c(new_index.tobytes()).to_bytes(4, "little")
        shard.write_bytes(bytes(out))
        cfg["codecs"].append({"name": "crc32c"})
        del meta["attributes"][CHUNK_CRC32C]
        meta_path.write_text(json.dumps(meta))
        done += 1
    return done


def to_v3_store(url: str) -> None:
    """A local v4 Zarr store made into the v3 store a v3 writer would have left for the same input:
    the same parts, names and index, each chunk followed by its crc32c, format_version 3."""
    to_trailer_layout(url)
    root = Path(url) / "zarr.json"
    meta = json.loads(root.read_text())
    meta["attributes"]["format_version"] = 3
    root.write_text(json.dumps(meta))
