"""Moving caches between a store here and the reference pipeline's own format (DeepSpec target
cache, version 2; the format is described in docs/cache-format.md §10).

A reference cache is a local directory: `manifest.json`, `samples.idx` (56-byte records, record k
holds sample k) and raw `shard-NNNNN.bin` files with each sample's arrays back to back, hidden
states token-major with the layers side by side ([T, L*H]). Both directions stream: import reads
one sample at a time into a preallocated part and hands whole parts to `CacheWriter`; export reads
one sample at a time (cache.samples) and appends it to the current shard.

What the reference format cannot hold travels in files of our own that its reader ignores: this
project's row ids in `deepspec_sample_ids.bin` (uint64 LE, one per record) and the target identity,
store dtype and layer order in the manifest's `deepspec` field.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deepspec.cache.spec.format import FORMAT, FORMAT_VERSION, CacheFormatError, bytes_per_token
from deepspec.cache.tools.reference_cache import RECORD, REF_VERSION, SAMPLE_IDS_FILE, ReferenceCache

# reference hidden dtype -> store dtype: e4m3 keeps its bytes (scale 1); e5m2 has no store dtype
# here, and every e5m2 value is exactly a bfloat16, so it widens without loss
STORE_DTYPE = {"bfloat16": "bfloat16", "float8_e4m3fn": "fp8", "float8_e5m2": "bfloat16"}
IDENTITY_KEYS = ("architecture", "hidden_size", "num_layers", "vocab_size", "config_sha256", "weights_sha256",
                 "tokenizer_sha256", "chat_template_sha256", "id")
UNKNOWN = "unknown (imported from a reference cache without --target)"


# ---- import -----------------------------------------------------------------------------------

def _identity(ref: ReferenceCache, target_dir: str | Path | None) -> tuple[dict, str]:
    """(target identity for the store, where it came from)."""
    exported = ref.deepspec_block().get("target")
    if not (isinstance(exported, dict) and exported.get("hidden_size") == ref.hidden_size):
        exported = None
    if target_dir is None:
        if exported is not None:
            return dict(exported), "export manifest"
        ident = {k: UNKNOWN for k in IDENTITY_KEYS}
        ident["hidden_size"] = ref.hidden_size
        return ident, "unknown"
    from deepspec.models.target import TargetError, load_identity

    try:
        ident = load_identity(target_dir)
    except TargetError as e:
        raise CacheFormatError(str(e)) from None
    where = Path(target_dir) / "identity.json"
    if ident.get("hidden_size") != ref.hidden_size:
        raise CacheFormatError(f"{where}: hidden_size {ident.get('hidden_size')} but {ref.manifest_path} "
                               f"hidden_size is {ref.hidden_size}: the cache was not computed with this target")
    last = int(ident["num_layers"]) - 2  # the final layer is not cacheable (docs/cache-format.md §2)
    bad = [i for i in ref.layers if i > last]
    if bad:
        raise CacheFormatError(f"{ref.manifest_path}: field target_layer_ids has {bad}, out of range for "
                               f"{where} ({ident['num_layers']} decoder layers; valid -1 .. {last})")
    if exported is not None:
        for key in sorted(set(exported) | set(ident)):
            if key != "id" and exported.get(key) not in (ident.get(key), UNKNOWN):
                raise CacheFormatError(f"{ref.manifest_path}: deepspec.target.{key} is {exported.get(key)!r} "
                                       f"but {where} has {ident.get(key)!r}: the cache was computed with another target")
    return ident, "--target"


def _store_layers(ref: ReferenceCache) -> list[int]:
    """The store's layer order: the original one when the cache came from a store here."""
    order = ref.deepspec_block().get("layers")
    if isinstance(order, list) and sorted(order) == ref.layers:
        return list(order)
    return list(ref.layers)


# tokens of hidden states an import reads and hands to the writer at a time: a part is streamed
IMPORT_BATCH_TOKENS = 65536


def _read_part(ref: ReferenceCache, records: np.ndarray, name: str, sample_ids: np.ndarray, dtype: str):
    """A part's header (ids, lengths, tokens, loss mask) read now; its hidden states as `batches`,
    read a few records at a time when the writer streams the part (CacheWriter.submit)."""
    from deepspec.cache.write.part_data import PartData

    lengths = records["seq_len"].astype(np.int64)
    T = int(lengths.sum())
    input_ids = np.empty(T, dtype=np.int32)
    loss_mask = np.empty(T, dtype=np.uint8)
    pos = 0
    for rec, n in zip(records, lengths.tolist()):
        input_ids[pos:pos + n] = np.frombuffer(ref.read(rec, "input_ids", 4 * n), dtype="<i4")
        loss_mask[pos:pos + n] = np.frombuffer(ref.read(rec, "loss_mask", n), dtype=np.uint8)
        pos += n
    from deepspec.cache.spec.plan import pack_ranges  # consecutive records of at most IMPORT_BATCH_TOKENS

    groups = pack_ranges(lengths, IMPORT_BATCH_TOKENS)
    return PartData(name=name, sample_ids=sample_ids.astype(np.uint64), lengths=lengths, input_ids=input_ids,
                    loss_mask=loss_mask, batches=(_read_hidden(ref, records[a:b], dtype) for a, b in groups))


def _record_keys(ref: ReferenceCache, index: np.ndarray) -> np.ndarray:
    """uint64 [n, 2]: each record's content key (format.sample_key of its token ids and loss mask),
    which the part plan cuts by: a pass over the token arrays only, ~5 bytes a token."""
    from deepspec.cache.spec.format import sample_key

    keys = np.empty((len(index), 2), dtype=np.uint64)
    for k, rec in enumerate(index):
        n = int(rec["seq_len"])
        keys[k] = sample_key(np.frombuffer(ref.read(rec, "input_ids", 4 * n), dtype="<i4"),
                             np.frombuffer(ref.read(rec, "loss_mask", n), dtype=np.uint8))
    return keys


def _read_hidden(ref: ReferenceCache, records: np.ndarray, dtype: str) -> dict:
    """The hidden states of consecutive records: {layer or "last": (bits, scale)}."""
    lengths = records["seq_len"].astype(np.int64)
    T, L, H = int(lengths.sum()), len(ref.layers), ref.hidden_size
    raw = np.uint16 if ref.itemsize == 2 else np.uint8
    hidden = np.empty((L + 1, T, H), dtype=raw)  # stored layers then last; filled in place
    pos = 0
    for rec, n in zip(records, lengths.tolist()):
        rows = np.frombuffer(ref.read(rec, "target_hidden_states", n * L * H * ref.itemsize),
                             dtype=np.dtype(raw).newbyteorder("<")).reshape(n, L, H)
        hidden[:L, pos:pos + n] = rows.transpose(1, 0, 2)
        hidden[L, pos:pos + n] = np.frombuffer(ref.read(rec, "target_last_hidden_states", n * H * ref.itemsize),
                                               dtype=np.dtype(raw).newbyteorder("<")).reshape(n, H)
        pos += n
    if ref.hidden_dtype == "float8_e5m2":
        hidden = torch.from_numpy(hidden).view(torch.float8_e5m2).to(torch.bfloat16).view(torch.uint16).numpy()
    ones = np.ones(T, dtype=np.float32) if dtype == "fp8" else None  # a plain cast: its scale is 1
    values = {layer: (hidden[k], ones) for k, layer in enumerate(ref.layers)}
    values["last"] = (hidden[L], ones)
    return values


def import_reference(src: str | Path, dst: str, target_dir: str | Path | None = None, codec: str = "none",
                     chunk_tokens: int = 64, part_tokens: int = 65536, shard_bytes: int = 512 * 2**20,
                     storage_options: dict | None = None, storage: str = "zarr") -> dict:
    """A reference cache directory -> a new store at `dst` (`storage`: "zarr" or "hdf5"). Everything is checked before the first
    part is written; a part's hidden states are read and written IMPORT_BATCH_TOKENS at a time (streamed)."""
    from deepspec.cache.backends.readers import refuse_existing
    from deepspec.cache.write.writer import CacheWriter

    ref = ReferenceCache(src)
    ref.check_index()
    ident, ident_from = _identity(ref, target_dir)
    ids = ref.sample_ids()
    ids_from = SAMPLE_IDS_FILE if ids is not None else "record position"
    if ids is None:  # no row ids to restore: the reference's own sample id, the record's position
        ids = np.arange(ref.num_samples, dtype=np.uint64)
    refuse_existing(dst, storage_options)

    dtype = STORE_DTYPE[ref.hidden_dtype]
    layers = _store_layers(ref)
    index = ref.index()
    seq_len = np.asarray(index["seq_len"]).astype(np.int64) if ref.num_samples else np.zeros(0, np.int64)
    max_length = ref.manifest.get("max_length")
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
        max_length = int(seq_len.max()) if len(seq_len) else 0  # the longest sample is the only fact known
    manifest = {
        "target": ident, "layers": layers, "dtype": dtype, "codec": codec, "max_length": max_length,
        "chunk_tokens": chunk_tokens, "hidden_size": ref.hidden_size,
        "bytes_per_token": bytes_per_token(ref.hidden_size, len(layers), dtype), "storage": storage,
        "imported_from": {
            "format": "deepspec-reference-target-cache", "version": REF_VERSION, "hidden_dtype": ref.hidden_dtype,
            "target_model_name_or_path": ref.manifest.get("target_model_name_or_path"),
            "target_identity": ident_from, "sample_ids": ids_from,
        },
    }
    row_bytes = ref.hidden_size * (2 if dtype == "bfloat16" else 1)
    from deepspec.cache.spec.format import part_name
    from deepspec.cache.spec.plan import part_ranges  # the cache stage's rule: parts cut by content

    index = np.asarray(index)
    keys = _record_keys(ref, index)
    plan = part_ranges(seq_len, keys, max(1, min(part_tokens, shard_bytes // row_bytes)))
    try:
        # the writer's exit gives its lease back (or its renewal would run on after the import)
        with CacheWriter(dst, manifest, storage_options, queue_size=1, prune_stale=False) as writer:
            order = []
            for a, b in plan:
                rows = np.arange(a, b)  # records keep their order (a round trip gives the same sample order)
                order.append(part_name(keys[rows], ids[rows]))
                part = _read_part(ref, index[rows], order[-1], ids[rows], dtype)
                part.keys = keys[rows]
                writer.submit(part)
            writer.close(order=order)
    finally:
        ref.close()
    return {"url": dst, "samples": ref.num_samples, "tokens": int(seq_len.sum()), "parts": len(plan),
            "layers": layers, "dtype": dtype, "storage": storage, "hidden_size": ref.hidden_size,
            "target_identity": ident_from,
            "sample_ids": ids_from}


# ---- export -----------------------------------------------------------------------------------

@dataclass
class _ShardWriter:
    """Appends samples to shard-NNNNN.bin files, rolling to a new one past max_bytes."""
    dir: Path
    max_bytes: int
    shard: int = -1
    size: int = 0
    handle: object = None

    def file_name(self, shard: int) -> str:
        return f"shard-{shard:05d}.bin"

    def start(self, nbytes: int) -> None:
        if self.handle is None or (self.size > 0 and self.size + nbytes > self.max_bytes):
            self.close()
            self.shard += 1
            self.handle = open(self.dir / self.file_name(self.shard), "xb")
            self.size = 0

    def write(self, data: np.ndarray) -> int:
        offset = self.size
        self.handle.write(memoryview(np.ascontiguousarray(data)).cast("B"))
        self.size += data.nbytes
        return offset

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def _prepare_out_dir(out: Path) -> bool:
    """True when the directory is created here. Refuses a non-empty one: nothing is overwritten."""
    if out.exists():
        if not out.is_dir() or any(out.iterdir()):
            raise CacheFormatError(f"{out}: already exists and is not empty; export writes a new directory")
        return False
    out.mkdir(parents=True)
    return True


def export_reference(src: str, out_dir: str | Path, layers: list[int] | None = None,
                     target_name: str | None = None, shard_bytes: int = 64 * 2**30,
                     storage_options: dict | None = None) -> dict:
    """A store here -> a reference cache directory (bfloat16; an fp8 store is decoded). Layers are
    written in ascending order, as the reference requires."""
    from deepspec.cache.read.reader import CacheReader
    from deepspec.cache.read.samples import read_samples

    reader = CacheReader(src, storage_options)
    m = reader.manifest
    wanted = sorted(set(layers)) if layers else list(reader.layers)
    missing = [i for i in wanted if i not in reader.layers]
    if missing:
        raise CacheFormatError(f"{src}: layers {missing} are not cached (cached layers: {reader.layers})")
    order = sorted(wanted)
    perm = [wanted.index(i) for i in order]  # the asked order -> ascending
    out = Path(out_dir)
    created = _prepare_out_dir(out)
    shards = _ShardWriter(out, shard_bytes)
    H, tokens = int(m["hidden_size"]), 0
    try:
        with open(out / "samples.idx", "xb") as index, open(out / SAMPLE_IDS_FILE, "xb") as id_file:
            for k in range(len(reader)):
                item = read_samples(reader, [k], wanted)[0]
                n = int(item["input_ids"].shape[0])
                hidden = item["hidden"].transpose(0, 1)[:, perm].contiguous().view(torch.uint16).numpy()  # [T, L, H]
                last = item["last_hidden"].contiguous().view(torch.uint16).numpy()
                arrays = {
                    "input_ids": item["input_ids"].numpy().astype("<i4", copy=False),
                    "attention_mask": np.ones(n, dtype=np.uint8),  # samples are unpadded
                    "loss_mask": item["loss_mask"].numpy().astype(np.uint8, copy=False),
                    "target_hidden_states": hidden.astype("<u2", copy=False),
                    "target_last_hidden_states": last.astype("<u2", copy=False),
                }
                shards.start(sum(a.nbytes for a in arrays.values()))
                rec = np.zeros(1, dtype=RECORD)
                rec["sample_id"], rec["shard_id"], rec["seq_len"] = k, shards.shard, n
                for field in ("input_ids", "attention_mask", "loss_mask", "target_hidden_states",
                              "target_last_hidden_states"):  # the reference writer's order
                    rec[field] = shards.write(arrays[field])
                index.write(rec.tobytes())
                id_file.write(np.array([item["sample_id"]], dtype="<u8").tobytes())
                tokens += n
        shards.close()
        manifest = {
            "version": REF_VERSION, "num_samples": len(reader), "num_shards": shards.shard + 1,
            "target_layer_ids": order, "hidden_dtype": "bfloat16", "token_dtype": "int32", "mask_dtype": "uint8",
            "index_record_size": RECORD.itemsize, "hidden_size": H,
            "shards": [{"shard_id": s, "file_name": shards.file_name(s)} for s in range(shards.shard + 1)],
            # the reference trainer refuses a cache whose field differs from its config's model path
            "target_model_name_or_path": target_name or _default_target_name(m),
            "max_length": m["max_length"],
            "deepspec": {"format": FORMAT, "format_version": FORMAT_VERSION, "sample_ids_file": SAMPLE_IDS_FILE,
                         "target": m["target"], "dtype": m["dtype"], "layers": [i for i in m["layers"] if i in order]},
        }
        tmp = out / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        os.replace(tmp, out / "manifest.json")  # last: until it exists the directory is not a cache
    except BaseException:
        shards.close()
        _remove_partial(out, created, shards)
        raise
    return {"dir": str(out), "samples": len(reader), "tokens": tokens, "shards": shards.shard + 1,
            "target_layer_ids": order, "hidden_dtype": "bfloat16", "source_dtype": m["dtype"],
            "target_model_name_or_path": manifest["target_model_name_or_path"]}


def _default_target_name(m: dict) -> str:
    """The name an imported cache came with, else one naming the target identity (the reference
    trainer then refuses it until the field is set to its config's model path: --target-name)."""
    imported = m.get("imported_from")
    if isinstance(imported, dict) and imported.get("target_model_name_or_path"):
        return str(imported["target_model_name_or_path"])
    return f"deepspec-target:{m['target'].get('id')}"


def _remove_partial(out: Path, created: bool, shards: _ShardWriter) -> None:
    names = ["samples.idx", SAMPLE_IDS_FILE, "manifest.json.tmp"] + \
            [shards.file_name(s) for s in range(shards.shard + 1)]
    for name in names:
        (out / name).unlink(missing_ok=True)
    if created:
        try:
            out.rmdir()
        except OSError:
            pass
