"""The store-naming rule: a remote cache.url is a lake of stores named by their content."""
import hashlib
import json

import pytest

from deepspec.cache.build.stage import build_cache, cache_manifest
from deepspec.cache.spec.format import CONTENT_KEYS, CacheFormatError
from deepspec.cache.spec.manifest import manifest_mismatch
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.storage.naming import list_stores, store_key, store_url
from deepspec.config import CacheConfig
from tests.cache.test_cache import LAYERS, regen_rows, workdir

IDENT = {"architecture": "Qwen3ForCausalLM", "hidden_size": 2560, "num_layers": 36, "vocab_size": 151936,
         "config_sha256": "a" * 64, "weights_sha256": "b" * 64, "tokenizer_sha256": "c" * 64,
         "chat_template_sha256": "d" * 64, "id": "3f9a2c1b7d4e5f60"}


def manifest(layers=(1, 9, 17, 25, 33), **cache):
    return dict(cache_manifest(CacheConfig(**cache), list(layers), IDENT), format_version=1)


def test_store_key_is_readable_and_changes_with_every_content_field():
    key = store_key(manifest())
    assert key.startswith("3f9a2c1b7d4e5f60-L1.9.17.25.33-bf16-") and len(key.rsplit("-", 1)[1]) == 12
    assert store_key(manifest([-1, 0, 2], dtype="fp8", codec="blosc-zstd")).startswith(
        "3f9a2c1b7d4e5f60-Lemb.0.2-fp8-zstd-")
    base = manifest()
    variants = {
        "format_version": dict(base, format_version=2),
        "target": dict(base, target=dict(IDENT, weights_sha256="e" * 64)),
        "layers": manifest([9, 25]),
        "dtype": manifest(dtype="fp8"),
        "codec": manifest(codec="blosc-lz4"),
        "max_length": manifest(max_length=4096),
        "chunk_tokens": manifest(chunk_tokens=32),
        # how the target ran: a bf16 GPU build and an fp32 CPU build are different stores
        "compute": dict(base, compute={"dtype": "bfloat16", "attention": "sdpa", "batch_tokens": 8192}),
    }
    assert sorted(variants) == sorted(CONTENT_KEYS)  # the rule covers exactly what a writer compares
    for field, other in variants.items():
        assert manifest_mismatch(base, other) is not None, field
        assert store_key(other) != store_key(base), field
    # what does not change the content does not change the store (batch_tokens changes it through
    # `compute`, which the cache stage fills in: build.compute_of, tests/cache/test_exactness.py)
    same = dict(manifest(part_tokens=1, batch_tokens=64, storage_options={"endpoint_url": "x"}),
                target=dict(IDENT, id="renamed"), parts=[{"name": "p000000"}], num_samples=3)
    assert manifest_mismatch(base, same) is None
    assert store_key(same).rsplit("-", 1)[1] == store_key(base).rsplit("-", 1)[1]
    fp32 = dict(base, compute={"dtype": "float32", "attention": "sdpa"})
    assert manifest_mismatch(fp32, dict(fp32, compute={"dtype": "float32", "attention": "eager"})) is not None


def test_a_local_path_is_the_store_and_a_remote_url_a_lake():
    m = manifest()
    assert store_url("data/cache.zarr", m) == "data/cache.zarr"
    assert store_url("/mnt/nvme/cache.zarr", m) == "/mnt/nvme/cache.zarr"
    assert store_url("s3://bucket/deepspec/lake/", m) == f"s3://bucket/deepspec/lake/{store_key(m)}"


def objects(moto, bucket, prefix) -> dict[str, str]:
    s3, out = moto.client(), {}
    for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
        body = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        out[o["Key"]] = hashlib.sha256(body).hexdigest() + "@" + o["LastModified"].isoformat()
    return out


def test_an_s3_layer_experiment_writes_a_sibling_store_and_going_back_writes_nothing(tmp_path, trained_target,
                                                                                     moto, capsys):
    bucket = moto.bucket("naming-lake")
    lake = f"s3://{bucket}/lake"
    work = workdir(tmp_path, trained_target, regen_rows(12))
    cfg = CacheConfig(url=lake, part_tokens=200, storage_options=moto.storage_options)
    regen, target = work / "data/regen/train.jsonl", work / "data/target"
    first = build_cache(cfg, LAYERS, regen, target)
    a = first["url"]
    assert a.startswith(lake + "/") and CacheReader(a, moto.storage_options).layers == LAYERS
    before = objects(moto, bucket, "lake/")
    experiment = build_cache(cfg, [0, 2], regen, target)  # what `dvc exp run -S 'layers=[0,2]'` runs
    b = experiment["url"]
    assert b != a and b.startswith(lake + "/") and CacheReader(b, moto.storage_options).layers == [0, 2]
    after = objects(moto, bucket, "lake/")
    assert {k: v for k, v in after.items() if k.startswith(a.split("/", 3)[3] + "/")} == before
    again = build_cache(cfg, LAYERS, regen, target)  # back to the original layers: the store is complete
    assert again["url"] == a and objects(moto, bucket, "lake/") == after  # not one object rewritten
    assert len(CacheReader(a, moto.storage_options)) == 12
    stores = list_stores(lake, moto.storage_options)
    assert [(s["url"], s["layers"], s["samples"]) for s in stores] == sorted([(a, LAYERS, 12), (b, [0, 2], 12)])
    from deepspec.cli import main

    assert main(["cache", "ls", lake, "--storage-options", json.dumps(moto.storage_options)]) == 0
    assert [s["url"] for s in json.loads(capsys.readouterr().out)] == [s["url"] for s in stores]


def test_a_store_at_the_lake_url_itself_is_refused_with_the_move_to_make(tmp_path, trained_target, moto):
    """A cache.url that names a store (written before lakes existed) is not silently nested into."""
    bucket = moto.bucket("naming-old")
    work = workdir(tmp_path, trained_target, regen_rows(3))
    regen, target = work / "data/regen/train.jsonl", work / "data/target"
    from deepspec.cache.write.writer import CacheWriter
    from deepspec.models.target import load_identity

    m = cache_manifest(CacheConfig(), LAYERS, load_identity(target))
    old = f"s3://{bucket}/runs/cache.zarr"
    CacheWriter(old, m, moto.storage_options).release()
    cfg = CacheConfig(url=old, storage_options=moto.storage_options)
    with pytest.raises(CacheFormatError, match=rf"Move the store to s3://{bucket}/runs/{store_key(m)}"):
        build_cache(cfg, LAYERS, regen, target)


def test_train_reads_the_store_the_cache_stage_recorded(tmp_path):
    from deepspec.cache.storage.naming import built_store_url

    manifest = tmp_path / "manifest.json"
    assert built_store_url("data/cache.zarr", manifest) == "data/cache.zarr"  # a local path is the store
    with pytest.raises(CacheFormatError, match=r"manifest.json: missing; it names the store inside the lake"):
        built_store_url("s3://bucket/lake", manifest)
    manifest.write_text(json.dumps({"url": "s3://bucket/lake/t-L9.25-bf16-0123456789ab", "layers": [9, 25]}))
    assert built_store_url("s3://bucket/lake", manifest) == "s3://bucket/lake/t-L9.25-bf16-0123456789ab"
