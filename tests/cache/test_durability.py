"""Writer durability: what a kill or a power loss leaves behind is found and redone on the next open."""
import json
import os
import uuid
from pathlib import Path

import pytest

from deepspec.cache.read.reader import CacheReader
from deepspec.cache.tools.verify import verify
from deepspec.cache.write.writer import CacheWriter
from tests.cache.test_cache import array_hashes, build, regen_rows, workdir


def store_files(url: str) -> dict[str, int]:
    """Every file of a store (relative path -> size): what DVC would hash and push."""
    root = Path(url)
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def interrupted_build(work: Path, monkeypatch, fail_at: int = 3) -> tuple[str, list[str]]:
    """A build that stops while writing its `fail_at`-th part (0-based, in write order): the parts
    before it are committed. Returns the store's url and the names of the parts it started."""
    from deepspec.cache.backends.zarr.write import ZarrStoreWriter

    real = ZarrStoreWriter.open_shard
    seen: list[str] = []

    def failing(self, key):  # the part's hidden shards are opened once its small arrays are written
        name = key.split("/")[1] if key.startswith("parts/") else None
        if name is not None and name not in seen:
            seen.append(name)
        if name is not None and seen.index(name) == fail_at and "/hidden" in key:
            raise OSError(5, "Input/output error")
        return real(self, key)

    monkeypatch.setattr(ZarrStoreWriter, "open_shard", failing)
    with pytest.raises(Exception, match="Input/output error"):
        build(work, part_tokens=200)
    monkeypatch.setattr(ZarrStoreWriter, "open_shard", real)
    return str(work / "data" / "cache.zarr"), seen


@pytest.fixture
def clean_store(tmp_path, trained_target) -> str:
    work = workdir(tmp_path / "clean", trained_target, regen_rows(30))
    build(work, part_tokens=200)
    return str(work / "data" / "cache.zarr")


def test_truncated_committed_shard_is_detected_and_rewritten(tmp_path, trained_target, clean_store, monkeypatch,
                                                             caplog):
    """A power loss without fsync can leave a committed part whose shard lost its tail (or all of it):
    the rerun must not accept it. The damaged parts are rebuilt; the others are kept."""
    work = workdir(tmp_path / "crash", trained_target, regen_rows(30))
    url, seen = interrupted_build(work, monkeypatch)
    parts = Path(url) / "parts"
    assert set(seen[:3]) <= {p.name for p in parts.iterdir() if p.is_dir()}
    shard = parts / seen[1] / "hidden" / "2" / "c" / "0" / "0"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)                                   # lost tail: the index is gone
    os.truncate(parts / seen[2] / "input_ids" / "c" / "0", 0)       # delayed allocation: an empty file
    report = build(work, part_tokens=200)
    assert f"parts/{seen[1]}" in caplog.text and "damaged" in caplog.text
    assert report["parts_kept"] == 1
    assert array_hashes(url) == array_hashes(clean_store)
    assert store_files(url) == store_files(clean_store)
    assert verify(url)["ok"]


def test_zeroed_shard_tail_is_detected(tmp_path, trained_target, clean_store, caplog):
    """Blocks that were allocated but never written read back as zeros: same length, bad index."""
    work = workdir(tmp_path / "crash", trained_target, regen_rows(30))
    url = str(work / "data" / "cache.zarr")
    import shutil

    shutil.copytree(clean_store, url)
    last = sorted(p for p in (Path(url) / "parts").iterdir() if p.is_dir())[-1]
    shard = last / "last_hidden" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[-40:] = bytes(40)
    shard.write_bytes(bytes(data))
    build(work, part_tokens=200)
    assert f"parts/{last.name}" in caplog.text and "damaged" in caplog.text
    assert array_hashes(url) == array_hashes(clean_store)


def test_debris_of_a_killed_writer_is_pruned(tmp_path, trained_target, clean_store, monkeypatch):
    """Everything a SIGKILL can leave (zarr's LocalStore writes `<name>.<uuid>.partial` then renames;
    a part group is created uncommitted first) is deleted on the next open, so DVC never hashes it."""
    work = workdir(tmp_path / "crash", trained_target, regen_rows(30))
    url, seen = interrupted_build(work, monkeypatch)
    root, tmp = Path(url), f".{uuid.uuid4().hex}.partial"
    (root / f"zarr{tmp}").write_text('{"zarr_format": 3, "node_')           # root manifest being replaced
    (root / "parts" / f"zarr{tmp}").write_text("")                           # parts group being created
    (root / "parts" / seen[3] / "hidden" / "2" / "c" / "0").mkdir(parents=True, exist_ok=True)
    (root / "parts" / seen[3] / "hidden" / "2" / "c" / "0" / f"0{tmp}").write_bytes(b"\0" * 100)
    (root / "parts" / "p000004" / "offsets").mkdir(parents=True)             # killed before its zarr.json
    (root / "parts" / "p000005").mkdir()
    (root / "parts" / "p000005" / "zarr.json").write_text("")                # commit mark lost (power loss)
    build(work, part_tokens=200)
    assert store_files(url) == store_files(clean_store)
    assert array_hashes(url) == array_hashes(clean_store)


def test_shards_and_directories_are_fsynced_before_the_commit_mark(tmp_path, trained_target, monkeypatch):
    """The order that makes a committed part durable: every file and directory of the part reaches
    the disk before the commit mark is written, and the mark before the manifest that lists it."""
    events: list[tuple[str, str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), ""))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", os.path.abspath(dst), os.path.abspath(src)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    work = workdir(tmp_path, trained_target, regen_rows(12))
    build(work, part_tokens=200)
    monkeypatch.setattr(os, "fsync", real_fsync)
    monkeypatch.setattr(os, "replace", real_replace)
    root = (work / "data" / "cache.zarr").resolve()
    parts = CacheReader(str(root)).parts
    assert len(parts) >= 2

    def synced(lo, hi):
        return {path for op, path, _ in events[lo:hi] if op == "fsync"}

    for name in parts:
        part = root / "parts" / name
        mark = str(part / "zarr.json")
        assert json.loads(Path(mark).read_text())["attributes"]["committed"] is True
        # the part group is created uncommitted first, then marked committed by replacing its zarr.json
        commit = [i for i, (op, path, _) in enumerate(events) if op == "replace" and path == mark][-1]
        for p in part.rglob("*"):
            if p != part / "zarr.json":
                assert str(p) in synced(0, commit), f"{p} not fsynced before the commit mark of {name}"
        assert {str(part), str(root / "parts")} <= synced(0, commit)
        manifest = next(i for i, (op, path, _) in enumerate(events) if i > commit and op == "replace"
                        and path == str(root / "zarr.json"))
        # the mark's bytes (its temp file before the rename, or the file after) and the rename itself
        # are on disk before the manifest lists the part
        assert events[commit][2] in synced(0, commit) or mark in synced(commit, manifest)
        assert str(part) in synced(commit, manifest)
        manifest_tmp = events[manifest][2]
        assert manifest_tmp in synced(commit, manifest) and str(root) in synced(manifest, len(events))


def test_a_directory_that_is_not_a_cache_is_refused_and_left_alone(tmp_path):
    """Pruning debris deletes whatever is not part of a cache, so a writer pointed at anything else
    must refuse before it touches a file."""
    from deepspec.cache.spec.format import CacheFormatError
    from tests.cache.lease_holder import MANIFEST

    for name, files in (("plain", {"notes.txt": "x", "sub/a.bin": "1"}),
                        ("other-zarr", {"zarr.json": '{"zarr_format": 3, "node_type": "group", "attributes": {}}',
                                        "parts/zarr.json": "{}", "x/zarr.json": "{}"})):
        d = tmp_path / name
        for rel, text in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_text(text)
        before = store_files(str(d))
        with pytest.raises(CacheFormatError, match="is not a deepspec cache"):
            CacheWriter(str(d), MANIFEST)
        assert store_files(str(d)) == before  # nothing created, nothing deleted (the lock file included)


def test_shards_flushed_ahead_while_written_equal_a_build_without(tmp_path, trained_target, clean_store, monkeypatch):
    """With writeback started every few KB of a shard (FlushAhead on the fsync pool, racing the
    writer's next writes), each flush meets the shard's open descriptor, and the store's files
    equal those of a build that flushed only before each commit."""
    from deepspec.cache.storage import durable

    flushed = []
    real_fdatasync = os.fdatasync

    def fdatasync(fd):  # on a pool thread: a descriptor closed before its flush ran fails the build here
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fdatasync(fd)

    monkeypatch.setattr(durable.FlushAhead, "EVERY", 4096)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    work = workdir(tmp_path, trained_target, regen_rows(30))
    build(work, part_tokens=200)
    url = str(work / "data" / "cache.zarr")
    assert flushed and all("/hidden" in p or "/last" in p for p in flushed)
    assert array_hashes(url) == array_hashes(clean_store)
    assert verify(url)["ok"]
