"""A store written by someone else (a teammate's lake, a pulled or unpacked cache) is input deepspec does
not control. Beside the conformance suite (same four backends): every name or key a manifest supplies
is checked before it becomes a path, every declared size against the manifest before anything is
sized by it, and each case ends in an error naming the store, the part and the field, with nothing
read outside the store."""
import json
import os

import fsspec
import numpy as np
import pytest

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.read.reader import CacheReader
from deepspec.cache.storage.urls import storage_options_for
from tests.cache.test_conformance import H, make_part, where, write  # noqa: F401  (`where`: the backends fixture)

ROOT = {"zarr": "zarr.json", "hdf5": "manifest.json"}


def stored(where) -> tuple:
    kind, url, options = where
    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, options))
    fs.invalidate_cache()
    return fs, f"{root}/{ROOT[kind]}"


def edit_manifest(where, change) -> None:
    """Rewrite the store's root manifest with `change(manifest)` applied, as a hostile writer would."""
    fs, path = stored(where)
    doc = json.loads(fs.cat_file(path))
    change(doc["attributes"] if where[0] == "zarr" else doc)
    fs.pipe_file(path, json.dumps(doc).encode())


@pytest.fixture
def store(where):
    write(where, [make_part("p000000", 1), make_part("p000001", 2, samples=2)])
    return where


def refused(where, *fields: str, fast: bool = True) -> str:
    """Opening the store and reading every sample fails with a CacheFormatError naming the store and `fields`."""
    with pytest.raises(CacheFormatError) as e:
        reader = CacheReader(where[1], where[2], fast=fast)
        for k in range(len(reader)):
            reader.read(k)
    message = str(e.value)
    assert where[1] in message, message
    for field in fields:
        assert field in message, message
    return message


def test_an_index_key_outside_the_store_is_refused_though_its_bytes_are_right(store, tmp_path):
    kind, url, options = store
    fs, _ = stored(store)
    index = {}
    edit_manifest(store, lambda m: index.update(m["index"]))
    # the right bytes, outside the store: read as the index, every checksum would pass
    outside = "outside/c/0/0" if kind == "zarr" else "outside.h5"
    target = fs._strip_protocol(url).rsplit("/", 1)[0] + "/" + outside
    fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(target, fs.cat_file(fs._strip_protocol(url) + "/" + index["key"]))
    edit_manifest(store, lambda m: m["index"].update(key="../" + outside))
    refused(store, "index.key", "../" + outside)


@pytest.mark.parametrize("key", ["/etc/passwd", "index/../../x/c/0/0", "index/0123456789abcdef/c/0/0/../../../y"])
def test_absolute_or_climbing_index_keys_are_refused_without_reading_them(store, key):
    edit_manifest(store, lambda m: m["index"].update(key=key))
    message = refused(store, "index.key")
    assert "root:" not in message  # nothing of /etc/passwd


@pytest.mark.parametrize("name", ["../p000000", "p000000/../../x", "/tmp/p000000", "p00000", "P000000"])
def test_a_part_name_that_is_not_a_part_name_is_refused(store, name):
    edit_manifest(store, lambda m: m["parts"][1].update(name=name))
    refused(store, "parts[1].name")


@pytest.mark.parametrize("field,value", [("tokens", 2**60), ("samples", -1), ("samples", 10**6), ("tokens", "12")])
def test_declared_counts_are_bounded_and_consistent_before_anything_is_sized(store, field, value):
    edit_manifest(store, lambda m: m["parts"][0].update({field: value}))
    refused(store, "parts[0]")


def test_an_index_that_declares_another_size_is_refused(store):
    edit_manifest(store, lambda m: m["index"].update(nbytes=m["index"]["nbytes"] * 1000, samples=m["index"]["samples"] * 1000))
    refused(store, "index.samples")


@pytest.mark.parametrize("fast", [True, False])
def test_part_arrays_narrower_than_the_manifest_are_refused_not_read(store, fast):
    edit_manifest(store, lambda m: m.update(hidden_size=H * 2))
    refused(store, "parts/p000000", "hidden", f"[{sum(make_part('p000000', 1).lengths)}, {H * 2}]", fast=fast)


def test_a_zarr_part_that_declares_a_narrower_width_is_refused(store):
    kind, url, options = store
    if kind != "zarr":
        pytest.skip("Zarr keeps each array's shape in its own metadata object")
    fs, _ = stored(store)
    path = fs._strip_protocol(url) + "/parts/p000000/hidden/0/zarr.json"
    meta = json.loads(fs.cat_file(path))
    meta["shape"][1] = H // 2
    meta["chunk_grid"]["configuration"]["chunk_shape"][1] = H // 2
    meta["codecs"][0]["configuration"]["chunk_shape"][1] = H // 2
    fs.pipe_file(path, json.dumps(meta).encode())
    for fast in (True, False):
        refused(store, "parts/p000000/hidden/0", "declares", f"{H // 2}]", fast=fast)


@pytest.mark.parametrize("field,value", [("hidden_size", -4), ("chunk_tokens", 0), ("layers", ["../0"]),
                                         ("dtype", "float64"), ("codec", "gzip")])
def test_manifest_fields_out_of_their_domain_are_refused(store, field, value):
    edit_manifest(store, lambda m: m.update({field: value}))
    refused(store, field)


def test_a_blosc_header_that_declares_a_larger_chunk_is_refused_before_decompressing(where):
    kind, url, options = where
    if where != (kind, url, None) or kind != "zarr":
        pytest.skip("a Zarr shard on local disk is patched here; the check is in the shared reader")
    from crc32c import crc32c

    write(where, [make_part("p000000", 1)], codec="blosc-zstd")
    shard = os.path.join(url, "parts/p000000/hidden/0/c/0/0")
    raw = bytearray(open(shard, "rb").read())
    n_chunks = (len(raw) - 4) // 16  # upper bound; the real count comes from the metadata
    meta = json.loads(open(os.path.join(url, "parts/p000000/hidden/0/zarr.json")).read())
    n_chunks = meta["chunk_grid"]["configuration"]["chunk_shape"][0] // meta["codecs"][0]["configuration"]["chunk_shape"][0]
    index = np.frombuffer(bytes(raw[-(16 * n_chunks + 4):-4]), dtype="<u8").reshape(n_chunks, 2)
    offset, nbytes = int(index[0, 0]), int(index[0, 1])
    body = raw[offset:offset + nbytes - 4]
    body[4:8] = (2**31).to_bytes(4, "little")  # "2 GiB when decompressed"
    raw[offset:offset + nbytes - 4] = body
    raw[offset + nbytes - 4:offset + nbytes] = crc32c(bytes(body)).to_bytes(4, "little")  # and its checksum holds
    open(shard, "wb").write(bytes(raw))
    with pytest.raises(CacheFormatError, match="Blosc header declares 2147483648"):
        CacheReader(url).read(0)


@pytest.mark.parametrize("what", ["part", "file"])
@pytest.mark.parametrize("fast", [True, False])
def test_a_link_out_of_a_local_store_is_refused(store, tmp_path, what, fast):
    """A part directory (or one chunk file) replaced by a symlink to a copy outside the store: the
    bytes are right, every checksum would pass, and the store must not be read through it."""
    import shutil

    kind, url, options = store
    if url.startswith("s3://"):
        pytest.skip("object stores have no links")
    part = f"parts/p000000{'.h5' if kind == 'hdf5' else ''}"
    if what == "file":
        if kind == "hdf5":
            pytest.skip("an HDF5 part is one file: the part case is the file case")
        part = f"{part}/hidden/0/c/0/0"
    inside, outside = os.path.join(url, part), str(tmp_path / "elsewhere" / os.path.basename(part))
    os.makedirs(os.path.dirname(outside), exist_ok=True)
    shutil.move(inside, outside)
    os.symlink(outside, inside)
    message = refused(store, "outside the store", fast=fast)
    assert outside in message


def test_a_writer_removes_debris_that_links_out_of_the_store_without_following_it(store, tmp_path):
    """What a writer deletes on opening a store (an interrupted writer's leftovers: an unknown entry
    at the root, an uncommitted part) may be a symlink to a user's directory: the link goes, what it
    points to stays, and the writer goes on."""
    from tests.cache.test_conformance import expect_equal, manifest
    from deepspec.cache.write.writer import CacheWriter

    kind, url, options = store
    if url.startswith("s3://"):
        pytest.skip("object stores have no links")
    leftovers = ["left-behind", "parts/p000009" if kind == "zarr" else "parts/p000009.h5.tmp"]
    for k, name in enumerate(leftovers):
        users = tmp_path / f"users-{k}"
        users.mkdir()
        (users / "keep.txt").write_text("not the cache's")
        os.symlink(users, os.path.join(url, name))
    parts = [make_part("p000000", 1), make_part("p000001", 2, samples=2), make_part("p000002", 3)]
    with CacheWriter(url, manifest(kind), options) as w:
        w.submit(parts[2])
    for k, name in enumerate(leftovers):
        assert not os.path.lexists(os.path.join(url, name))
        assert (tmp_path / f"users-{k}" / "keep.txt").read_text() == "not the cache's"
    expect_equal(CacheReader(url, options), parts)


def test_a_writer_refuses_a_store_whose_parts_directory_links_out_of_it(store, tmp_path):
    """parts/ replaced by a link to a directory elsewhere (another store's parts, a user's files): a
    writer would put its new parts there, so it refuses to open the store, naming the link, and
    writes nothing on either side of it."""
    import shutil

    from tests.cache.test_conformance import manifest
    from deepspec.cache.write.writer import CacheWriter

    kind, url, options = store
    if url.startswith("s3://"):
        pytest.skip("object stores have no links")
    elsewhere = tmp_path / "elsewhere"
    shutil.move(os.path.join(url, "parts"), elsewhere)
    os.symlink(elsewhere, os.path.join(url, "parts"))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(CacheFormatError, match=f"parts is a link to {elsewhere}, outside the store"):
        with CacheWriter(url, manifest(kind), options) as w:
            w.submit(make_part("p000002", 3))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_dvc_symlink_checkout_into_the_repos_cache_is_read(tmp_path):
    """`cache.type: symlink` makes every file of a checked-out store a link into .dvc/cache: allowed."""
    import shutil

    repo = tmp_path / "repo"
    (repo / ".dvc" / "cache" / "files").mkdir(parents=True)
    url = str(repo / "data" / "cache.zarr")
    parts = [make_part("p000000", 1)]
    write(("zarr", url, None), parts)
    for n, path in enumerate(p for p in sorted((repo / "data").rglob("*")) if p.is_file()):
        target = repo / ".dvc" / "cache" / "files" / f"{n:04d}"
        shutil.move(path, target)
        os.symlink(target, path)
    reader = CacheReader(url)
    assert np.array_equal(reader.read(0)["input_ids"], parts[0].input_ids[:parts[0].lengths[0]])
