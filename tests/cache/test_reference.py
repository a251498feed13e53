"""Import/export of the reference pipeline's target-cache format (DeepSpec, version 2).

`ref_read` / `ref_write` below are written from the reference's format facts alone (its reader
`CacheDataset` and its writer in deepspec/data/target_cache_dataset.py of deepseek-ai/DeepSpec) and
share no code with deepspec/cache/tools/reference.py or reference_cache.py, so an export that they read
back, and a directory they write that the import accepts, test the format rather than the module
against itself.
"""
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.tools.reference import export_reference, import_reference
from deepspec.cache.tools.verify import verify
from deepspec.cache.write.part_data import PartData
from deepspec.cache.write.writer import CacheWriter
from deepspec.cli import main
from deepspec.loader.dataset import TargetCacheDataset
from deepspec.models.target import load_identity

# ---- the reference format, from its facts -------------------------------------------------------
# samples.idx: one record per sample, little-endian: sample_id u64 (== the record's position),
# shard_id u32, seq_len u32, then the byte offsets in the shard of input_ids (int32[T]),
# attention_mask (uint8[T]), loss_mask (uint8[T]), target_hidden_states ([T, L*H], the layers of
# one token side by side in target_layer_ids order) and target_last_hidden_states ([T, H]).
REC = struct.Struct("<QIIQQQQQ")
FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def ref_read(cache_dir: Path) -> tuple[dict, list[dict]]:
    m = json.loads((cache_dir / "manifest.json").read_text())
    for key in ("version", "num_samples", "num_shards", "target_layer_ids", "hidden_dtype", "token_dtype",
                "mask_dtype", "index_record_size", "hidden_size", "shards"):
        assert key in m, key
    assert m["version"] == 2 and m["index_record_size"] == REC.size == 56
    assert m["token_dtype"] == "int32" and m["mask_dtype"] == "uint8"
    assert m["target_layer_ids"] and m["target_layer_ids"] == sorted(m["target_layer_ids"])
    assert m["num_shards"] == len(m["shards"])
    assert [s["shard_id"] for s in m["shards"]] == list(range(m["num_shards"]))
    shards = [(cache_dir / s["file_name"]).read_bytes() for s in m["shards"]]
    index = (cache_dir / "samples.idx").read_bytes()
    assert len(index) == m["num_samples"] * REC.size
    L, H = len(m["target_layer_ids"]), m["hidden_size"]
    width = 2 if m["hidden_dtype"] == "bfloat16" else 1
    samples = []
    for k in range(m["num_samples"]):
        sid, shard, n, o_ids, o_att, o_mask, o_hid, o_last = REC.unpack_from(index, k * REC.size)
        assert sid == k and n > 0
        blob = shards[shard]

        def take(offset, count, dtype):
            assert offset + count * np.dtype(dtype).itemsize <= len(blob)
            return np.frombuffer(blob, dtype=dtype, count=count, offset=offset).copy()

        def hidden(offset, cols):
            if width == 2:
                return torch.from_numpy(take(offset, n * cols, "<u2")).view(torch.bfloat16).view(n, cols)
            raw = torch.from_numpy(take(offset, n * cols, "u1")).view(FP8[m["hidden_dtype"]])
            return raw.to(torch.bfloat16).view(n, cols)  # a plain cast back: no scale

        samples.append({"input_ids": take(o_ids, n, "<i4"), "attention_mask": take(o_att, n, "u1"),
                        "loss_mask": take(o_mask, n, "u1"), "hidden": hidden(o_hid, L * H),
                        "last": hidden(o_last, H)})
    return m, samples


def ref_write(cache_dir: Path, samples: list[dict], layers: list[int], hidden_size: int,
              hidden_dtype: str = "bfloat16", shard_bytes: int = 1 << 30, extra: dict | None = None) -> None:
    """samples: input_ids, loss_mask, hidden (float [T, L*H]), last (float [T, H]); fp8 is a plain cast."""
    cache_dir.mkdir(parents=True)

    def encode(x):
        if hidden_dtype == "bfloat16":
            return x.to(torch.bfloat16).view(torch.uint16).numpy().tobytes()
        return x.to(FP8[hidden_dtype]).view(torch.uint8).numpy().tobytes()

    shards, index = [bytearray()], bytearray()
    for k, s in enumerate(samples):
        parts = [np.asarray(s["input_ids"], "<i4").tobytes(), np.ones(len(s["input_ids"]), "u1").tobytes(),
                 np.asarray(s["loss_mask"], "u1").tobytes(), encode(s["hidden"]), encode(s["last"])]
        if shards[-1] and len(shards[-1]) + sum(map(len, parts)) > shard_bytes:
            shards.append(bytearray())
        offsets = []
        for p in parts:
            offsets.append(len(shards[-1]))
            shards[-1] += p
        index += REC.pack(k, len(shards) - 1, len(s["input_ids"]), *offsets)
    for i, blob in enumerate(shards):
        (cache_dir / f"shard-{i:05d}.bin").write_bytes(bytes(blob))
    (cache_dir / "samples.idx").write_bytes(bytes(index))
    manifest = {"version": 2, "num_samples": len(samples), "num_shards": len(shards), "target_layer_ids": layers,
                "hidden_dtype": hidden_dtype, "token_dtype": "int32", "mask_dtype": "uint8",
                "index_record_size": 56, "hidden_size": hidden_size,
                "shards": [{"shard_id": i, "file_name": f"shard-{i:05d}.bin"} for i in range(len(shards))],
                "target_model_name_or_path": "Org/Target", "max_length": 1024, **(extra or {})}
    (cache_dir / "manifest.json").write_text(json.dumps(manifest))


# ---- helpers ----------------------------------------------------------------------------------

def loader_samples(url, layers=None, **kw) -> list[dict]:
    ds = TargetCacheDataset(str(url), layers=layers, **kw)
    return [ds[i] for i in range(len(ds))]


def interleave(hidden: torch.Tensor) -> torch.Tensor:
    """[L, T, H] -> [T, L*H], the reference's layout."""
    L, T, H = hidden.shape
    return hidden.transpose(0, 1).reshape(T, L * H)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint16).numpy()


def assert_same_samples(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["sample_id"] == y["sample_id"]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        assert np.array_equal(bits(x["hidden"]), bits(y["hidden"]))
        assert np.array_equal(bits(x["last_hidden"]), bits(y["last_hidden"]))


def write_store(url: Path, base: Path, layers: list[int], dtype: str) -> Path:
    """A store holding `base`'s samples with another layer order and/or dtype (the writer encodes)."""
    m = CacheReader(str(base)).manifest
    samples = loader_samples(base, layers=layers)
    manifest = {k: m[k] for k in ("target", "codec", "max_length", "chunk_tokens", "hidden_size")}
    manifest |= {"layers": layers, "dtype": dtype, "bytes_per_token": 0}
    writer = CacheWriter(str(url), manifest)
    half = len(samples) // 2
    for p, chunk in enumerate([samples[:half], samples[half:]]):
        writer.submit(PartData(
            name=f"p{p:06d}", sample_ids=np.array([s["sample_id"] for s in chunk], dtype=np.uint64),
            lengths=np.array([len(s["input_ids"]) for s in chunk], dtype=np.int64),
            input_ids=np.concatenate([s["input_ids"].numpy() for s in chunk]),
            loss_mask=np.concatenate([s["loss_mask"].numpy() for s in chunk]),
            hidden={**{layer: torch.cat([s["hidden"][k].float() for s in chunk]) for k, layer in enumerate(layers)},
                    "last": torch.cat([s["last_hidden"].float() for s in chunk])}))
    writer.close()
    return url


@pytest.fixture(scope="module")
def exported(small_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "export"
    export_reference(str(small_cache), out, target_name="Org/Target", shard_bytes=40_000)
    return out


# ---- export -----------------------------------------------------------------------------------

def test_export_is_read_by_a_reader_written_from_the_format_facts(small_cache, exported):
    m, samples = ref_read(exported)
    ours = loader_samples(small_cache)
    assert m["num_samples"] == len(ours) and m["num_shards"] > 1
    assert m["target_layer_ids"] == [-1, 0, 2] and m["hidden_dtype"] == "bfloat16" and m["hidden_size"] == 32
    assert m["target_model_name_or_path"] == "Org/Target"       # what the reference trainer compares
    assert (exported / "shard-00000.bin").is_file()
    for x, y in zip(ours, samples):
        assert np.array_equal(x["input_ids"].numpy(), y["input_ids"])
        assert np.array_equal(x["loss_mask"].numpy(), y["loss_mask"])
        assert (y["attention_mask"] == 1).all()
        assert np.array_equal(bits(interleave(x["hidden"])), bits(y["hidden"]))
        assert np.array_equal(bits(x["last_hidden"]), bits(y["last"]))
    # this project's row ids travel beside the index (the reference's ids are positions)
    ids = np.fromfile(exported / m["deepspec"]["sample_ids_file"], dtype="<u8")
    assert ids.tolist() == [s["sample_id"] for s in ours]


def test_export_then_import_round_trips_bitwise(small_cache, exported, tmp_path, trained_target, monkeypatch):
    import deepspec.cache.tools.reference as reference_mod

    # a part's hidden states are read and streamed a few records at a time (never the part at once)
    monkeypatch.setattr(reference_mod, "IMPORT_BATCH_TOKENS", 50)
    out = import_reference(exported, str(tmp_path / "back.zarr"))
    assert out["sample_ids"] == "deepspec_sample_ids.bin" and out["target_identity"] == "export manifest"
    assert_same_samples(loader_samples(small_cache), loader_samples(tmp_path / "back.zarr"))
    a, b = CacheReader(str(small_cache)).manifest, CacheReader(str(tmp_path / "back.zarr")).manifest
    for key in ("target", "layers", "dtype", "hidden_size", "max_length", "num_samples", "num_tokens"):
        assert a[key] == b[key], key
    assert verify(str(tmp_path / "back.zarr"))["ok"]
    # the trainer's identity check accepts it: the identity came back with the export
    TargetCacheDataset(str(tmp_path / "back.zarr"), expect={"target": load_identity(trained_target)})


def test_import_writes_either_backend_and_an_hdf5_store_exports_the_same_directory(small_cache, exported,
                                                                                    tmp_path):
    out = import_reference(exported, str(tmp_path / "back.h5d"), storage="hdf5")
    assert out["storage"] == "hdf5" and CacheReader(str(tmp_path / "back.h5d")).storage == "hdf5"
    assert_same_samples(loader_samples(small_cache), loader_samples(tmp_path / "back.h5d"))
    assert verify(str(tmp_path / "back.h5d"))["ok"]
    export_reference(str(tmp_path / "back.h5d"), tmp_path / "again", shard_bytes=40_000)
    for name in ["samples.idx", "deepspec_sample_ids.bin", *(p.name for p in exported.glob("shard-*.bin"))]:
        assert (tmp_path / "again" / name).read_bytes() == (exported / name).read_bytes(), name
    assert main(["cache", "import-reference", str(exported), str(tmp_path / "cli.h5d"), "--format", "hdf5"]) == 0
    assert CacheReader(str(tmp_path / "cli.h5d")).storage == "hdf5"


def test_unsorted_layers_export_ascending_and_come_back_in_store_order(small_cache, tmp_path):
    store = write_store(tmp_path / "unsorted.zarr", small_cache, [2, -1, 0], "bfloat16")
    export_reference(str(store), tmp_path / "ref")
    m, samples = ref_read(tmp_path / "ref")
    assert m["target_layer_ids"] == [-1, 0, 2]
    for x, y in zip(loader_samples(small_cache, layers=[-1, 0, 2]), samples):
        assert np.array_equal(bits(interleave(x["hidden"])), bits(y["hidden"]))
    import_reference(tmp_path / "ref", str(tmp_path / "back.zarr"))
    assert CacheReader(str(tmp_path / "back.zarr")).layers == [2, -1, 0]
    assert_same_samples(loader_samples(store), loader_samples(tmp_path / "back.zarr"))
    export_reference(str(store), tmp_path / "sub", layers=[2, 0])  # a subset, still ascending
    assert ref_read(tmp_path / "sub")[0]["target_layer_ids"] == [0, 2]


def test_fp8_store_exports_its_decoded_bfloat16(small_cache, tmp_path):
    store = write_store(tmp_path / "fp8.zarr", small_cache, [-1, 0, 2], "fp8")
    out = export_reference(str(store), tmp_path / "ref")
    assert out["hidden_dtype"] == "bfloat16" and out["source_dtype"] == "fp8"
    m, samples = ref_read(tmp_path / "ref")
    assert m["hidden_dtype"] == "bfloat16" and m["deepspec"]["dtype"] == "fp8"
    decoded = loader_samples(store)
    assert any(not torch.equal(d["hidden"], s["hidden"]) for d, s in zip(decoded, loader_samples(small_cache)))
    for x, y in zip(decoded, samples):
        assert np.array_equal(bits(interleave(x["hidden"])), bits(y["hidden"]))
        assert np.array_equal(bits(x["last_hidden"]), bits(y["last"]))
    import_reference(tmp_path / "ref", str(tmp_path / "back.zarr"))  # comes back as bf16, same values
    assert CacheReader(str(tmp_path / "back.zarr")).dtype == "bfloat16"
    assert_same_samples(decoded, loader_samples(tmp_path / "back.zarr"))


# ---- import of caches the reference wrote ------------------------------------------------------

def reference_samples(small_cache) -> list[dict]:
    return [{"input_ids": s["input_ids"].numpy(), "loss_mask": s["loss_mask"].numpy(),
             "hidden": interleave(s["hidden"]).float(), "last": s["last_hidden"].float()}
            for s in loader_samples(small_cache)]


def test_imported_fp8_reference_cache_gets_scale_one(small_cache, tmp_path, trained_target):
    ref_write(tmp_path / "ref", reference_samples(small_cache), [-1, 0, 2], 32, "float8_e4m3fn", shard_bytes=20_000)
    out = import_reference(tmp_path / "ref", str(tmp_path / "imp.zarr"), part_tokens=300)
    assert out["dtype"] == "fp8" and out["parts"] > 1 and out["sample_ids"] == "record position"
    reader = CacheReader(str(tmp_path / "imp.zarr"))
    assert reader.dtype == "fp8" and reader.layers == [-1, 0, 2]
    for i in range(len(reader)):
        for _, scale in reader.read(i, fields=("hidden", "last_hidden")).values():
            assert scale.dtype == np.float32 and (scale == 1.0).all()
    _, expected = ref_read(tmp_path / "ref")
    got = loader_samples(tmp_path / "imp.zarr")
    assert [g["sample_id"] for g in got] == list(range(len(expected)))  # the reference's ids: positions
    for g, e in zip(got, expected):
        assert np.array_equal(g["input_ids"].numpy(), e["input_ids"])
        assert np.array_equal(bits(interleave(g["hidden"])), bits(e["hidden"]))
        assert np.array_equal(bits(g["last_hidden"]), bits(e["last"]))
    assert verify(str(tmp_path / "imp.zarr"))["ok"]

    # no --target: hidden size known, the rest unknown, and the trainer's identity check refuses it
    m = reader.manifest
    assert m["target"]["hidden_size"] == 32 and "unknown" in m["target"]["weights_sha256"]
    assert m["imported_from"]["target_model_name_or_path"] == "Org/Target"
    with pytest.raises(CacheFormatError, match=r"target\.architecture: store has 'unknown"):
        TargetCacheDataset(str(tmp_path / "imp.zarr"), expect={"target": load_identity(trained_target)})
    # with --target the identity is the model's and training accepts the store
    import_reference(tmp_path / "ref", str(tmp_path / "with_target.zarr"), target_dir=trained_target)
    TargetCacheDataset(str(tmp_path / "with_target.zarr"), expect={"target": load_identity(trained_target)})


def test_imported_e5m2_reference_cache_widens_to_bfloat16_exactly(small_cache, tmp_path):
    ref_write(tmp_path / "ref", reference_samples(small_cache)[:8], [-1, 0, 2], 32, "float8_e5m2")
    import_reference(tmp_path / "ref", str(tmp_path / "imp.zarr"))
    assert CacheReader(str(tmp_path / "imp.zarr")).dtype == "bfloat16"
    _, expected = ref_read(tmp_path / "ref")
    for g, e in zip(loader_samples(tmp_path / "imp.zarr"), expected):
        assert np.array_equal(bits(interleave(g["hidden"])), bits(e["hidden"]))
        assert np.array_equal(bits(g["last_hidden"]), bits(e["last"]))


# ---- bad input --------------------------------------------------------------------------------

def _edit_manifest(d: Path, fn) -> None:
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _patch_record(d: Path, record: int, field: int, value: int) -> None:
    raw = bytearray((d / "samples.idx").read_bytes())
    fields = list(REC.unpack_from(raw, record * REC.size))
    fields[field] = value
    REC.pack_into(raw, record * REC.size, *fields)
    (d / "samples.idx").write_bytes(bytes(raw))


def _truncate_last_shard(d: Path) -> None:
    m = json.loads((d / "manifest.json").read_text())
    shard = d / m["shards"][-1]["file_name"]
    shard.write_bytes(shard.read_bytes()[:-10])


BAD = {
    "truncated shard": (_truncate_last_shard, r"shard-\d+\.bin: record \d+ of samples\.idx: target_last_hidden_states"),
    "record outside its shard": (lambda d: _patch_record(d, 3, 6, 10**9),
                                 r"shard-\d+\.bin: record 3 of samples\.idx: target_hidden_states bytes 1000000000"),
    "record in a missing shard": (lambda d: _patch_record(d, 5, 1, 99), r"samples\.idx: record 5: shard_id 99"),
    "sample id not its position": (lambda d: _patch_record(d, 2, 0, 7), r"samples\.idx: record 2: sample_id is 7"),
    "non-ascending layers": (lambda d: _edit_manifest(d, lambda m: m.update(target_layer_ids=[0, -1, 2])),
                             r"manifest\.json: field target_layer_ids \[0, -1, 2\] is not in ascending order"),
    "missing manifest key": (lambda d: _edit_manifest(d, lambda m: m.pop("hidden_size")),
                             r"manifest\.json: missing required field\(s\) \['hidden_size'\]"),
    "index size": (lambda d: _edit_manifest(d, lambda m: m.update(num_samples=m["num_samples"] + 1)),
                   r"samples\.idx: \d+ bytes, but manifest\.json num_samples"),
    "missing shard file": (lambda d: (d / "shard-00001.bin").unlink(), r"shard-00001\.bin: missing \(manifest\.json shards\[1\]\)"),
    "sample id file": (lambda d: (d / "deepspec_sample_ids.bin").write_bytes(b"\0" * 8),
                       r"deepspec_sample_ids\.bin: 8 bytes, expected 8 per sample"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_reference_input_is_refused_naming_file_and_record_or_field(exported, tmp_path, case):
    damage, message = BAD[case]
    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    damage(bad)
    with pytest.raises(CacheFormatError, match=message):
        import_reference(bad, str(tmp_path / "out.zarr"))
    assert not (tmp_path / "out.zarr").exists()  # checked before anything is written


def test_target_of_another_shape_is_refused(small_cache, tmp_path, trained_target):
    s = reference_samples(small_cache)[:2]
    ref_write(tmp_path / "ref", [dict(x, hidden=x["hidden"][:, :48], last=x["last"][:, :16]) for x in s],
              [1, 2, 3], 16)
    with pytest.raises(CacheFormatError, match=r"identity\.json: hidden_size 32 but .*manifest\.json hidden_size is 16"):
        import_reference(tmp_path / "ref", str(tmp_path / "out.zarr"), target_dir=trained_target)
    _edit_manifest(tmp_path / "ref", lambda m: m.update(hidden_size=32))
    with pytest.raises(CacheFormatError):  # the shards no longer hold 32-wide rows
        import_reference(tmp_path / "ref", str(tmp_path / "out.zarr"))


def test_nothing_is_overwritten(small_cache, exported, tmp_path):
    with pytest.raises(CacheFormatError, match="already exists and is not empty"):
        import_reference(exported, str(small_cache))
    with pytest.raises(CacheFormatError, match="already exists and is not empty"):
        export_reference(str(small_cache), exported)
    assert ref_read(exported)[0]["num_samples"] == len(TargetCacheDataset(str(small_cache)))


# ---- command line -----------------------------------------------------------------------------

def test_cli_export_and_import(small_cache, tmp_path, capsys):
    assert main(["cache", "export-reference", str(small_cache), str(tmp_path / "ref"), "--layers", "0,2",
                 "--target-name", "Org/Target", "--shard-bytes", "100000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["target_layer_ids"] == [0, 2] and out["shards"] > 1
    assert main(["cache", "import-reference", str(tmp_path / "ref"), str(tmp_path / "back.zarr"),
                 "--codec", "blosc-zstd"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == [0, 2]
    assert CacheReader(str(tmp_path / "back.zarr")).manifest["codec"] == "blosc-zstd"
    assert_same_samples(loader_samples(small_cache, layers=[0, 2]), loader_samples(tmp_path / "back.zarr"))
    assert main(["cache", "import-reference", str(tmp_path / "nope"), str(tmp_path / "x.zarr")]) == 1
    assert "manifest.json: missing" in capsys.readouterr().err


def test_import_to_and_export_from_s3(small_cache, tmp_path, moto):
    ref_write(tmp_path / "ref", reference_samples(small_cache)[:8], [-1, 0, 2], 32)
    url = f"s3://{moto.bucket('reference-import')}/lake/cache.zarr"
    import_reference(tmp_path / "ref", url, storage_options=moto.storage_options)
    with pytest.raises(CacheFormatError, match="already holds a store"):
        import_reference(tmp_path / "ref", url, storage_options=moto.storage_options)
    export_reference(url, tmp_path / "again", storage_options=moto.storage_options)
    for a, b in zip(ref_read(tmp_path / "ref")[1], ref_read(tmp_path / "again")[1], strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in ("input_ids", "attention_mask", "loss_mask"))
        assert np.array_equal(bits(a["hidden"]), bits(b["hidden"])) and np.array_equal(bits(a["last"]), bits(b["last"]))


def test_an_import_gives_its_lease_back(small_cache, tmp_path, moto):
    import threading

    ref_write(tmp_path / "ref", reference_samples(small_cache)[:4], [-1, 0, 2], 32)
    url = f"s3://{moto.bucket('reference-lease')}/lake/cache.zarr"
    import_reference(tmp_path / "ref", url, storage_options=moto.storage_options)
    s3 = moto.client()
    listed = s3.list_objects_v2(Bucket="reference-lease", Prefix="lake/cache.zarr/lease.json")
    assert listed.get("KeyCount", 0) == 0  # released, not left to expire
    assert not [t for t in threading.enumerate() if "lease" in t.name.lower() and t.is_alive()]
