"""Opening a cache store on local disk or any fsspec URL (s3://...), and its part listing."""
from __future__ import annotations

import asyncio
import functools
import os
import re
import uuid
from pathlib import Path
from typing import Any

import zarr
from zarr.storage import FsspecStore, LocalStore

from deepspec.cache.format import CONTENT_KEYS, FORMAT, FORMAT_VERSION, READ_VERSIONS, CacheFormatError
from deepspec.io import atomic_open, fsync_path


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def storage_options_for(url: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Explicit options win; for s3 an endpoint from the environment (AWS_ENDPOINT_URL) is honoured.
    Credentials are botocore's to find, instance-profile credentials (the EC2 metadata service) included:
    nothing here changes the process's environment (off EC2, `AWS_EC2_METADATA_DISABLED=true` in the
    environment skips that probe, which is the user's choice to make)."""
    opts = dict(options or {})
    if url.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_url" not in opts and "endpoint_url" not in opts.get("client_kwargs", {}):
            opts["endpoint_url"] = endpoint
    return opts


_FSYNC_POOL = None


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then every directory, deepest first, then `path` itself.
    Done once per part after all its files are written, and concurrently: fsyncs in flight together
    share the filesystem's journal commits instead of paying one each."""
    global _FSYNC_POOL
    from concurrent.futures import ThreadPoolExecutor

    if _FSYNC_POOL is None:
        _FSYNC_POOL = ThreadPoolExecutor(8, thread_name_prefix="fsync")
    files, dirs = [], []
    for dirpath, _, names in os.walk(path, topdown=False):
        files += [os.path.join(dirpath, n) for n in names]
        dirs.append(dirpath)
    list(_FSYNC_POOL.map(fsync_path, files))
    for d in dirs:
        fsync_path(d)


def durable_replace(path: Path, data) -> None:
    """io.atomic_open with zarr's own temp-file naming (`<name>.<32 hex>.partial`), which a writer
    opening the store recognises as debris."""
    with atomic_open(path, "wb", temp=path.with_suffix(f".{uuid.uuid4().hex}.partial")) as f:
        f.write(data)


class DurableLocalStore(LocalStore):
    """A LocalStore whose *replacements* of an existing key (the root manifest, a part's commit
    mark) are crash-atomic and durable: temp file, fsync, rename, fsync of the directory, so a power
    loss leaves the old or the new bytes, never an empty file. New files are written as zarr-python
    writes them and made durable in one batch before their part is committed (CacheWriter.write_part)."""

    async def _set(self, key: str, value, exclusive: bool = False) -> None:
        path = self.root / key
        if exclusive or not path.exists():
            return await super()._set(key, value, exclusive=exclusive)
        if not self._is_open:
            await self._open()
        self._check_writable()
        await asyncio.to_thread(durable_replace, path, value.as_buffer_like())


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


ROOT_KEYS = ("zarr.json", "manifest.json")  # a store's root manifest: Zarr's root group, HDF5's manifest
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


class FencedS3Store(FsspecStore):
    """An S3 store on which a writer only ever *creates* the objects of a part (`If-None-Match: *`)
    and only replaces an object it created itself (`If-Match` on the ETag it got back): the part
    commit mark. A writer that lost its lease while paused mid-part (deepspec.cache.lease) can then
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
        if not self._is_open:
            await self._open()
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


def local_path(url: str) -> Path:
    return Path(url.removeprefix("file://"))


@functools.lru_cache(maxsize=256)
def link_roots(root: str | Path) -> tuple[str, ...]:
    """Where a local store's files may resolve to: the store itself and, for a store checked out by
    DVC with `cache.type: symlink`, the DVC cache of the repository it lies in (`.dvc/cache`)."""
    real = os.path.realpath(root)
    roots = [real]
    for parent in Path(real).parents:
        if (parent / ".dvc").is_dir():
            roots.append(os.path.realpath(parent / ".dvc" / "cache"))
            break
    return tuple(roots)


def inside_store(root: str | Path, key: str, roots: tuple[str, ...] | None = None) -> str:
    """The local path of store key `key`, refused (CacheFormatError) when a symlink on the way takes
    it outside the store (a store written by someone else must not make deepspec read other files)."""
    path = os.path.join(root, key)
    real = os.path.realpath(path)
    if real != path and not any(real == r or real.startswith(r + os.sep) for r in roots or link_roots(root)):
        raise CacheFormatError(f"{root}: {key} is a link to {real}, outside the store; a store's files must "
                               "lie inside it (or in the DVC cache of its repository)")
    return path


def open_store(url: str, mode: str = "r", storage_options: dict | None = None):
    if is_remote(url):
        cls = FencedS3Store if url.startswith("s3://") and mode != "r" else FsspecStore
        return cls.from_url(url, storage_options=storage_options_for(url, storage_options), read_only=mode == "r")
    path = local_path(url)
    if mode == "r":
        if not (path / "zarr.json").exists():
            raise CacheFormatError(f"{url}: not a cache store (no zarr.json)")
        return LocalStore(path, read_only=True)
    return DurableLocalStore(path)


def open_root(url: str, mode: str = "r", storage_options: dict | None = None) -> zarr.Group:
    store = open_store(url, mode, storage_options)
    try:
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


# ---- store naming (docs/cache-format.md §9) ----------------------------------------------------

def content_of(manifest: dict) -> dict:
    """The fields that decide a store's content (format.CONTENT_KEYS), as manifest_mismatch compares
    them: the target by its hashes and shape (its `id` is derived from those)."""
    content = {k: manifest.get(k) for k in CONTENT_KEYS if k != "compute"}
    if manifest.get("compute"):  # absent in stores written before it was recorded: they keep their names
        content["compute"] = manifest["compute"]
    content["format_version"] = manifest.get("format_version", FORMAT_VERSION)
    content["target"] = {k: v for k, v in sorted((manifest.get("target") or {}).items()) if k != "id"}
    if manifest.get("storage", "zarr") != "zarr":  # absent for Zarr, so Zarr stores keep their names
        content["storage"] = manifest["storage"]
    return content


def store_key(manifest: dict) -> str:
    """The name of the store for this content inside a lake: readable fields, then a hash of all
    content fields, e.g. `3f9a2c1b7d4e5f60-L1.9.17.25.33-bf16-5d41402abc4b` (`emb` = layer -1;
    `-zstd`/`-lz4` after the dtype when a codec is set). Equal content <=> equal key."""
    import re

    from deepspec.io import fingerprint

    target = re.sub(r"[^A-Za-z0-9._]+", "_", str((manifest.get("target") or {}).get("id") or "target"))
    layers = ".".join("emb" if int(i) == -1 else str(int(i)) for i in manifest["layers"])
    dtype = {"bfloat16": "bf16"}.get(manifest["dtype"], manifest["dtype"])
    codec = "" if manifest.get("codec", "none") == "none" else "-" + manifest["codec"].removeprefix("blosc-")
    storage = "-h5" if manifest.get("storage", "zarr") == "hdf5" else ""
    return f"{target}-L{layers}-{dtype}{codec}{storage}-{fingerprint(content_of(manifest))[:12]}"


def store_url(url: str, manifest: dict) -> str:
    """The store the cache stage writes for `cache.url`. A local path *is* the store (one store,
    versioned by DVC: data/cache.zarr); a remote URL names a *lake*, a prefix holding one store per
    content, `<url>/<store_key>`, so experiments with other layers/dtype/... write siblings and never
    touch a store another experiment or teammate uses."""
    if not is_remote(url):
        return url
    return f"{url.rstrip('/')}/{store_key(manifest)}"


def _root_manifest(fs, root: str) -> dict | None:
    """The manifest JSON at a store root of either backend (Zarr: root zarr.json attributes; HDF5:
    manifest.json), or None."""
    import json

    for name in ("zarr.json", "manifest.json"):
        try:
            meta = json.loads(fs.cat_file(f"{root.rstrip('/')}/{name}"))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError):
            continue
        if not isinstance(meta, dict):
            continue
        return (meta.get("attributes") or {}) if name == "zarr.json" else meta
    return None


def check_lake(url: str, storage_options: dict | None = None) -> None:
    """A lake must not itself be a store (a cache.url written before lakes existed)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options))
    attrs = _root_manifest(fs, root) or {}
    if attrs.get("format") != FORMAT:
        return
    parent = url.rstrip("/").rsplit("/", 1)[0]
    raise CacheFormatError(
        f"{url} is a cache store, but a remote cache.url names a lake: a prefix with one store per content "
        f"(docs/cache-format.md §9). Move the store to {parent}/{store_key(attrs)} and set cache.url to "
        f"{parent}, or set cache.url to a new prefix")


def list_stores(url: str, storage_options: dict | None = None) -> list[dict]:
    """The stores directly under a lake prefix: {"url", "layers", "dtype", "codec", "storage", "samples", "tokens"}."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options))
    fs.invalidate_cache(root)
    out = []
    for child in sorted(fs.ls(root, detail=False)):
        name = child.rstrip("/").rsplit("/", 1)[-1]
        attrs = _root_manifest(fs, child) or {}
        if attrs.get("format") != FORMAT:
            continue
        out.append({"url": f"{url.rstrip('/')}/{name}", "layers": attrs.get("layers"), "dtype": attrs.get("dtype"),
                    "codec": attrs.get("codec"), "storage": attrs.get("storage", "zarr"), "samples": attrs.get("num_samples"),
                    "tokens": attrs.get("num_tokens"), "target": (attrs.get("target") or {}).get("id")})
    return out


def built_store_url(cache_url: str, manifest_path: str | Path = "data/cache/manifest.json") -> str:
    """The store the cache stage wrote, which `train` reads: the URL its manifest records (a DVC
    dependency of train); without one (a stage run by hand), a local cache.url is the store itself."""
    import json

    path = Path(manifest_path)
    if not path.exists():
        if not is_remote(cache_url):
            return cache_url
        raise CacheFormatError(f"{path}: missing; it names the store inside the lake {cache_url} "
                               "(run the cache stage first: dvc repro cache)")
    try:
        return json.loads(path.read_text())["url"]
    except (ValueError, KeyError):
        raise CacheFormatError(f"{path}: no store url recorded (rerun the cache stage)") from None


def built_manifest(manifest_path: str | Path = "data/cache/manifest.json") -> dict | None:
    """The manifest the cache stage recorded for its store (parts, index and their checksums), or
    None where the stage has not run (a store built by hand). `train` reads exactly these parts
    (CacheReader's `manifest`): a store on S3 is a pool another experiment may have switched since."""
    import json

    path = Path(manifest_path)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise CacheFormatError(f"{path}: not valid JSON (rerun the cache stage)") from None
