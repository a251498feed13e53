"""One writing job per store: a lease on `<store>/lease.json`, taken before the writer touches
anything and released when it is done (docs/cache-format.md §7).

- **S3**: the lease object is created with a conditional PUT (`If-None-Match: *`: exactly one of
  two writers racing for a free store succeeds), renewed every ttl/3 with `If-Match: <its ETag>`
  and deleted with `If-Match` on release. Whether a lease has expired is judged on the server's
  clock (the object's LastModified + its ttl against the Date of the response), so writers on hosts
  whose clocks disagree still agree. An expired lease, or one whose holder ran on this host and is
  no longer running, is taken over with `If-Match` on the stale ETag (logged): of two writers
  taking over at once only one succeeds. A holder that could not renew for a whole ttl, or whose
  renewal found another holder, stops committing parts.
- **Local disk**: `fcntl.flock` on the same file name; the kernel releases it when the holder
  exits, however it exits, so a local lock never needs to expire. The holder's identity is written
  into the file for the error message of the writer that is refused. (`filelock` takes the same
  flock, but its lock file carries nothing, so a refused writer could not be told who holds the
  store, and it has no join by run id for the other ranks of a job: the lock it would give is the
  one flock call here.)

The ranks of one `torchrun` job share rank 0's lease: rank 0 takes it under the job's run id and
the other ranks *join* by that id (a join refuses a lease held by any other run); before each
commit every rank checks that the lease is still its job's.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import time

from deepspec.cache.storage.urls import is_remote, local_path
from deepspec.cache.write.holder import (DEFAULT_TTL_S, LEASE_NAME, MAX_TTL_S, Lease, LeaseError,  # noqa: F401
                                         parse_body, describe, new_run_id, owner)
from deepspec.cache.write.lease_s3 import S3Lease

log = logging.getLogger(__name__)

def acquire(url: str, storage_options: dict | None = None, run_id: str | None = None,
            ttl: float = DEFAULT_TTL_S, host: str | None = None) -> Lease:
    run_id = run_id or new_run_id()
    if url.startswith("s3://"):
        return S3Lease(url, storage_options, run_id, ttl, host).acquire()
    if is_remote(url):
        return NoLease(url, run_id)
    return LocalLease(url, run_id, ttl, host).acquire()


def acquire_waiting(url: str, storage_options: dict | None = None, wait: float = 0.0, run_id: str | None = None,
                    ttl: float = DEFAULT_TTL_S, host: str | None = None) -> Lease:
    """`acquire`, retrying for up to `wait` seconds while the lease is refused (a cache stage holds it
    for minutes; neither lease blocks by itself); then the last LeaseError, naming the holder. A
    refusal that waiting cannot cure (a symlinked lease file) is logged at once, so nobody waits blind."""
    deadline = time.monotonic() + max(0.0, wait)
    pause, told = 0.5, False
    while True:
        try:
            return acquire(url, storage_options, run_id, ttl, host)
        except LeaseError as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            if not told:
                log.warning("%s: waiting up to %.0f s for the lease: %s", url, left, e)
                told = True
            time.sleep(min(pause, left))
            pause = min(pause * 1.5, 2.0)  # prompt after a short hold, few requests during a long one


def join(url: str, storage_options: dict | None, run_id: str) -> Lease:
    if url.startswith("s3://"):
        lease = S3Lease(url, storage_options, run_id, DEFAULT_TTL_S, joined=True)
    elif is_remote(url):
        return NoLease(url, run_id)
    else:
        lease = LocalLease(url, run_id, DEFAULT_TTL_S, joined=True)
    lease.check()
    return lease


class NoLease(Lease):
    """Object stores other than S3 offer no conditional write that deepspec uses yet."""

    def __init__(self, url: str, run_id: str):
        self.url, self.run_id = url, run_id
        log.warning("%s: no lease on this kind of store: make sure no other job writes to it", url)

    def check(self) -> None:
        pass

    def release(self) -> None:
        pass


class LocalLease(Lease):
    def __init__(self, url: str, run_id: str, ttl: float, host: str | None = None, joined: bool = False):
        self.url, self.run_id, self.ttl, self.host, self.joined = url, run_id, ttl, host, joined
        self.path = local_path(url) / LEASE_NAME
        self.fd: int | None = None

    def _holder(self, fd: int | None = None) -> dict | None:
        try:
            if fd is not None:
                return parse_body(os.pread(fd, 1 << 16, 0))
            fd = self._open(os.O_RDONLY)
            try:
                return parse_body(os.pread(fd, 1 << 16, 0))
            finally:
                os.close(fd)
        except OSError:
            return None

    def _open(self, flags: int) -> int:
        """The lease file, never through a symlink (a planted `lease.json -> ~/.bashrc` would be
        truncated and overwritten) and only if it is a regular file."""
        import stat

        try:
            fd = os.open(self.path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise LeaseError(f"{self.path}: is a symlink; a store's lease must be a regular file in it "
                                 "(remove the link)") from None
            if e.errno == errno.EISDIR:
                raise LeaseError(f"{self.path}: not a regular file; a store's lease must be one (remove it)") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise LeaseError(f"{self.path}: not a regular file; a store's lease must be one (remove it)")
        return fd

    def acquire(self) -> "LocalLease":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):
            fd = self._open(os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = self._holder(fd)
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise LeaseError(f"{self.url}: another job is writing this cache: {describe(holder)}; a local "
                                 f"lock is released when that process exits") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder removed the file between our open and our lock
                os.close(fd)
                continue
            body = json.dumps(owner(self.run_id, self.ttl, self.host)).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, body, 0)
            self.fd = fd
            return self
        raise LeaseError(f"{self.path}: could not lock (the file keeps being replaced)")

    def check(self) -> None:
        if not self.joined:
            if self.fd is None:
                raise LeaseError(f"{self.url}: this writer released its lease")
            return
        import fcntl

        holder = self._holder()
        try:
            fd = self._open(os.O_RDONLY)
        except FileNotFoundError:
            raise LeaseError(f"{self.url}: no lease held (rank 0 of run {self.run_id} is not writing)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            held = False  # we could lock it: nobody holds it
        except OSError:
            held = True
        finally:
            os.close(fd)
        if not held or not holder or holder.get("run_id") != self.run_id:
            raise LeaseError(f"{self.url}: the lease is not held by this job (run {self.run_id}): "
                             f"{describe(holder) if held else 'nobody holds it'}")

    def __del__(self):  # a writer dropped without release(): the lock goes with it, as a file's would
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def release(self) -> None:
        if self.fd is None or self.joined:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                self.path.unlink()  # while still locked: a lock file left in the store would be pushed by DVC
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


