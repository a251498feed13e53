"""The part mirror (deepspec/cache/read/mirror.py) on real S3 (moto_server): its disk use stays
within its bound over an epoch, counting the bytes of deleted files a process still holds open or
mapped; a process killed mid-eviction, or an array torn on disk, leaves nothing a later reader
trusts; an object larger than its zarr.json allows is refused before it is written."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fsspec.callbacks import Callback

from deepspec.cache.spec.format import CacheFormatError
from deepspec.loader.dataset import TargetCacheDataset
from tests.loader.test_loader import expected, synthetic_parts, write_store

REPO = Path(__file__).resolve().parents[2]


def make_store(moto, name: str, parts: int, samples: int):
    bucket = moto.bucket(name)
    data = synthetic_parts(parts=parts, samples=samples)
    return write_store(f"s3://{bucket}/c.zarr", data, "bfloat16", "none", moto.storage_options), data


def mirrored(url: str, moto, cache: Path, max_bytes: int | None = None) -> TargetCacheDataset:
    ds = TargetCacheDataset(url, storage_options=moto.storage_options, cache_dir=str(cache))
    if max_bytes is not None:
        ds.reader.mirror_bytes = max_bytes
        ds.reader._process_state().mirror.max_bytes = max_bytes
    return ds


def check_samples(ds, parts, indices) -> None:
    """ds[i] equal to what was written, for each i of `indices`."""
    want = expected(parts, "bfloat16")
    for i in indices:
        got, w = ds[i], want[i]
        assert got["sample_id"] == w["sample_id"]
        assert np.array_equal(got["input_ids"].numpy(), w["input_ids"])
        assert np.array_equal(got["loss_mask"].numpy(), w["loss_mask"])
        for k, layer in enumerate([-1, 3, 7]):
            assert torch.equal(got["hidden"][k], w[layer]), (i, layer)
        assert torch.equal(got["last_hidden"], w["last"])


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def held_deleted(root: Path) -> int:
    """Bytes of deleted files under `root` this process still holds: open descriptors
    (/proc/self/fd links ending in " (deleted)") and maps (/proc/self/maps), each file once."""
    prefix, seen, total = str(root), set(), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith(prefix) and link.endswith(" (deleted)"):
                st = os.stat(f"/proc/self/fd/{fd}")
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
        except OSError:
            continue  # the listing's own descriptor, or one closed since
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix) and fields[5].rstrip().endswith("(deleted)"):
                inode = int(fields[4])
                if inode not in seen:
                    seen.add(inode)
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    total += hi - lo
    return total


def part_objects(moto, url: str, part: str) -> int:
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    listed = moto.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/parts/{part}/")
    return sum(o["Size"] for o in listed["Contents"])


def test_an_epoch_keeps_the_mirror_within_its_bound_counting_what_it_holds_open(tmp_path, moto):
    """The bound mirror.py promises after each read: held() <= max(mirror_bytes, the bytes of the
    arrays the read needs) (here one part's arrays, under mirror_bytes: so mirror_bytes, tighter than
    mirror_bytes + the largest array), and what this process holds on disk is no more: the files
    under the mirror, plus deleted ones it still has open or mapped."""
    url, parts = make_store(moto, "mirror-bound-epoch", parts=4, samples=3)
    part_bytes = max(part_objects(moto, url, p.name) for p in parts)
    max_bytes = part_bytes * 3 // 2  # one part's arrays fit, two do not
    ds = mirrored(url, moto, tmp_path / "mirror", max_bytes)
    mirror = ds.reader._process_state().mirror
    order = np.random.default_rng(0).permutation(len(ds))
    starts = np.cumsum([0] + [len(p.lengths) for p in parts])
    worst = (0, 0, -1)  # (bytes held on disk, of which deleted but still open or mapped, sample)
    for i in [int(order[0]), *order.tolist()]:  # the first read goes to the store, the rest to the mirror
        check_samples(ds, parts, [i])
        part = parts[int(np.searchsorted(starts, i, side="right")) - 1].name
        assert tree_bytes(mirror.path(part, ".").resolve()) < max_bytes  # the read's arrays: its part's
        deleted = held_deleted(mirror.root)
        worst = max(worst, (tree_bytes(mirror.root) + deleted, deleted, i))
        assert mirror.held() <= max_bytes
    on_disk, deleted, i = worst
    assert on_disk <= max_bytes, f"after sample {i}: {on_disk} bytes held on disk, over the {max_bytes} bound " \
                                 f"({deleted} of them in deleted files still open or mapped)"
    assert on_disk > part_bytes  # the measure saw more than one part at a time
    assert mirror.downloaded > 4 * 6  # parts were evicted and downloaded again
    assert not list(mirror.root.rglob(".*.evicted.*"))


CHILD = r"""
import json, shutil, sys, time
from pathlib import Path

from deepspec.loader.dataset import TargetCacheDataset

url, options, cache, marker, first, then = sys.argv[1:7]
real = shutil.rmtree


def rmtree(path, *args, **kwargs):
    # the eviction of a large array, stopped half done: its shard deleted, its zarr.json not yet
    p = Path(path)
    if p.is_dir() and "hidden" in str(p) and (p / "zarr.json").exists() and (p / "c").exists():
        real(p / "c")
        Path(marker).write_text(str(p))
        time.sleep(600)
    return real(path, *args, **kwargs)


shutil.rmtree = rmtree
ds = TargetCacheDataset(url, storage_options=json.loads(options), cache_dir=cache)
ds.reader.mirror_bytes = 1
ds.reader._process_state().mirror.max_bytes = 1  # nothing but what the current read needs
for i in range(int(first)):
    ds[i]
ds[0]  # from the mirror (the first read went to the store)
ds[int(then)]  # another part: the first part's arrays are evicted
"""


def test_a_process_killed_mid_eviction_leaves_no_torn_array(tmp_path, moto):
    """A child evicts a hidden-state array and is killed with its delete half done (its shutil.rmtree
    patched to stop there: no real component fails on demand); a fresh reader of the same mirror reads
    every sample of that part as written."""
    url, parts = make_store(moto, "mirror-bound-kill", parts=2, samples=4)
    cache, marker = tmp_path / "mirror", tmp_path / "evicting"
    n0 = len(parts[0].lengths)
    env = {**os.environ, "PYTHONPATH": str(REPO), **moto.env}
    child = subprocess.Popen([sys.executable, "-c", CHILD, url, json.dumps(moto.storage_options), str(cache),
                              str(marker), str(n0), str(n0)], env=env, cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120  # a guard against a child that never gets there, not a timing check
        while not marker.exists():
            assert child.poll() is None, child.stdout.read().decode(errors="replace")
            assert time.monotonic() < deadline, "the child never began an eviction"
            time.sleep(0.05)
        time.sleep(0.05)  # the marker is written just before the child sleeps
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    evicting = Path(marker.read_text())
    assert not list(evicting.rglob("c/*"))  # the child died with its delete half done

    ds = mirrored(url, moto, cache)
    check_samples(ds, parts, [0, *range(n0)])  # the first read goes to the store, the rest to the mirror
    mirror = ds.reader._process_state().mirror
    assert mirror.downloaded >= 1  # the array whose eviction was cut short, downloaded again
    assert all(mirror.ready(parts[0].name, a) for a in ("input_ids", "loss_mask", "hidden/-1", "hidden/3",
                                                         "hidden/7", "last_hidden"))
    assert not evicting.exists()  # its debris removed by that download


@pytest.mark.parametrize("damage", ["shard missing", "shard truncated", "record missing"])
def test_a_torn_array_is_downloaded_again(tmp_path, moto, damage):
    url, parts = make_store(moto, f"mirror-bound-torn-{damage.replace(' ', '-')}", parts=2, samples=3)
    cache = tmp_path / "mirror"
    first = mirrored(url, moto, cache)
    check_samples(first, parts, [0, *range(len(first))])
    array = ("p000001", "hidden/3")
    where = first.reader._process_state().mirror.path(*array)
    shard = next(p for p in where.rglob("*") if p.is_file() and "c" in p.relative_to(where).parts)
    size = shard.stat().st_size
    if damage == "shard missing":
        shard.unlink()
    elif damage == "shard truncated":
        os.truncate(shard, size // 2)
    else:
        (where / "mirrored.json").unlink()
    assert (where / "zarr.json").is_file()

    ds = mirrored(url, moto, cache)
    mirror = ds.reader._process_state().mirror
    assert not mirror.ready(*array)
    assert mirror.ready("p000001", "hidden/7")
    mirror.ensure([array])
    assert mirror.ready(*array) and mirror.downloaded == 1 and shard.stat().st_size == size
    start = len(parts[0].lengths)
    check_samples(ds, parts, range(start, len(ds)))
    assert mirror.downloaded == 1  # the other arrays were whole


def spy_downloads(monkeypatch, mirror, declare=lambda size: size) -> list[int]:
    """Bytes of the file being downloaded, as s3fs writes it (each time it reports progress);
    `declare` rewrites the size the response declares, as a server that lies about it would."""
    fs = mirror.store.fs
    real, written = fs.get_file, []

    def get_file(rpath, lpath, callback, **kwargs):
        class Spy(Callback):
            def set_size(self, size):
                callback.set_size(declare(size))

            def relative_update(self, inc=1):
                written.append(os.path.getsize(lpath))
                callback.relative_update(inc)

        return real(rpath, lpath, callback=Spy(), **kwargs)

    monkeypatch.setattr(fs, "get_file", get_file)
    return written


@pytest.fixture(scope="module")
def oversized(moto):
    """A store whose p000000/hidden/3 shard is more than twice its declared rows' bytes and 1 MiB."""
    url, parts = make_store(moto, "mirror-bound-big", parts=1, samples=3)
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    s3 = moto.client()
    meta = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/parts/p000000/hidden/3/zarr.json")["Body"].read())
    key = f"{prefix}/parts/p000000/hidden/3/c/" + "/".join("0" for _ in meta["shape"])
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    body += bytes(2 * len(body) + (1 << 20))
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    return url, key.removeprefix(prefix + "/"), len(body)


def test_an_object_larger_than_its_zarr_json_allows_is_refused_before_it_is_written(tmp_path, moto, monkeypatch,
                                                                                     oversized):
    url, key, size = oversized
    ds = mirrored(url, moto, tmp_path / "mirror")
    mirror = ds.reader._process_state().mirror
    written = spy_downloads(monkeypatch, mirror)
    with pytest.raises(CacheFormatError, match=rf"{url}: {key}: the object is {size} bytes, more than the \d+ its "
                                               rf"zarr.json allows"):
        mirror.ensure([("p000000", "hidden/3")])
    assert written == []  # not a byte of it
    assert not mirror.ready("p000000", "hidden/3")
    # no directory of it, temporary or final: its (empty) lock file alone
    assert [p.name for p in mirror.path("p000000", "hidden").glob("*3*")] == [".3.lock"]
    with pytest.raises(CacheFormatError, match=f"{key}: the object is {size} bytes"):
        ds[1]  # a read names it too


def test_a_body_past_its_declared_size_is_stopped(tmp_path, moto, monkeypatch, oversized):
    """A response that declares no size (as some filesystems report none): the counter stops the
    body at the bound, within the one read (64 KiB in s3fs) that crosses it."""
    url, key, size = oversized
    mirror = mirrored(url, moto, tmp_path / "mirror").reader._process_state().mirror
    written = spy_downloads(monkeypatch, mirror, declare=lambda size: None)
    with pytest.raises(CacheFormatError, match=rf"{url}: {key}: the body runs past (\d+) bytes \(the bound\)") as e:
        mirror.ensure([("p000000", "hidden/3")])
    bound = int(e.value.args[0].split("runs past ")[1].split()[0])
    assert written and max(written) <= bound + (1 << 16) < size
    assert [p.name for p in mirror.path("p000000", "hidden").glob("*3*")] == [".3.lock"]
