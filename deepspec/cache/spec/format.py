"""The cache store's on-disk vocabulary (normative spec: docs/cache-format.md).

A store is a Zarr v3 group (its attributes are the manifest) or, with `cache.format: hdf5`, a
`manifest.json` beside one HDF5 file per part (backends/base.py, backends/hdf5/read.py). Data lives in immutable
*parts* (`parts/<name>/` or `parts/<name>.h5`), each holding one token-major CSR slice of the samples:

    offsets      int64  [n+1]    token offsets of the part's samples (offsets[0] == 0)
    sample_id    uint64 [n]      the split/regen row id (16 hex digits) as an integer (provenance)
    sample_key   uint64 [n, 2]   v3: the sample's content key, a hash of its input_ids and loss_mask
    input_ids    int32  [t]
    loss_mask    uint8  [t]
    hidden/<i>   uint16 [t, H]   bfloat16 bits        | uint8 [t, H] float8_e4m3fn bits
    last_hidden  uint16 [t, H]   (post-norm)          | uint8 [t, H]
    scale/<name> float32 [t]     per-token scale, 8-bit mode only (<name> = layer id or "last")

Zarr: every array is one shard (one file) of small inner chunks; v4 keeps the crc32c of an uncompressed
array's chunks in a table after them (the chunk bodies, and so a sample's rows, lie back to back),
before v4 (and for compressed arrays) each chunk is followed by its crc32c.
HDF5: every array is a chunked dataset with a Fletcher-32 per chunk (docs/cache-format.md §11).
"""
from __future__ import annotations

import contextlib
import functools
import re
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where a value is encoded or decoded: a writer process needs none
    import torch

FORMAT = "deepspec-cache"
FORMAT_VERSION = 4
# versions this code reads: v1 lists every part in the root manifest (rewritten after each part);
# v2 commits a part without touching the root and consolidates a per-sample index once per run;
# v3 names every part by its content (the keys of its samples) and keys every sample by its content;
# v4 moves an uncompressed chunk's crc32c from behind the chunk into a table before the shard's index
READ_VERSIONS = (1, 2, 3, 4)
# a Zarr array's attribute naming where its chunks' crc32cs are (docs/cache-format.md §6): "table"
CHUNK_CRC32C = "deepspec_chunk_crc32c"

# the consolidated index, uint64 [samples, len(columns)]; v3 adds the sample's content key
INDEX_COLUMNS_V2 = ("part", "offset", "length", "sample_id")
INDEX_COLUMNS = (*INDEX_COLUMNS_V2, "key_hi", "key_lo")
DTYPES = ("bfloat16", "fp8")
CODECS = ("none", "blosc-zstd", "blosc-lz4")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Manifest fields that decide a store's content: a writer may only add parts to a store whose values
# for all of them equal its own, and the store-naming rule (store.store_key) hashes exactly these.
# `compute` (how the target ran: dtype, attention kernel) is absent from stores written before it existed.
CONTENT_KEYS = ("format_version", "target", "compute", "layers", "dtype", "codec", "max_length", "chunk_tokens")


class CacheFormatError(ValueError):
    pass


# what parsing a hostile value can raise in numpy, json, zarr-python or h5py's own checks
PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
                NotImplementedError, RecursionError)


@contextlib.contextmanager
def parsing(where: str):
    """Any error parsing what a store holds at `where` ("<store>: <file or key>[: field]") becomes a
    CacheFormatError naming it: a store is input deepspec does not control, and a refusal must say
    where, not surface as a library's OverflowError or KeyError."""
    try:
        yield
    except (CacheFormatError, FileNotFoundError):  # zarr's GroupNotFoundError is both a ValueError and this
        raise
    except PARSE_ERRORS as e:
        raise CacheFormatError(f"{where}: unreadable ({e.__class__.__name__}: {str(e)[:200]})") from None


def named(e: CacheFormatError, url: str) -> CacheFormatError:
    """`e`, its message led by the store's URL where it does not name it (a shard reader names the key)."""
    return e if url in str(e) else type(e)(f"{url}: {e}")


def naming_the_store(method):
    """Every CacheFormatError a read raises names the store it read."""
    @functools.wraps(method)
    def read(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except CacheFormatError as e:
            raise named(e, self.url) from None
    return read


# Names a store supplies (manifest, listings, commit records) that become paths: only these shapes are
# accepted, so no name or key can reach outside the store (no `..`, no absolute path, no separator
# where none belongs). v1/v2 parts: p + a 6-digit sequence number; v3: p + 24 hex digits (part_name).
PART_NAME = re.compile(r"p(\d{6}|[0-9a-f]{24})")
# the consolidated index: v2 `index/c/0/0` (Zarr) or `index.h5`; v3 `index/<16 hex>/c/0/0` or `index/<16 hex>.h5`
INDEX_KEY = re.compile(r"index(/c/0/0|\.h5|/[0-9a-f]{16}/c/0/0|/[0-9a-f]{16}\.h5)")


def hidden_name(layer: int | str) -> str:
    return "last_hidden" if layer == "last" else f"hidden/{layer}"


def scale_name(layer: int | str) -> str:
    return f"scale/{layer}"


def part_arrays(layers: list, dtype: str, version: int = FORMAT_VERSION) -> list[str]:
    """Every array of a part, in the order the writer writes them."""
    names = ["offsets", "sample_id", *(["sample_key"] if version >= 3 else []), "input_ids", "loss_mask"]
    for layer in [*layers, "last"]:
        names.append(hidden_name(layer))
        if dtype != "bfloat16":
            names.append(scale_name(layer))
    return names


def storage_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.uint16 if dtype == "bfloat16" else np.uint8)


def array_shape(name: str, samples: int, tokens: int, hidden_size: int, dtype: str) -> tuple[np.dtype, tuple]:
    """The dtype and shape array `name` of a part of `samples` samples and `tokens` tokens must have,
    by the manifest: what a reader checks a part's own declaration against before sizing anything by it."""
    if name == "offsets":
        return np.dtype(np.int64), (samples + 1,)
    if name == "sample_id":
        return np.dtype(np.uint64), (samples,)
    if name == "sample_key":
        return np.dtype(np.uint64), (samples, 2)
    if name == "input_ids":
        return np.dtype(np.int32), (tokens,)
    if name == "loss_mask":
        return np.dtype(np.uint8), (tokens,)
    if name.startswith("scale/"):
        return np.dtype(np.float32), (tokens,)
    if name == "last_hidden" or name.startswith("hidden/"):
        return storage_dtype(dtype), (tokens, hidden_size)
    raise CacheFormatError(f"{name}: not an array of a part")


def bytes_per_token(hidden_size: int, num_layers: int, dtype: str) -> int:
    """input_ids + loss_mask + (layers + last) hidden rows (+ their fp32 scales in 8-bit mode)."""
    per_row = hidden_size * (2 if dtype == "bfloat16" else 1) + (0 if dtype == "bfloat16" else 4)
    return 4 + 1 + (num_layers + 1) * per_row


BLOSC = {  # codec name -> numcodecs/zarr Blosc settings (one place for writer, spec and tests)
    "blosc-zstd": {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1 << 20},
    "blosc-lz4": {"cname": "lz4", "clevel": 5, "shuffle": "bitshuffle", "blocksize": 1 << 20},
}


def crc_table(codec: str) -> bool:
    """Whether an array of `codec` keeps its chunks' crc32cs in a table (v4, uncompressed: the rows
    of its chunks then lie back to back in the shard) rather than behind each chunk."""
    return codec == "none"


def inner_codecs(codec: str, typesize: int):
    """Codec chain of every inner chunk: bytes [-> blosc -> crc32c]; an uncompressed chunk's crc32c
    is in the shard's table instead (crc_table)."""
    from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec

    chain = [BytesCodec(endian="little")]
    if codec in BLOSC:
        # blocksize 1 MiB: with Blosc's default block the shuffle gains nothing on activations
        chain.append(BloscCodec(typesize=typesize, **BLOSC[codec]))
    elif codec != "none":
        raise CacheFormatError(f"unknown codec {codec!r} (known: {list(CODECS)})")
    if not crc_table(codec):
        chain.append(Crc32cCodec())
    return chain


# ---- value encodings -------------------------------------------------------------------------

def encode_hidden(x, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """[T, H] float tensor (any device) or array -> (stored bits, per-token float32 scale or None), on the host."""
    import torch

    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x, device="cpu")
    bits, scale = encode_hidden_on_device(x, dtype)
    return bits.cpu().numpy(), None if scale is None else scale.cpu().numpy()


def encode_hidden_on_device(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[T, H] float tensor -> (stored bits as uint16 or uint8, per-token float32 scale or None), on the
    tensor's own device: encoding where the tensor lives halves the device-to-host copy (fp8)."""
    import torch

    if dtype == "bfloat16":
        return x.to(torch.bfloat16).contiguous().view(torch.uint16), None
    # fp8 is a function of the bfloat16 values (docs/cache-format.md §5): a store derived from a
    # bfloat16 store (deepspec.cache.build.derive) then holds exactly what the stage writes itself
    xf = x.to(torch.bfloat16).float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale.squeeze(-1).float()


_FP8_LUT: dict[str, np.ndarray] = {}


def _fp8_tables() -> tuple[np.ndarray, np.ndarray]:
    """float32 value of every fp8 byte, and of every byte pair (as one uint64 of two float32s).
    A table gather is ~5x faster than torch's fp8 -> float cast on CPU, and exact."""
    if not _FP8_LUT:
        import torch

        one = torch.arange(256, dtype=torch.uint8, device="cpu").view(torch.float8_e4m3fn).float().numpy()
        i = np.arange(1 << 16)
        _FP8_LUT["one"] = one
        _FP8_LUT["pair"] = np.ascontiguousarray(np.stack([one[i & 255], one[i >> 8]], axis=1)).view(np.uint64).ravel()
    return _FP8_LUT["one"], _FP8_LUT["pair"]


def decode_hidden(bits: np.ndarray, scale: np.ndarray | None, dtype: str,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored bits -> bfloat16 tensor [T, H] (8-bit values are dequantised with their scale, in
    float32, then rounded once to bfloat16). With `out`, the result is written there."""
    import torch

    bits = np.ascontiguousarray(bits)
    if dtype == "bfloat16":
        t = torch.from_numpy(bits).view(torch.bfloat16)
        return t if out is None else out.copy_(t)
    one, pair = _fp8_tables()
    x = np.empty(bits.shape, dtype=np.float32)
    if bits.ndim == 2 and bits.shape[1] % 2 == 0:
        np.take(pair, bits.view(np.uint16), out=x.view(np.uint64), mode="clip")
    else:
        np.take(one, bits, out=x, mode="clip")
    np.multiply(x, np.asarray(scale, dtype=np.float32).reshape(-1, *([1] * (bits.ndim - 1))), out=x)
    t = torch.from_numpy(x)
    return t.to(torch.bfloat16) if out is None else out.copy_(t)


def sample_id_to_int(sample_id: str) -> int:
    try:
        value = int(sample_id, 16)
    except ValueError:
        raise CacheFormatError(f"sample id {sample_id!r} is not a 16-hex-digit id") from None
    if not 0 <= value < 2**64:
        raise CacheFormatError(f"sample id {sample_id!r} does not fit 64 bits")
    return value


def sample_id_to_str(value: int) -> str:
    return f"{int(value):016x}"


# ---- content keys (v3) -------------------------------------------------------------------------
# A sample's key is what the target is run on for it: its token ids and its loss mask, as the chat
# template produced them (the target itself, its tokenizer and template, max_length, dtype and layers
# are the store's content fields, equal for every sample of a store). Two rows with equal keys have
# equal cached values; a row whose answer, template or tokenizer changed gets another key.
KEY_PERSON = b"deepspec-sample"  # blake2b personalisation: these digests never collide with another use
PART_PERSON = b"deepspec-part"


def sample_key(input_ids, loss_mask) -> tuple[int, int]:
    """128-bit blake2b of the sample's int32 token ids (little-endian) then its uint8 loss mask, as
    two uint64 (the digest's first and last 8 bytes, big-endian: f"{hi:016x}{lo:016x}" is its hex)."""
    import hashlib

    ids = np.ascontiguousarray(input_ids, dtype="<i4")
    mask = np.ascontiguousarray(loss_mask, dtype=np.uint8)
    if ids.shape != mask.shape or ids.ndim != 1:
        raise CacheFormatError(f"input_ids {ids.shape} and loss_mask {mask.shape} of a sample differ in shape")
    h = hashlib.blake2b(digest_size=16, person=KEY_PERSON)
    h.update(ids.tobytes())
    h.update(mask.tobytes())
    d = h.digest()
    return int.from_bytes(d[:8], "big"), int.from_bytes(d[8:], "big")


def sample_keys(input_ids: np.ndarray, loss_mask: np.ndarray, lengths) -> np.ndarray:
    """uint64 [n, 2]: the key of each sample of a CSR slice (rows back to back, `lengths` each)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.empty((len(lengths), 2), dtype=np.uint64)
    start = 0
    for k, n in enumerate(lengths.tolist()):
        out[k] = sample_key(input_ids[start:start + n], loss_mask[start:start + n])
        start += n
    if start != len(input_ids):
        raise CacheFormatError(f"lengths sum to {start} tokens, the arrays hold {len(input_ids)}")
    return out


def key_to_str(key) -> str:
    return f"{int(key[0]):016x}{int(key[1]):016x}"


def key_from_str(text: str) -> tuple[int, int]:
    if len(text) != 32:
        raise CacheFormatError(f"sample key {text!r} is not 32 hex digits")
    return int(text[:16], 16), int(text[16:], 16)


def part_name(keys: np.ndarray, sample_ids: np.ndarray) -> str:
    """A v3 part's name: `p` + 24 hex digits of a hash of its samples' keys and ids in store order.
    The part's arrays are a function of exactly these (and of the store's content fields), so equal
    names mean equal parts, and a part is found again by what it holds, whatever run wrote it."""
    import hashlib

    keys = np.ascontiguousarray(keys, dtype=">u8").reshape(-1, 2)
    ids = np.ascontiguousarray(sample_ids, dtype=">u8").reshape(-1)
    if len(keys) != len(ids):
        raise CacheFormatError(f"{len(keys)} keys for {len(ids)} sample ids")
    h = hashlib.blake2b(digest_size=12, person=PART_PERSON)
    h.update(len(ids).to_bytes(8, "big"))
    h.update(keys.tobytes())
    h.update(ids.tobytes())
    return "p" + h.hexdigest()


def index_name(rows) -> str:
    """The content name of a consolidated index (§3.1): a hash of its rows (uint64 little-endian)."""
    import hashlib

    return hashlib.blake2b(np.ascontiguousarray(rows, dtype="<u8").tobytes(), digest_size=8).hexdigest()
