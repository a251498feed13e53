"""The S3 lease (write/lease.py's docstring has the rules): a conditional PUT creates it, renewals
replace it with If-Match on its ETag, expiry is judged on the server's clock."""
from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta

from deepspec.cache.storage.fenced import refused_as_existing
from deepspec.cache.storage.urls import storage_options_for
from deepspec.cache.write.holder import (LEASE_NAME, Lease, LeaseError, iso_utc, now_utc, parse_body, pid_gone, describe,
                                         holder_ttl, owner)

log = logging.getLogger(__name__)

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
        return parse_body(data), r["ETag"], (server_now - r["LastModified"]).total_seconds()

    def _put(self, body: dict, **condition) -> str:
        return self._call("put_object", Body=json.dumps(body).encode(), ContentType="application/json",
                          **condition)["ETag"]

    # ---- holder ----
    def acquire(self) -> "S3Lease":
        self.body = owner(self.run_id, self.ttl, self.host)
        for _ in range(20):
            sent = time.monotonic()
            try:
                self.etag = self._put(self.body, IfNoneMatch="*")
            except OSError as e:
                if not refused_as_existing(e):
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
        expires = iso_utc(now_utc() + timedelta(seconds=max(0.0, ttl - age)))
        gone = holder is not None and pid_gone(holder)
        if age <= ttl and not gone:
            raise LeaseError(f"{self.url}: another job is writing this cache: {describe(holder)}; its lease expires "
                             f"at {expires} unless renewed (ttl {ttl:g} s). If that job is dead, wait until then "
                             f"and rerun, or delete {self.url}/{LEASE_NAME}")
        sent = time.monotonic()
        try:
            self.etag = self._put(self.body, IfMatch=etag)
        except OSError as e:
            if refused_as_existing(e) or isinstance(e, FileNotFoundError):
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
                self.etag = self._put(dict(self.body, renewed=iso_utc(now_utc())), IfMatch=self.etag)
                self.last_ok = sent
            except OSError as e:
                if not (refused_as_existing(e) or isinstance(e, FileNotFoundError)):
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
            if not (refused_as_existing(e) or isinstance(e, FileNotFoundError)):
                # an endpoint without conditional deletes: delete only after reading back that it is ours
                cur = self._get()
                if cur and cur[0] and cur[0].get("token") == self.body["token"]:
                    self._call("delete_object")
        self.etag = None
