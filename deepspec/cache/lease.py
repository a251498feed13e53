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
import socket
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

from deepspec.cache.format import CacheFormatError
from deepspec.cache.store import is_remote, local_path, refused_as_existing, storage_options_for

log = logging.getLogger(__name__)

LEASE_NAME = "lease.json"
DEFAULT_TTL_S = 300.0


class LeaseError(CacheFormatError):
    pass


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pid_namespace() -> str:
    """This process's PID namespace (`pid:[4026531836]`): two containers on one host (`--network host`)
    share its host name and boot id, and a PID means something only within one namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def owner(run_id: str, ttl: float, host: str | None = None) -> dict:
    return {"run_id": run_id, "host": host or socket.gethostname(), "boot_id": _boot_id(),
            "pid_ns": _pid_namespace(), "pid": os.getpid(), "created": _iso(_now()), "ttl_s": ttl,
            "token": uuid.uuid4().hex}


MAX_TTL_S = 86400.0  # a lease body is written by another job: its ttl is bounded, not trusted


def holder_ttl(holder: dict | None, default: float) -> float:
    """The holder's ttl in seconds: a stored value that is not a finite number in (0, MAX_TTL_S] (a
    hostile or broken body: NaN would never expire or always, 1e300 never) counts as MAX_TTL_S."""
    try:
        ttl = float((holder or {}).get("ttl_s", default))
    except (TypeError, ValueError):
        return MAX_TTL_S
    return ttl if 0.0 < ttl <= MAX_TTL_S else MAX_TTL_S


def describe(holder: dict | None) -> str:
    if not holder:
        return "an unknown writer (unreadable lease)"
    field = lambda k: str(holder.get(k))[:64]  # noqa: E731 - a stored body is anyone's text: shown, bounded
    return f"run {field('run_id')} (host {field('host')}, pid {field('pid')}, since {field('created')})"


def _pid_gone(holder: dict) -> bool:
    """True when the holder ran on this very machine (same host name, boot and PID namespace) and has exited."""
    if holder.get("host") != socket.gethostname() or holder.get("boot_id") != _boot_id() or not _boot_id():
        return False
    if not _pid_namespace() or holder.get("pid_ns") != _pid_namespace():
        return False  # another container (or a holder that did not say which): its PID is not ours to look up
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError, TypeError):
        return False
    return False


def _parse(data: bytes | None) -> dict | None:
    try:
        value = json.loads(data) if data else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class Lease:
    """A lease held (`acquire`) or joined (`join`) by this process. `check()` raises LeaseError
    unless this process's job still holds it; `release()` gives it up (holder only)."""

    url: str
    run_id: str

    def check(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError


def acquire(url: str, storage_options: dict | None = None, run_id: str | None = None,
            ttl: float = DEFAULT_TTL_S, host: str | None = None) -> Lease:
    run_id = run_id or new_run_id()
    if url.startswith("s3://"):
        return S3Lease(url, storage_options, run_id, ttl, host).acquire()
    if is_remote(url):
        return NoLease(url, run_id)
    return LocalLease(url, run_id, ttl, host).acquire()


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
                return _parse(os.pread(fd, 1 << 16, 0))
            fd = self._open(os.O_RDONLY)
            try:
                return _parse(os.pread(fd, 1 << 16, 0))
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


class S3Lease(Lease):
    def __init__(self, url: str, storage_options: dict | None, run_id: str, ttl: float, host: str | None = None,
                 joined: bool = False):
        import fsspec

        self.url, self.run_id, self.ttl, self.host, self.joined = url, run_id, float(ttl), host, joined
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options))
        self.bucket, self.key, _ = self.fs.split_path(f"{root.rstrip('/')}/{LEASE_NAME}")
        self.body: dict = {}
        self.etag: str | None = None
        self.last_ok = 0.0        # time.monotonic() when the last successful (re)new was *sent*
        self.lost: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ---- S3 calls (s3fs's client, so credentials and endpoints resolve as for the store) ----
    def _call(self, method: str, **kw):
        from fsspec.asyn import sync

        return sync(self.fs.loop, self.fs._call_s3, method, Bucket=self.bucket, Key=self.key, **kw)

    def _get(self):
        """(holder, etag, age in s on the server's clock) or None when there is no lease."""
        from email.utils import parsedate_to_datetime

        from fsspec.asyn import sync

        async def get():
            r = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            try:
                return r, await r["Body"].read()
            finally:
                r["Body"].close()

        try:
            r, data = sync(self.fs.loop, get)
        except FileNotFoundError:
            return None
        server_now = parsedate_to_datetime(r["ResponseMetadata"]["HTTPHeaders"]["date"])
        return _parse(data), r["ETag"], (server_now - r["LastModified"]).total_seconds()

    def _put(self, body: dict, **condition) -> str:
        return self._call("put_object", Body=json.dumps(body).encode(), ContentType="application/json",
                          **condition)["ETag"]

    @staticmethod
    def _precondition(e: Exception) -> bool:
        return refused_as_existing(e)

    # ---- holder ----
    def acquire(self) -> "S3Lease":
        self.body = owner(self.run_id, self.ttl, self.host)
        for _ in range(20):
            sent = time.monotonic()
            try:
                self.etag = self._put(self.body, IfNoneMatch="*")
            except OSError as e:
                if not self._precondition(e):
                    raise
                if self._take_over():
                    break
                continue
            self.last_ok = sent
            break
        else:
            raise LeaseError(f"{self.url}: could not take the lease (it kept changing hands)")
        self._verify_ours()
        self._thread = threading.Thread(target=self._renew_loop, name="cache-lease", daemon=True)
        self._thread.start()
        return self

    def _adopt(self, cur, sent: float) -> bool:
        """A conditional PUT refused with 412 may be this writer's own: botocore retries a PUT whose
        response timed out, and the first attempt may have landed. The stored token says whose it is."""
        if cur is None or not cur[0] or cur[0].get("token") != self.body["token"]:
            return False
        self.etag, self.last_ok = cur[1], sent
        log.info("%s: the lease write was answered 412 but the stored lease is this writer's (a retried "
                 "PUT whose first attempt landed): kept", self.url)
        return True

    def _take_over(self) -> bool:
        sent = time.monotonic()
        cur = self._get()
        if self._adopt(cur, sent):
            return True
        if cur is None:
            return False  # released meanwhile: try to create it again
        holder, etag, age = cur
        ttl = holder_ttl(holder, self.ttl)
        expires = _iso(_now() + timedelta(seconds=max(0.0, ttl - age)))
        gone = holder is not None and _pid_gone(holder)
        if age <= ttl and not gone:
            raise LeaseError(f"{self.url}: another job is writing this cache: {describe(holder)}; its lease expires "
                             f"at {expires} unless renewed (ttl {ttl:g} s). If that job is dead, wait until then "
                             f"and rerun, or delete {self.url}/{LEASE_NAME}")
        sent = time.monotonic()
        try:
            self.etag = self._put(self.body, IfMatch=etag)
        except OSError as e:
            if self._precondition(e) or isinstance(e, FileNotFoundError):
                return False  # someone renewed, released or took it first
            raise
        self.last_ok = sent
        why = "its process is no longer running" if gone else f"not renewed for {age:.0f} s > ttl {ttl:g} s"
        log.warning("%s: taking over the expired lease of %s (%s)", self.url, describe(holder), why)
        return True

    def _verify_ours(self) -> None:
        """Read back: on an endpoint that ignores conditional headers two writers could both 'win';
        only the one whose token is stored goes on (docs/cache-format.md §7)."""
        cur = self._get()
        holder = cur[0] if cur else None
        if not holder or holder.get("token") != self.body["token"]:
            raise LeaseError(f"{self.url}: another job is writing this cache: {describe(holder)} (it won the race "
                             "for the lease)")

    def renew(self) -> None:
        """One renewal; on a failed If-Match the lease is marked lost, naming the new holder."""
        with self._lock:
            if self.lost or self.etag is None:
                return
            sent = time.monotonic()
            try:
                self.etag = self._put(dict(self.body, renewed=_iso(_now())), IfMatch=self.etag)
                self.last_ok = sent
            except OSError as e:
                if not (self._precondition(e) or isinstance(e, FileNotFoundError)):
                    raise
                cur = self._get()
                if self._adopt(cur, sent):
                    return
                self.lost = describe(cur[0]) if cur else "nobody (the lease object was deleted)"
                log.error("%s: lease lost to %s", self.url, self.lost)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - a network error: retried; check() enforces the ttl
                log.warning("%s: could not renew the lease (%s); retrying", self.url, e)
            if self.lost:
                return

    def check(self) -> None:
        if self.joined:
            cur = self._get()
            holder, _, age = cur if cur else (None, None, 0.0)
            ttl = holder_ttl(holder, self.ttl)
            if not holder or holder.get("run_id") != self.run_id or age > ttl:
                raise LeaseError(f"{self.url}: the lease is not held by this job (run {self.run_id}): "
                                 f"{describe(holder) if cur else 'nobody holds it'}")
            return
        if self.etag is None:
            raise LeaseError(f"{self.url}: this writer released its lease")
        if not self.lost and time.monotonic() - self.last_ok > self.ttl / 2:
            self.renew()  # the renewal thread fell behind (a paused process): find out now
        if self.lost:
            raise LeaseError(f"{self.url}: lease lost to {self.lost}; not committing over its parts")
        if time.monotonic() - self.last_ok > self.ttl:
            raise LeaseError(f"{self.url}: lease not renewed for {time.monotonic() - self.last_ok:.0f} s "
                             f"(ttl {self.ttl:g} s); another job may take the store over")

    def release(self) -> None:
        if self.joined or self.etag is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if not self.lost:
                self._call("delete_object", IfMatch=self.etag)
        except OSError as e:
            if not (self._precondition(e) or isinstance(e, FileNotFoundError)):
                # an endpoint without conditional deletes: delete only after reading back that it is ours
                cur = self._get()
                if cur and cur[0] and cur[0].get("token") == self.body["token"]:
                    self._call("delete_object")
        self.etag = None
