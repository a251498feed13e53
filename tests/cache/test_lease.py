"""One writer per store: a lease on S3 (conditional PUTs on moto) and a lock on local disk, held by
real second processes (tests/cache/lease_holder.py)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from deepspec.cache.spec.format import CacheFormatError
from deepspec.cache.write.writer import CacheWriter
from tests.cache.lease_holder import MANIFEST, part
from tests.conftest import REPO, project_env


class Holder:
    """A writer in another process, driven line by line."""

    def __init__(self, url, storage_options=None, ttl=3.0, **spec):
        spec = dict(url=url, storage_options=storage_options, ttl=ttl, **spec)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cache.lease_holder", json.dumps(spec)],
                                     cwd=REPO, env=project_env(REPO), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def event(self, timeout=120) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"holder exited with {self.proc.wait(timeout)}"
        return json.loads(line)

    def held(self) -> dict:
        ev = self.event()
        assert ev["event"] == "held", ev
        self.run_id = ev["run_id"]
        return ev

    def send(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.event()

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def holders():
    made = []

    def make(*a, **kw):
        made.append(Holder(*a, **kw))
        return made[-1]

    yield make
    for h in made:
        h.close()


@pytest.fixture
def s3_store(moto):
    import uuid

    return f"s3://{moto.bucket('lease-' + uuid.uuid4().hex[:12])}/lake/store", moto.storage_options


def part_ids(url, storage_options, name) -> list[int]:
    from deepspec.cache.storage.fenced import open_root

    return [int(v) for v in open_root(url, "r", storage_options)[f"parts/{name}/sample_id"][...]]


def test_second_s3_writer_is_refused_naming_the_holder_while_the_lease_renews(s3_store, holders):
    url, so = s3_store
    a = holders(url, so, ttl=2)
    a.held()
    time.sleep(3)  # longer than the lease: only renewals keep it
    with pytest.raises(CacheFormatError) as err:
        CacheWriter(url, MANIFEST, so)
    msg = str(err.value)
    assert f"run {a.run_id}" in msg and f"pid {a.pid}" in msg and "expires at" in msg, msg
    assert a.send(do="write", part="p000000", seed=1)["event"] == "wrote"
    assert a.send(do="release")["event"] == "released"
    b = CacheWriter(url, MANIFEST, so)  # free again
    assert list(b.committed_parts()) == ["p000000"] and part_ids(url, so, "p000000") == [11, 12]
    b.release()


def test_expired_lease_of_another_host_is_taken_over(s3_store, holders, caplog):
    url, so = s3_store
    a = holders(url, so, ttl=2, lease_only=True, host="node-a")
    a.held()
    a.kill()  # its lease stays behind; it can not tell us it died
    with pytest.raises(CacheFormatError, match=r"host node-a.*expires at"):
        CacheWriter(url, MANIFEST, so)
    time.sleep(3)
    w = CacheWriter(url, MANIFEST, so)
    assert "taking over the expired lease" in caplog.text and a.run_id in caplog.text
    w.release()


def test_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(s3_store, holders, caplog):
    url, so = s3_store
    a = holders(url, so, ttl=600, lease_only=True)
    a.held()
    a.kill()
    w = CacheWriter(url, MANIFEST, so)
    assert "no longer running" in caplog.text and a.run_id in caplog.text
    w.release()


def test_two_writers_starting_together_exactly_one_wins(s3_store, holders):
    url, so = s3_store
    start = time.time() + 8  # both processes have imported everything by then
    a, b = holders(url, so, start_at=start), holders(url, so, start_at=start)
    events = sorted([a.event()["event"], b.event()["event"]])
    assert events == ["held", "refused"], events


def test_a_paused_writer_loses_its_lease_and_commits_nothing(s3_store, holders, caplog):
    """The overwrite this prevents: two writers compute the same part names. A writer stopped past its
    lease (SIGSTOP, a long GC pause, a partitioned node) is taken over; when it wakes up it must not
    commit its part over the new holder's."""
    url, so = s3_store
    a = holders(url, so, ttl=2)
    a.held()
    os.kill(a.pid, signal.SIGSTOP)
    try:
        time.sleep(3)
        b = CacheWriter(url, MANIFEST, so)
        assert "taking over the expired lease" in caplog.text
        b.write_part(part("p000000", 2))
    finally:
        os.kill(a.pid, signal.SIGCONT)
    ev = a.send(do="write", part="p000000", seed=1)
    assert ev["event"] == "failed" and "lease" in ev["error"] and b.lease.run_id in ev["error"], ev
    assert part_ids(url, so, "p000000") == [21, 22]
    b.release()


def test_local_store_is_locked_and_a_killed_holder_frees_it(tmp_path, holders):
    url = str(tmp_path / "cache.zarr")
    a = holders(url)
    a.held()
    with pytest.raises(CacheFormatError, match=rf"run {a.run_id} \(host .*, pid {a.pid}"):
        CacheWriter(url, MANIFEST)
    a.kill()
    w = CacheWriter(url, MANIFEST)
    w.write_part(part("p000000", 1))
    w.release()
    assert not (Path(url) / "lease.json").exists()  # never hashed or pushed by DVC


@pytest.mark.parametrize("where", ["local", "s3"])
def test_ranks_of_one_job_share_the_lease(where, tmp_path, s3_store):
    url, so = (str(tmp_path / "cache.zarr"), None) if where == "local" else s3_store
    rank0 = CacheWriter(url, MANIFEST, so, run_id="job-1")
    rank1 = CacheWriter(url, MANIFEST, so, rank=1, run_id="job-1")
    with pytest.raises(CacheFormatError, match="run job-1"):
        CacheWriter(url, MANIFEST, so, rank=1, run_id="job-2")
    rank1.write_part(part("p000001", 1))
    rank0.write_part(part("p000000", 2))
    rank0.release()
    with pytest.raises(CacheFormatError, match="lease"):
        rank1.write_part(part("p000002", 3))
    again = CacheWriter(url, MANIFEST, so)
    assert sorted(again.committed_parts()) == ["p000000", "p000001"]
    assert np.array_equal(part_ids(url, so, "p000001"), [11, 12])
    again.release()


def test_objects_of_a_part_are_only_created_never_overwritten_on_s3(s3_store):
    """The fence behind the lease: a writer whose lease was taken over while it was paused mid-part
    still holds its store object. Whatever it writes into a part that another writer created fails
    loudly instead of overwriting (or un-committing) that part."""
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    from deepspec.cache.storage.fenced import PartConflict, open_store

    url, so = s3_store
    holder = CacheWriter(url, MANIFEST, so)
    stale = open_store(url, "a", so)  # the paused writer's view of the same store
    holder.write_part(part("p000000", 2))
    junk = default_buffer_prototype().buffer.from_bytes(b'{"attributes": {"committed": false}}')
    for key in ("parts/p000000/zarr.json", "parts/p000000/sample_id/c/0", "parts/p000000/hidden/0/zarr.json"):
        with pytest.raises(PartConflict, match="not overwriting"):
            sync(stale.set(key, junk))
    sync(stale.set_if_not_exists("parts/p000000/zarr.json", junk))  # leaves it alone
    assert part_ids(url, so, "p000000") == [21, 22]
    assert list(holder.committed_parts()) == ["p000000"]
    holder.release()


# ---- faults a lease meets: planted files, retried PUTs, other containers, hostile bodies -----------

@pytest.mark.parametrize("planted", ["symlink", "directory"])
def test_a_planted_lease_file_is_refused_and_nothing_behind_it_is_written(tmp_path, planted):
    url = tmp_path / "store"
    url.mkdir()
    victim = tmp_path / "bashrc"
    victim.write_text("export PATH=$HOME/bin:$PATH\n")
    if planted == "symlink":
        os.symlink(victim, url / "lease.json")
    else:
        (url / "lease.json").mkdir()
    with pytest.raises(CacheFormatError, match="symlink" if planted == "symlink" else "not a regular file"):
        CacheWriter(str(url), MANIFEST)
    assert victim.read_text() == "export PATH=$HOME/bin:$PATH\n"


def test_a_retried_lease_put_whose_first_attempt_landed_keeps_the_lease(s3_store, monkeypatch, caplog):
    """botocore retries a PUT whose response timed out; when the first attempt had landed, the retry
    is answered 412 (the object exists / its ETag changed). The writer's own token is stored: it holds."""
    from deepspec.cache.write.lease import S3Lease

    url, so = s3_store
    caplog.set_level("INFO", logger="deepspec.cache.write")
    real = S3Lease._put

    def put_then_retry(self, body, **condition):
        real(self, body, **condition)        # lands; its response is lost
        return real(self, body, **condition)  # the retry: refused by the condition the first attempt spent

    monkeypatch.setattr(S3Lease, "_put", put_then_retry)
    w = CacheWriter(url, MANIFEST, so)
    w.lease.renew()  # the same on a renewal (If-Match on the ETag the first attempt replaced)
    assert w.lease.lost is None
    w.lease.check()
    w.submit(part("p000000", 1))
    w.close()
    w.release()
    assert caplog.text.count("the stored lease is this writer's") == 2


def _plant(moto, url, **body):
    from deepspec.cache.write.lease import owner

    bucket, key = url.removeprefix("s3://").split("/", 1)
    doc = dict(owner("planted0000000000", 600.0), **body)
    moto.client().put_object(Bucket=bucket, Key=f"{key}/lease.json", Body=json.dumps(doc).encode())
    return doc


def test_a_dead_pid_in_another_pid_namespace_is_not_taken_for_ours(s3_store, moto):
    """Two `--network host` containers on one node share the host name and boot id; a PID of the
    other's namespace says nothing about ours, so its lease is only taken over once it expires."""
    url, so = s3_store
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _plant(moto, url, pid=dead.pid, pid_ns="pid:[1]")
    with pytest.raises(CacheFormatError, match="run planted0000000000.*expires at"):
        CacheWriter(url, MANIFEST, so)
    _plant(moto, url, pid=dead.pid)  # this namespace: that PID is gone, the lease is taken over at once
    CacheWriter(url, MANIFEST, so).release()


@pytest.mark.parametrize("ttl", [float("nan"), 1e300, -5, "soon"])
def test_a_hostile_lease_ttl_is_bounded_not_trusted(s3_store, moto, ttl):
    url, so = s3_store
    _plant(moto, url, ttl_s=ttl, host="elsewhere")
    with pytest.raises(CacheFormatError, match=r"run planted0000000000 \(host elsewhere.*ttl 86400 s"):
        CacheWriter(url, MANIFEST, so)


@pytest.mark.parametrize("kind", ["zarr", "hdf5"])
def test_the_root_manifest_is_replaced_only_if_it_is_what_the_writer_read(s3_store, moto, kind):
    """A writer paused past its lease, whose store another job then took over and consolidated, must
    not switch the root back to its own parts: the root is written with If-Match on what it read."""
    from deepspec.cache.storage.fenced import PartConflict
    from tests.cache.test_conformance import make_part, manifest

    url, so = s3_store
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    key = f"{prefix}/{'zarr.json' if kind == 'zarr' else 'manifest.json'}"
    w = CacheWriter(url, manifest(kind), so)
    w.submit(make_part("p000000", 1))
    s3 = moto.client()
    theirs = s3.get_object(Bucket=bucket, Key=key)["Body"].read().replace(b'"layers"', b'"replaced_by": "another job", "layers"')
    s3.put_object(Bucket=bucket, Key=key, Body=theirs)  # the other job's consolidation
    with pytest.raises(PartConflict, match="root manifest was replaced by another writer"):
        w.close()
    w.release()
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == theirs


@pytest.mark.parametrize("pid", [10**20, -1, "7", True, 2.5])
def test_a_hostile_lease_pid_is_a_lease_error_not_an_overflow(s3_store, moto, pid):
    """A body of this host, boot and PID namespace whose pid is out of its type's range: an
    unreadable lease (held until it expires), never an OverflowError from os.kill."""
    from deepspec.cache.write.holder import LeaseError

    url, so = s3_store
    _plant(moto, url, pid=pid)
    with pytest.raises(LeaseError, match="an unknown writer"):
        CacheWriter(url, MANIFEST, so)
