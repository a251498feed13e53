"""Writes the golden stores under tests/data/golden/ (checked in; read by tests/cache/test_golden.py).

    python -m tests.cache.make_golden

Writes the stores of the current format version only (STORES_V4 now); the v1 stores (STORES) were
written by the v1 writer (commit 8a04f09 and before), the v2 ones (STORES_V2) by the v2 writer, the
v3 ones (STORES_V3) by the v3 writer, and none of them is ever rewritten. Rerun only when the
format version changes: the point of the fixtures is that they were written by an earlier writer,
so a reader change that misreads existing stores fails. Values come from `golden_parts()`, which
the test recomputes: numpy's PCG64 with fixed seeds, no torch randomness.
"""
import shutil
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "golden"
H = 8
LAYERS = [-1, 1]
# (store dir, storage, dtype, codec)
STORES = [("zarr-bf16", "zarr", "bfloat16", "none"), ("zarr-fp8-zstd", "zarr", "fp8", "blosc-zstd"),
          ("hdf5-bf16", "hdf5", "bfloat16", "none"), ("hdf5-fp8-zstd", "hdf5", "fp8", "blosc-zstd")]
# format version 2: consolidated manifest + index array / index.h5, commit records with lengths/ids
STORES_V2 = [("v2-zarr-bf16", "zarr", "bfloat16", "none"), ("v2-hdf5-fp8-zstd", "hdf5", "fp8", "blosc-zstd")]
# format version 3: content keys (sample_key arrays, index columns key_hi/key_lo), parts named by
# their content, the index a content-named object (index/<hash>)
STORES_V3 = [("v3-zarr-bf16", "zarr", "bfloat16", "none"), ("v3-hdf5-fp8-zstd", "hdf5", "fp8", "blosc-zstd")]
# format version 4: an uncompressed Zarr array keeps its chunks' crc32cs in a table after them
STORES_V4 = [("v4-zarr-bf16", "zarr", "bfloat16", "none"), ("v4-hdf5-fp8-zstd", "hdf5", "fp8", "blosc-zstd")]
VERSION = {**{s[0]: 1 for s in STORES}, **{s[0]: 2 for s in STORES_V2}, **{s[0]: 3 for s in STORES_V3},
           **{s[0]: 4 for s in STORES_V4}}
ALL_STORES = STORES + STORES_V2 + STORES_V3 + STORES_V4


def golden_values(seed: int, lengths: list[int]) -> dict:
    """Float32 hidden rows and token arrays of one part."""
    rng = np.random.default_rng(seed)
    t = sum(lengths)
    return {"input_ids": rng.integers(0, 50000, size=t).astype(np.int32),
            "loss_mask": rng.integers(0, 2, size=t).astype(np.uint8),
            "hidden": {k: (rng.standard_normal((t, H)) * (3.0 if k == "last" else 1.0)).astype(np.float32)
                       for k in [*LAYERS, "last"]}}


PARTS = [("p000000", 11, [5, 3]), ("p000001", 12, [6])]
SAMPLE_IDS = {"p000000": [0x0123456789ABCDEF, 0xFEDCBA9876543210], "p000001": [0x00000000000000FF]}


def golden_parts(dtype: str, named: bool = True):
    """The parts; `named` False leaves the name to the writer (v3: named by content)."""
    import torch

    from deepspec.cache.spec.format import encode_hidden
    from deepspec.cache.write.part_data import PartData

    out = []
    for name, seed, lengths in PARTS:
        v = golden_values(seed, lengths)
        out.append(PartData(name if named else None, np.array(SAMPLE_IDS[name], dtype=np.uint64),
                            np.array(lengths, dtype=np.int64),
                            v["input_ids"], v["loss_mask"],
                            {k: encode_hidden(torch.from_numpy(x), dtype) for k, x in v["hidden"].items()}))
    return out


def manifest(storage: str, dtype: str, codec: str) -> dict:
    from deepspec.cache.spec.format import bytes_per_token

    return {"target": {"id": "0123456789abcdef", "architecture": "Qwen3ForCausalLM", "hidden_size": H,
                       "num_layers": 4, "vocab_size": 50000},
            "layers": LAYERS, "dtype": dtype, "codec": codec, "max_length": 16, "chunk_tokens": 4,
            "hidden_size": H, "bytes_per_token": bytes_per_token(H, len(LAYERS), dtype), "storage": storage}


def main() -> None:
    from deepspec.cache.write.writer import CacheWriter

    from deepspec.cache.spec.format import FORMAT_VERSION

    for name, storage, dtype, codec in ALL_STORES:
        if VERSION[name] != FORMAT_VERSION:
            continue  # written by an earlier writer: never rewritten
        dst = GOLDEN / name
        shutil.rmtree(dst, ignore_errors=True)
        parts = golden_parts(dtype, named=False)
        with CacheWriter(str(dst), manifest(storage, dtype, codec)) as w:
            for part in parts:
                w.submit(part)
            w.close(consolidate=False)
            w.write_manifest([part.name for part in parts])  # in PARTS order, as a planner lists them
        size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
        print(f"{dst}: {size} bytes")


if __name__ == "__main__":
    main()
