"""`deepspec cache verify` and `deepspec cache info`: whole-store checks and a summary."""
from __future__ import annotations

import numpy as np

from deepspec.cache.spec.format import CacheFormatError, bytes_per_token, decode_hidden, hidden_name, sample_keys, scale_name
from deepspec.cache.read.reader import CacheReader


def array_names(reader: CacheReader) -> list[str]:
    names = ["input_ids", "loss_mask"]
    for layer in [*reader.layers, "last"]:
        names.append(hidden_name(layer))
        if reader.dtype != "bfloat16":
            names.append(scale_name(layer))
    return names


# bytes of one array read by verify: whole chunks, so a 38 TB store is ~600 k requests (16 k per TB),
# not one per 64-token chunk (~10^8); a bad chunk is still named on its own
READ_BYTES = 64 << 20


def verify(url: str, storage_options: dict | None = None) -> dict:
    """Read every chunk of every array (checksums), and check offsets and counts against the manifest.
    Raises CacheFormatError naming the first bad part/array/chunk."""
    reader = CacheReader(url, storage_options, verify=True)
    store = reader.store
    shards = reader.shard_reader()
    shards.strict = True  # every checksum a chunk has (HDF5: the table's crc32c and its Fletcher-32)
    seen: set[int] = set()
    chunks = reads = 0
    for p, entry in enumerate(reader.entries):
        name = entry.name
        offsets = reader.part_offsets(p)
        tokens = int(offsets[-1])
        where = f"{url}: parts/{name}"
        if offsets[0] != 0 or np.any(np.diff(offsets) <= 0):
            raise CacheFormatError(f"{where}/offsets: not strictly increasing from 0")
        if len(offsets) - 1 != entry.samples or tokens != entry.tokens:
            raise CacheFormatError(f"{where}: manifest says {entry.samples} samples/{entry.tokens} "
                                   f"tokens, offsets say {len(offsets) - 1}/{tokens}")
        ids = reader.part_sample_ids(p)
        if len(ids) != entry.samples or store.array_rows(entry, "sample_id") != entry.samples:
            raise CacheFormatError(f"{where}/sample_id: {len(ids)} ids for {entry.samples} samples")
        dup = seen.intersection(int(i) for i in ids)
        if dup:
            raise CacheFormatError(f"{where}/sample_id: sample {min(dup):016x} appears in two parts")
        seen.update(int(i) for i in ids)
        if reader.manifest.format_version >= 3:
            # a key is a hash of the sample's tokens and mask: a wrong one would let a later build keep the
            # part for samples it does not hold (a part's name, made from the keys, is only a label here)
            keys = reader.part_keys(p)
            got = sample_keys(reader.read_array(p, "input_ids", 0, tokens), reader.read_array(p, "loss_mask", 0, tokens),
                              np.diff(offsets))
            if not np.array_equal(keys, got):
                bad = int(np.flatnonzero((keys != got).any(axis=1))[0])
                raise CacheFormatError(f"{where}: sample {bad}: its key in the index is not the hash of its "
                                       "input_ids and loss_mask")
            stored = np.asarray(store.read_slow(entry, "sample_key", 0, entry.samples), dtype=np.uint64).reshape(-1, 2)
            if not np.array_equal(stored, keys):
                raise CacheFormatError(f"{where}/sample_key: differs from the index's keys")
        for array in array_names(reader):
            rows = store.array_rows(entry, array)
            if rows != tokens:
                raise CacheFormatError(f"{where}/{array}: {rows} rows, offsets say {tokens}")
            layout = reader.array_layout(p, array)
            if layout is None:
                store.read_slow(entry, array, 0, rows)  # the library checks each chunk itself
                continue
            step = layout.chunk_rows
            span = max(step, READ_BYTES // max(layout.row_bytes, 1) // step * step)  # whole chunks per read
            for start in range(0, tokens, span):
                stop = min(tokens, start + span)
                try:
                    shards.read_rows(layout, start, stop)  # one byte range per run of adjacent chunks, each checked
                except CacheFormatError as e:
                    raise type(e)(f"{url}: {e}") from None
                chunks += -(-(stop - start) // step)
                reads += 1
    # committed parts the manifest does not list: an earlier input's, kept on S3 for other workspaces'
    # manifests (docs/cache-format.md §7); not damage, but space that `deepspec cache gc` can reclaim
    unlisted = sorted(set(store.committed_parts()) - set(reader.parts))
    return {"url": url, "parts": len(reader.parts), "samples": len(reader), "chunks_checked": chunks,
            "array_reads": reads, "storage": reader.storage, "unlisted_parts": len(unlisted),
            **({"unlisted_example": unlisted[:5], "unlisted_hint": "deepspec cache gc URL --keep MANIFEST... "
                "lists (and with --delete removes) the parts no kept manifest lists"} if unlisted else {}),
            "ok": True}


def info(url: str, storage_options: dict | None = None) -> dict:
    reader = CacheReader(url, storage_options, verify=False)
    m = reader.manifest
    return {
        "url": url,
        "format_version": m["format_version"],
        "storage": m.storage,
        "samples": m["num_samples"],
        "tokens": m["num_tokens"],
        "parts": len(m["parts"]),
        "layers": m["layers"],
        "dtype": m["dtype"],
        "codec": m["codec"],
        "hidden_size": m["hidden_size"],
        "max_length": m["max_length"],
        "bytes_per_token": bytes_per_token(m["hidden_size"], len(m["layers"]), m["dtype"]),
        "target": m["target"],
    }


def disk_usage(url: str, storage_options: dict | None = None) -> tuple[int, int]:
    """(bytes, files) under a store: what DVC will hash and push."""
    import os

    from deepspec.cache.storage.urls import is_remote, storage_options_for

    if is_remote(url):
        import fsspec

        fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options))
        sizes = fs.find(root, detail=True)
        return sum(int(v["size"]) for v in sizes.values()), len(sizes)
    total = files = 0
    for dirpath, _, names in os.walk(url):
        for n in names:
            total += os.path.getsize(os.path.join(dirpath, n))
            files += 1
    return total, files


# what a recomputed state may differ by, relative to the largest magnitude of the sample's layer: the
# store's states come from padded batches (and maybe another GPU or torch), so bits differ in their
# last places; a state of another sample, layer or target differs by about 1
RECOMPUTE_TOLERANCE = {"bfloat16": 0.02, "fp8": 0.1}


def recompute(url: str, target_dir: str, samples: int, storage_options: dict | None = None, seed: int = 0,
              device=None) -> dict:
    """`deepspec cache verify --recompute N URL --target DIR`: run the target on `samples` random samples
    of the store, one at a time, and compare every cached layer with what it computes. Checksums prove
    bytes are the ones written; this proves they are the target's states for those tokens (a store
    written by someone else, a pulled cache). The store's target identity must be the target's."""
    import torch

    from deepspec.cache.spec.manifest import manifest_mismatch
    from deepspec.devices import local_device
    from deepspec.models.capture import forward_capture
    from deepspec.models.target import TargetError, load_causal_lm, load_identity

    reader = CacheReader(url, storage_options, verify=True)
    m = reader.manifest
    try:
        ident = load_identity(target_dir)
    except TargetError as e:
        raise CacheFormatError(f"--target: {e}") from None
    why = manifest_mismatch({"target": m.target}, {"target": ident})
    if why:
        raise CacheFormatError(f"{url}: computed with another target than {target_dir} ({why})")
    device = device or local_device()
    compute = m.extra.get("compute")
    model = load_causal_lm(target_dir, device, compute if isinstance(compute, dict) and "dtype" in compute else None)
    tolerance = RECOMPUTE_TOLERANCE[m.dtype]
    picks = np.random.default_rng(seed).choice(len(reader), size=min(samples, len(reader)), replace=False)
    worst, bad = 0.0, []
    for index in sorted(int(i) for i in picks):
        stored = reader.read(index)
        ids = torch.as_tensor(stored["input_ids"].astype(np.int64), device="cpu")[None].to(device)
        with torch.no_grad():
            captured, last = forward_capture(model, ids, torch.ones_like(ids), reader.layers)
        for layer in [*reader.layers, "last"]:
            want = (last if layer == "last" else captured[layer])[0].float().cpu()
            got = decode_hidden(*stored[layer], m.dtype).float()
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
            worst = max(worst, err)
            if not err <= tolerance:
                bad.append({"sample": index, "sample_id": f"{reader.sample_id(index):016x}", "layer": layer,
                            "relative_error": round(err, 4)})
    return {"url": url, "target": str(target_dir), "samples_recomputed": len(picks), "layers": reader.layers,
            "max_relative_error": round(worst, 5), "tolerance": tolerance, "mismatches": bad[:20],
            "mismatched": len(bad), "ok": not bad}
