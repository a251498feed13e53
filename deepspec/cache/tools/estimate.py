"""Cache size arithmetic: deepspec's layout next to the reference's raw layout."""
from __future__ import annotations

from deepspec.cache.spec.format import bytes_per_token


def reference_bytes_per_token(hidden_size: int, num_layers: int) -> int:
    """The reference's raw shards: int32 ids + uint8 attention mask + uint8 loss mask + bf16 rows."""
    return 4 + 1 + 1 + num_layers * hidden_size * 2 + hidden_size * 2


def estimate(hidden_size: int, layers: list[int], tokens: int, dtype: str = "bfloat16",
             chunk_tokens: int = 64) -> dict:
    per_token = bytes_per_token(hidden_size, len(layers), dtype)
    # each inner chunk of every hidden array carries a 4-byte crc32c and a 16-byte index entry
    overhead = (len(layers) + 1) * 20 / chunk_tokens
    ref = reference_bytes_per_token(hidden_size, len(layers))
    return {
        "hidden_size": hidden_size,
        "layers": list(layers),
        "tokens": tokens,
        "dtype": dtype,
        "reference_bytes_per_token": ref,
        "bytes_per_token": round(per_token + overhead, 2),
        "total_bytes": round((per_token + overhead) * tokens),
        "reference_total_bytes": ref * tokens,
        "ratio_vs_reference": round((per_token + overhead) / ref, 4),
    }
