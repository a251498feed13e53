"""The door every local read of a store goes through (storage/door.py), and the defects it closes:
a link inside a store that leads out of it (to a copy with the right bytes, to /dev/zero), a FIFO
where a file should be, a length read from the index that does not fit its type, and a store
checked out by a real DVC repository with `cache.type` symlink or hardlink, which must stay readable."""
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
from crc32c import crc32c

from deepspec.cache.backends.zarr.read import ZarrStore
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.storage import door
from tests.cache.test_conformance import expect_equal, make_part, write

PARTS = [make_part("p000000", 1), make_part("p000001", 2, samples=2)]


@pytest.fixture
def store(tmp_path) -> str:
    url = str(tmp_path / "store")
    write(("zarr", url, None), PARTS)
    return url


def index_file(url: str) -> str:
    return os.path.join(url, ZarrStore(url).read_manifest().index["key"])


def read_all(url: str, fast: bool = True) -> None:
    reader = CacheReader(url, fast=fast)
    for k in range(len(reader)):
        reader.read(k)


def test_the_door_refuses_keys_that_are_not_paths_inside_the_store(store):
    for key in ["/etc/passwd", "../x", "parts/../../x", "", "a\x00b"]:
        with pytest.raises(CacheFormatError, match="not a path inside the store"):
            door.read_file(store, key)


def test_the_door_refuses_what_is_not_a_regular_file_without_blocking(store, tmp_path):
    os.mkfifo(os.path.join(store, "fifo"))
    os.mkdir(os.path.join(store, "dir"))
    done = []

    def attempt():  # a blocking open of a FIFO with no writer would never return: run it aside
        for key in ("fifo", "dir"):
            with pytest.raises(CacheFormatError, match=f"{key}: (not a regular file|cannot be opened)"):
                door.read_file(store, key)
        done.append(True)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(20)
    assert done, "reading a FIFO through the door blocked"


def test_the_door_checks_declared_and_document_sizes_before_reading(store):
    key = "zarr.json"
    size = os.path.getsize(os.path.join(store, key))
    assert door.read_file(store, key, size=size) == open(os.path.join(store, key), "rb").read()
    with pytest.raises(CacheFormatError, match=f"{size} bytes; the manifest declares {size + 1}"):
        door.read_file(store, key, size=size + 1)
    with open(os.path.join(store, "big.json"), "wb") as f:  # sparse: nothing is allocated by the test either
        f.truncate(door.DOCUMENT_BYTES + 1)
    with pytest.raises(CacheFormatError, match="more than the .* such a file may have"):
        door.read_file(store, "big.json")
    with pytest.raises(CacheFormatError, match=r"bytes 0\.\.99999 asked of a file of"):
        door.read_range(store, key, 0, 99999)


@pytest.mark.parametrize("fast", [True, False])
def test_an_index_file_linked_to_an_outside_copy_is_refused(store, tmp_path, fast):
    """The right bytes in the wrong place: every checksum would pass. zarr-python's LocalStore (which
    the slow path and the index read went through) followed the link and served every sample."""
    inside = index_file(store)
    outside = tmp_path / "elsewhere" / "index-chunk"
    outside.parent.mkdir()
    shutil.move(inside, outside)
    os.symlink(outside, inside)
    with pytest.raises(CacheFormatError, match=f"is a link to {outside}, outside the store"):
        read_all(store, fast)


def test_an_index_file_linked_to_dev_zero_is_refused_before_anything_is_allocated(store):
    inside = index_file(store)
    os.remove(inside)
    os.symlink("/dev/zero", inside)
    with pytest.raises(CacheFormatError, match="is a link to /dev/zero, outside the store"):
        CacheReader(store)


def test_a_commit_record_linked_to_an_outside_copy_is_refused(store, tmp_path):
    record = os.path.join(store, "parts", "p000001", "zarr.json")
    outside = tmp_path / "record.json"
    shutil.copyfile(record, outside)
    os.remove(record)
    os.symlink(outside, record)
    s = ZarrStore(store)
    with pytest.raises(CacheFormatError, match="outside the store"):
        s.part_committed("p000001")
    assert "outside the store" in s.committed_parts()["p000001"]["damaged"]
    root = os.path.join(store, "zarr.json")  # a store whose root lists no parts lists them from their records
    doc = json.loads(open(root).read())
    doc["attributes"].update(consolidated=False, parts=[], index=None)
    open(root, "w").write(json.dumps(doc))
    with pytest.raises(CacheFormatError, match="committed part p000001 .*outside the store"):
        CacheReader(store)


def test_an_index_length_that_wraps_to_a_negative_number_is_refused(store):
    """A length of 2**64 - 5 read as int64 is -5: with the sample before it 5 tokens longer, the offsets
    still tile the part, and read_batch would return a batch with unfilled rows and a negative length."""
    root = os.path.join(store, "zarr.json")
    doc = json.loads(open(root).read())
    desc = doc["attributes"]["index"]
    path = os.path.join(store, desc["key"])
    raw = bytearray(open(path, "rb").read())
    rows = np.frombuffer(bytes(raw[desc["offset"]:desc["offset"] + desc["nbytes"]]), "<u8").reshape(desc["samples"], -1).copy()
    a, b = int(rows[0, 2]), int(rows[1, 2])
    rows[0, 2], rows[1, 2], rows[1, 1] = a + b + 5, 2**64 - 5, a + b + 5
    raw[desc["offset"]:desc["offset"] + desc["nbytes"]] = rows.tobytes()
    os.chmod(path, 0o644)
    open(path, "wb").write(bytes(raw))
    desc["crc32c"] = crc32c(rows.tobytes())
    open(root, "w").write(json.dumps(doc))
    with pytest.raises(CacheFormatError, match=rf"index row 1 \(parts/p000000\): length {2**64 - 5} is not in \[1, "):
        CacheReader(store)


def dvc(repo, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, check=True, capture_output=True,
                   env=dict(os.environ, DVC_NO_ANALYTICS="1"))


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
@pytest.mark.parametrize("kind", ["zarr", "hdf5"])
def test_a_store_checked_out_by_a_real_dvc_repo_is_read(tmp_path, link, kind):
    """`dvc add` then `dvc checkout` with `cache.type: symlink` (every file a link into the cache, here a
    `cache.dir` outside the repository) or `hardlink`: the store reads back whole."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    dvc(repo, "init", "-q")
    dvc(repo, "config", "cache.type", link)
    dvc(repo, "cache", "dir", str(tmp_path / "shared-cache"))
    url = str(repo / "cache.store")
    write((kind, url, None), PARTS)
    dvc(repo, "add", "-q", "cache.store")
    shutil.rmtree(url)
    dvc(repo, "checkout", "-q", "cache.store")
    files = [p for p in (repo / "cache.store").rglob("*") if p.is_file()]
    if link == "symlink":
        assert files and all(p.is_symlink() for p in files)
    else:
        assert files and all(p.stat().st_nlink > 1 for p in files)
    expect_equal(CacheReader(url), PARTS)
    expect_equal(CacheReader(url, fast=False), PARTS)


@pytest.mark.parametrize("fast", [True, False])
def test_a_shard_linked_to_another_arrays_shard_in_the_store_is_refused(store, fast):
    """Another array's shard has valid checksums and the same shape: read through the link, layer 0
    would be layer 2. A link inside the store must lead where its key says (or into the DVC cache)."""
    parts = os.path.join(store, "parts", "p000000")
    a, b = (os.path.join(parts, "hidden", str(layer), "c", "0", "0") for layer in (0, 2))  # conformance's layers
    os.remove(a)
    os.symlink(b, a)
    with pytest.raises(CacheFormatError, match="another file of the store"):
        read_all(store, fast)


def test_a_missing_shard_is_refused_through_the_library_not_read_as_fill_values(tmp_path):
    """zarr-python reads a shard that is not there as the array's fill value (zeros): the slow path
    checks the shard first (found by the fuzzer on an fp8 + Blosc store)."""
    url = str(tmp_path / "fp8")
    write(("zarr", url, None), [make_part("p000000", 1, dtype="fp8")], dtype="fp8", codec="blosc-zstd")
    os.remove(os.path.join(url, "parts", "p000000", "last_hidden", "c", "0", "0"))
    with pytest.raises(CacheFormatError, match="last_hidden/c/0/0: 0 bytes"):
        read_all(url, fast=False)


def test_a_shard_index_entry_pointing_at_another_chunks_bytes_is_refused(tmp_path):
    """A rewritten shard index (its own crc32c recomputed) whose chunk 2 starts at chunk 0's offset: chunk
    0's bytes carry a valid checksum, so only the layout can tell (found by the long fuzz run)."""
    import json as _json

    from deepspec.cache.backends.zarr.layout import parse_layout

    url = str(tmp_path / "fp8")
    part = make_part("p000000", 1, dtype="fp8", samples=3)
    write(("zarr", url, None), [part], dtype="fp8", codec="blosc-zstd")
    where = "parts/p000000/hidden/0"
    layout = parse_layout(where, _json.loads(open(os.path.join(url, where, "zarr.json")).read()))
    if layout.n_chunks < 3:
        pytest.skip("the part has fewer than three chunks")
    path = os.path.join(url, layout.key)
    raw = bytearray(open(path, "rb").read())
    n, at = layout.n_chunks, len(raw) - (16 * layout.n_chunks + 4)
    idx = np.frombuffer(bytes(raw[at:at + 16 * n]), "<u8").reshape(n, 2).copy()
    idx[2, 0] = idx[0, 0]
    raw[at:at + 16 * n] = idx.tobytes()
    raw[at + 16 * n:at + 16 * n + 4] = crc32c(idx.tobytes()).to_bytes(4, "little")
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CacheFormatError, match="chunk 2 declares"):
        read_all(url)
