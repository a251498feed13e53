"""A remote Zarr store read through a part mirror (`cache_dir`, deepspec/cache/read/mirror.py): whole
arrays downloaded once per mirror directory, samples read from local disk, every chunk still
checked. Requests are counted from moto_server's own request log."""
import os
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from deepspec.cache.read.checks import ChecksumError
from deepspec.cache.write.part_data import PartData
from deepspec.loader.dataset import TargetCacheDataset
from tests.loader.test_loader import check_round_trip, synthetic_parts, write_store


class Requests:
    """The requests moto_server logs from now on: (method, key, status) per line."""

    def __init__(self, moto):
        self.path = Path(moto.log.name)
        moto.log.flush()
        self.mark = self.path.stat().st_size

    def __call__(self) -> list[tuple[str, str, int]]:
        time.sleep(0.2)  # the server's log line follows its response
        text = self.path.read_bytes()[self.mark:].decode(errors="replace")
        return [(m[1], m[2], int(m[3])) for m in re.finditer(r'"(GET|HEAD|PUT|POST|DELETE) /[^/]+/(\S+) HTTP/[\d.]+" (\d+)', text)]


def shard_downloads(requests) -> Counter:
    """Whole-object GETs (status 200) of part shards, per key; range reads answer 206."""
    return Counter(key for method, key, status in requests if method == "GET" and status == 200
                   and "/parts/" in key and re.search(r"/c/0(/0)?$", key))


@pytest.fixture(scope="module")
def remote(moto):
    bucket = moto.bucket("loader-mirror")
    parts = synthetic_parts(parts=3, samples=5)
    url = write_store(f"s3://{bucket}/c.zarr", parts, "bfloat16", "none", moto.storage_options)
    return url, parts


def test_the_mirror_reads_the_same_samples_and_downloads_each_array_once(tmp_path, moto, remote):
    url, parts = remote
    seen = Requests(moto)
    ds = TargetCacheDataset(url, storage_options=moto.storage_options, cache_dir=str(tmp_path / "mirror"))
    check_round_trip(ds, parts, "bfloat16")
    downloads = shard_downloads(seen())
    arrays = 3 * (2 + 3 + 1)  # per part: input_ids, loss_mask, three layers, last_hidden
    assert len(downloads) == arrays and set(downloads.values()) == {1}
    mirror = ds.reader._process_state().mirror
    assert mirror.downloaded == arrays
    assert sorted(p.name for p in (mirror.root / "parts").iterdir()) == ["p000000", "p000001", "p000002"]
    assert not list((tmp_path / "mirror").rglob(".*.*.*"))  # no temporary directory left

    # a second reader over the same mirror: not one request for a part's bytes
    seen = Requests(moto)
    again = TargetCacheDataset(url, storage_options=moto.storage_options, cache_dir=str(tmp_path / "mirror"))
    check_round_trip(again, parts, "bfloat16")
    assert not [r for r in seen() if "/parts/" in r[1]]
    assert again.reader._process_state().mirror.downloaded == 0


@pytest.mark.parametrize("mirrored", [True, False])
def test_dataloader_workers_share_one_mirror_and_download_each_array_once(tmp_path, moto, remote, mirrored):
    """Forked workers open the store again (its clients belong to the parent's event loop), with or
    without a mirror; with one, an array two workers need is downloaded by one while the other waits."""
    url, parts = remote
    seen = Requests(moto)
    ds = TargetCacheDataset(url, storage_options=moto.storage_options,
                            cache_dir=str(tmp_path / "mirror") if mirrored else None)
    ds[0]  # the parent reads first: its clients exist before the fork
    loader = DataLoader(ds, batch_size=None, num_workers=2, shuffle=True)
    ids = sorted(int(item["sample_id"]) for item in loader)
    assert ids == sorted(int(i) for p in parts for i in p.sample_ids)
    if mirrored:
        assert set(shard_downloads(seen()).values()) == {1}


def test_a_corrupt_object_is_named_when_read_from_the_mirror(tmp_path, moto, remote):
    url, parts = remote
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    key = f"{prefix}/parts/p000001/hidden/3/c/0/0"
    s3 = moto.client()
    clean = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    body = bytearray(clean)
    body[40] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    try:
        ds = TargetCacheDataset(url, storage_options=moto.storage_options, cache_dir=str(tmp_path / "mirror"))
        ds[0]  # the first read (from the store) starts the mirror
        assert ds.reader._process_state().mirror.begun
        with pytest.raises(ChecksumError, match="p000001/hidden/3/c/0/0: chunk 0 checksum mismatch"):
            ds[5]  # part 1's first sample, read from its mirrored arrays
        assert (ds.reader._process_state().mirror.path("p000001", "hidden/3") / "zarr.json").is_file()
    finally:
        s3.put_object(Bucket=bucket, Key=key, Body=clean)


def test_a_mirrored_file_damaged_on_local_disk_is_named(tmp_path, moto, remote):
    url, _ = remote
    cache = tmp_path / "mirror"
    first = TargetCacheDataset(url, storage_options=moto.storage_options, cache_dir=str(cache))
    for i in range(len(first)):
        first[i]
    shard = first.reader._process_state().mirror.root / "parts" / "p000002" / "last_hidden" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[7] ^= 0x10
    shard.write_bytes(bytes(data))
    ds = TargetCacheDataset(url, storage_options=moto.storage_options, cache_dir=str(cache))
    with pytest.raises(ChecksumError, match="p000002/last_hidden/c/0/0: chunk 0 checksum mismatch"):
        ds[10]


def test_the_mirror_keeps_its_bound_by_dropping_the_least_recently_used_arrays(tmp_path, moto, remote):
    url, parts = remote
    ds = TargetCacheDataset(url, storage_options=moto.storage_options, cache_dir=str(tmp_path / "mirror"))
    ds.reader.mirror_bytes = 1  # nothing but what the current read needs
    check_round_trip(ds, parts, "bfloat16")
    root = ds.reader._process_state().mirror.root
    left = {p.parent.relative_to(root) for p in root.rglob("zarr.json")}
    assert left and all(str(p).startswith("parts/p000002") for p in left)  # the last sample's part alone
    assert np.array_equal(ds[0]["input_ids"].numpy(), parts[0].input_ids[:parts[0].lengths[0]])  # downloaded again


def test_stores_of_other_content_with_the_same_part_names_do_not_share_mirrored_arrays(tmp_path, moto, remote):
    """Part names come from the samples' tokens: a store of another target over the same samples has
    the same part and array names, same shapes, other values. One mirror directory serves both."""
    from deepspec.cache.write.writer import CacheWriter
    from tests.loader.test_loader import H, LAYERS

    url, parts = remote
    other = [PartData(p.name, p.sample_ids, p.lengths, p.input_ids, p.loss_mask,
                      {k: v * 2 for k, v in p.hidden.items()}) for p in parts]
    url2 = url.replace("c.zarr", "other-target.zarr")
    manifest = {"target": {"id": "another", "hidden_size": H}, "layers": LAYERS, "dtype": "bfloat16", "codec": "none",
                "max_length": 4096, "chunk_tokens": 16, "hidden_size": H}
    w = CacheWriter(url2, manifest, moto.storage_options)
    for part in other:
        w.submit(part)
    w.close()
    w.write_manifest()
    w.release()
    cache = str(tmp_path / "mirror")
    check_round_trip(TargetCacheDataset(url, storage_options=moto.storage_options, cache_dir=cache), parts, "bfloat16")
    check_round_trip(TargetCacheDataset(url2, storage_options=moto.storage_options, cache_dir=cache), other, "bfloat16")
