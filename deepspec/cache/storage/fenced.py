"""Zarr stores opened to read or write: on S3 a writer only creates a part's objects and replaces only
what it created or read (conditional PUTs, `FencedS3Store`); on a local disk replacements are durable
(durable.py). The S3 precondition codes every conditional write here consults."""
from __future__ import annotations

import re

import zarr

from deepspec.cache.spec.format import FORMAT, READ_VERSIONS, CacheFormatError, parsing
from deepspec.cache.storage.door_store import BoundedFsspecStore, DoorStore
from deepspec.cache.storage.durable import DurableLocalStore
from deepspec.cache.storage.urls import is_remote, local_path, storage_options_for


PART_KEY = re.compile(r"parts/[^/]+/.+")


class PartConflict(CacheFormatError):
    pass


# S3's answers to a conditional write whose condition failed: 412 (If-None-Match on an object that
# exists, If-Match on another ETag), and 409 ConditionalRequestConflict (another conditional write to
# the key was in flight). The one list every conditional write here consults.
PRECONDITION_CODES = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


def refused_as_existing(e: BaseException) -> bool:
    """An S3 conditional write (`If-None-Match: *` on a PUT, a copy or a multipart upload's completion,
    or `If-Match`) refused by its condition: s3fs raises FileExistsError or carries the response."""
    code = getattr(e.__cause__, "response", {}).get("Error", {}).get("Code")
    return isinstance(e, FileExistsError) or code in PRECONDITION_CODES


ABSENT = ""  # the ETag a fence holds for a root that did not exist when it was read


async def fenced_read(fs, path: str) -> tuple[bytes | None, str]:
    """An S3 object's bytes and ETag (None, ABSENT when it does not exist), in one GET."""
    bucket, key, _ = fs.split_path(path)
    try:
        r = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None, ABSENT
    try:
        return await r["Body"].read(), r["ETag"]
    finally:
        r["Body"].close()


async def fenced_replace(fs, path: str, data: bytes, etag: str) -> str:
    """Replace an S3 store's root manifest only if it is still the version this writer read (`If-Match`
    on its ETag; `If-None-Match: *` if there was none): a writer whose lease was taken over while it
    was paused fails here instead of switching the new holder's store to its own parts. Returns the new ETag."""
    bucket, key, _ = fs.split_path(path)
    cond = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
    try:
        out = await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=data, **cond)
    except OSError as e:
        if isinstance(e, FileNotFoundError) or refused_as_existing(e):
            raise PartConflict(f"s3://{path}: the store's root manifest was replaced by another writer since this "
                               "writer read it; not overwriting it (was this writer's lease taken over?)") from None
        raise
    finally:
        fs.invalidate_cache(path)
    return out["ETag"]


class FencedS3Store(BoundedFsspecStore):
    """An S3 store on which a writer only ever *creates* the objects of a part (`If-None-Match: *`)
    and only replaces an object it created itself (`If-Match` on the ETag it got back): the part
    commit mark. A writer that lost its lease while paused mid-part (deepspec.cache.write.lease) can then
    make the new holder's write fail loudly, but can never overwrite or un-commit the new holder's
    part. The root zarr.json is replaced only if it is still the version this writer read
    (fenced_replace); other keys outside parts/<name>/ (the index objects, named by content) plainly."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._etags: dict[str, str] = {}
        self._root_etag: str | None = None  # the ETag of the root zarr.json as this writer first read it

    def s3_path(self, key: str) -> str:
        """The S3 path ("bucket/prefix/key") of a key of this store."""
        return f"{self.path.rstrip('/')}/{key}"

    async def get(self, key: str, prototype, byte_range=None):
        if key != "zarr.json" or byte_range is not None:
            return await super().get(key, prototype, byte_range)
        if not await self.bounded(key):
            return None
        data, etag = await fenced_read(self.fs, self.s3_path(key))
        if self._root_etag is None:
            self._root_etag = etag  # fenced from here: the root is replaced only if it is still this version
        return None if data is None else prototype.buffer.from_bytes(data)

    async def set(self, key: str, value, byte_range=None) -> None:
        if key == "zarr.json" and byte_range is None:
            if not self._is_open:
                await self._open()
            self._check_writable()
            if self._root_etag is None:  # not read yet (zarr reads the root first): fence from what is there now
                self._root_etag = (await fenced_read(self.fs, self.s3_path(key)))[1]
            self._root_etag = await fenced_replace(self.fs, self.s3_path(key), value.to_bytes(), self._root_etag)
            return
        if not PART_KEY.fullmatch(key):
            return await super().set(key, value, byte_range)
        if not self._is_open:
            await self._open()
        self._check_writable()
        path = self.s3_path(key)
        data = value.to_bytes()
        own = self._etags.get(key)
        try:
            if key.endswith("zarr.json") or own:  # small metadata: one PUT whose ETag is kept
                bucket, name, _ = self.fs.split_path(path)
                cond = {"IfMatch": own} if own else {"IfNoneMatch": "*"}
                out = await self.fs._call_s3("put_object", Bucket=bucket, Key=name, Body=data, **cond)
                self._etags[key] = out["ETag"]
            else:
                await self.fs._pipe_file(path, data, mode="create")
        except OSError as e:
            if isinstance(e, FileNotFoundError) or refused_as_existing(e):  # If-Match on a replaced object
                raise PartConflict(f"{key}: another writer created or replaced this object meanwhile; "
                                   "not overwriting it (was this writer's lease taken over?)") from None
            raise
        finally:
            self.fs.invalidate_cache(path)

    async def set_if_not_exists(self, key: str, value) -> None:
        if not PART_KEY.fullmatch(key):
            return await super().set_if_not_exists(key, value)
        if key in self._etags:
            return
        try:
            await self.set(key, value)
        except PartConflict:
            pass  # it exists: exactly what set_if_not_exists leaves alone


def open_store(url: str, mode: str = "r", storage_options: dict | None = None):
    if is_remote(url):
        cls = FencedS3Store if url.startswith("s3://") and mode != "r" else BoundedFsspecStore
        return cls.from_url(url, storage_options=storage_options_for(url, storage_options), read_only=mode == "r")
    path = local_path(url)
    if mode == "r":
        if not (path / "zarr.json").exists():
            raise CacheFormatError(f"{url}: not a cache store (no zarr.json)")
        return DoorStore(path, read_only=True)
    return DurableLocalStore(path)


def open_root(url: str, mode: str = "r", storage_options: dict | None = None) -> zarr.Group:
    store = open_store(url, mode, storage_options)
    try:
        with parsing(f"{url}: zarr.json"):  # zarr-python parses the root document: its errors name it
            return zarr.open_group(store=store, mode="r" if mode == "r" else "a", zarr_format=3)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        raise CacheFormatError(f"{url}: not a cache store (no root group)") from None


def read_manifest(root: zarr.Group, url: str) -> dict:
    attrs = dict(root.attrs)
    if attrs.get("format") != FORMAT:
        raise CacheFormatError(f"{url}: not a deepspec cache (format attribute is {attrs.get('format')!r})")
    if attrs.get("format_version") not in READ_VERSIONS:
        raise CacheFormatError(f"{url}: format_version {attrs.get('format_version')} is not supported "
                               f"(this reader knows {', '.join(map(str, READ_VERSIONS))})")
    return attrs
