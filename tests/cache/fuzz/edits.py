"""How each mutation kind is applied to a case's copy (`apply`): JSON edits written back (an HDF5 part's
chunk table with the manifest's crc32c recomputed), shard and index entries rewritten with valid
checksums, the index moved outside the store or a part listed twice, HDF5 attributes rewritten by h5py,
truncations, bit flips, oversized objects, and, locally, links, /dev/zero, FIFOs, directories and
sparse files put where a file or directory was. A mutation that cannot apply is skipped and says why."""
from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from crc32c import crc32c

from deepspec.cache.spec.format import CacheFormatError
from tests.cache.fuzz.mutations import COLUMNS, DupKeys, Mutation, dumps, path_text
from tests.cache.fuzz.stores import (TABLE, LocalPlace, Place, Pristine, S3Place, Skip, manifest_of,
                                     read_shard_index)

HUGE_SPARSE = 1 << 40        # a local file extended (sparse: no disk, no time) far past what it declares
HUGE_OBJECT = 32 << 20       # an S3 object with a declared size (shard, part file, index) replaced by this many bytes
try:  # the most a JSON document without a declared size may be (the library's door); one just past it is refused
    from deepspec.cache.storage.door import DOCUMENT_BYTES
except ImportError:  # pragma: no cover - an older library
    DOCUMENT_BYTES = 64 << 20


def read_doc(place: Place, p: Pristine, key: str) -> Any:
    """A JSON document of the case's copy (Skip when earlier mutations made it unreadable)."""
    if key.endswith(TABLE):
        file = key[:-len(TABLE)]
        off, n, _ = table_entry(place, p, file)
        data = place.read(file)[off:off + n]
    else:
        data = place.read(key)
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise Skip(f"{key} is no longer JSON") from None


def table_entry(place: Place, p: Pristine, file: str) -> list[int]:
    """The manifest's [offset, nbytes, crc32c] of an HDF5 part file's chunk table."""
    name = file.removeprefix("parts/").removesuffix(".h5")
    try:
        m = read_doc(place, p, p.root_doc)
        entry = next(e for e in m["parts"] if isinstance(e, dict) and e.get("name") == name)
        off, n, crc = (int(v) for v in entry["chunk_index"])
    except (Skip, StopIteration, KeyError, TypeError, ValueError):
        raise Skip(f"the manifest no longer locates {file}'s chunk table") from None
    return [off, n, crc]


def write_doc(place: Place, p: Pristine, key: str, text: str) -> None:
    if not key.endswith(TABLE):
        place.write(key, text.encode())
        return
    # the chunk table is covered by a crc32c in the manifest: a hostile writer recomputes it
    file = key[:-len(TABLE)]
    off, n, _ = table_entry(place, p, file)
    blob, data = text.encode(), bytearray(place.read(file))
    if len(blob) <= n:
        blob = blob + b" " * (n - len(blob))
    else:  # too long to fit: appended to the file, which HDF5 ignores
        off, n = len(data), len(blob)
    data[off:off + n] = blob
    place.write(file, bytes(data))
    m = read_doc(place, p, p.root_doc)
    for e in manifest_of(m, p.kind)["parts"]:
        if isinstance(e, dict) and e.get("name") == file.removeprefix("parts/").removesuffix(".h5"):
            e["chunk_index"] = [off, n, crc32c(blob)]
    place.write(p.root_doc, json.dumps(m).encode())


def json_edit(place: Place, p: Pristine, m: Mutation) -> None:
    doc = read_doc(place, p, m.key)
    path = m.get("path")
    op = m.kind.removeprefix("json_")
    if not path:
        write_doc(place, p, m.key, dumps(m.get("value")))
        return
    parent = doc
    try:
        for step in path[:-1]:
            parent = parent[step]
        last = path[-1]
        parent[last]  # noqa: B018 - the path must still lead somewhere
    except (KeyError, IndexError, TypeError):
        raise Skip(f"{path_text(path)} is gone") from None
    if not isinstance(parent, list if op == "dup_item" else dict if op == "dup_key" else (list, dict)):
        raise Skip(f"{path_text(path)} is no longer in a {'list' if op == 'dup_item' else 'object'}")
    if op == "set":
        parent[last] = m.get("value")
    elif op == "delete":
        del parent[last]
    elif op == "dup_item":
        parent.insert(min(m.get("at"), len(parent)), copy.deepcopy(parent[last]))
    elif op == "dup_key":
        pairs, extra = list(parent.items()), (last, m.get("value"))
        node = DupKeys(pairs + [extra] if m.get("last") else [extra] + pairs)
        if len(path) == 1:  # a key of the document itself
            write_doc(place, p, m.key, dumps(node))
            return
        grandparent = doc
        for step in path[:-2]:
            grandparent = grandparent[step]
        grandparent[path[-2]] = node
    write_doc(place, p, m.key, dumps(doc))


def shard_index_edit(place: Place, p: Pristine, m: Mutation) -> None:
    """One entry of a Zarr shard's chunk index set, its crc32c recomputed (a hostile writer's valid index)."""
    n, _ = p.shards[m.key]
    data = bytearray(place.read(m.key))
    if len(data) < 16 * n + 4:
        raise Skip(f"{m.key} no longer holds an index")
    idx = read_shard_index(bytes(data), n).copy()
    chunk, field = m.get("chunk"), m.get("field")
    if field == "absent":
        idx[chunk] = 2**64 - 1
    else:
        idx[chunk, 0 if field == "offset" else 1] = m.get("value")
    raw = idx.astype("<u8").tobytes()
    data[-(16 * n + 4):] = raw + crc32c(raw).to_bytes(4, "little")
    place.write(m.key, bytes(data))


def index_row_edit(place: Place, p: Pristine, m: Mutation, value: int) -> None:
    """A cell of the consolidated index set to `value` with every checksum over it recomputed: the
    manifest's crc32c and, in a Zarr index shard, its chunk's entry in the crc32c table."""
    doc = read_doc(place, p, p.root_doc)
    try:
        index = manifest_of(doc, p.kind)["index"]
        key, off, nbytes, columns = index["key"], int(index["offset"]), int(index["nbytes"]), len(index["columns"])
    except (KeyError, TypeError, ValueError):
        raise Skip("the manifest no longer locates the index") from None
    data = bytearray(place.read(key))
    at = off + (m.get("row") * columns + COLUMNS[m.get("column")]) * 8
    if at + 8 > min(len(data), off + nbytes):
        raise Skip("the index no longer holds that row")
    data[at:at + 8] = struct.pack("<Q", value)
    index["crc32c"] = crc32c(bytes(data[off:off + nbytes]))
    if p.kind == "zarr" and key in p.shards:
        data = bytearray(fix_crc_table(bytes(data), *p.shards[key]))
    place.write(key, bytes(data))
    place.write(p.root_doc, json.dumps(doc).encode())


def fix_crc_table(data: bytes, n: int, table: bool) -> bytes:
    """A v4 shard's crc32c table made to hold its chunks' crc32cs again."""
    if not table:
        return data
    idx = read_shard_index(data, n)
    crcs = b"".join(crc32c(data[int(o):int(o) + int(s)]).to_bytes(4, "little") for o, s in idx)
    start = len(data) - (16 * n + 4) - (4 * n + 4)
    return data[:start] + crcs + crc32c(crcs).to_bytes(4, "little") + data[start + 4 * n + 4:]


def index_key_outside(place: Place, p: Pristine, m: Mutation) -> None:
    """The index copied outside the store, right bytes and all, and the manifest pointed at the copy."""
    doc = read_doc(place, p, p.root_doc)
    try:
        index = manifest_of(doc, p.kind)["index"]
        data = place.read(index["key"])
    except (KeyError, TypeError):
        raise Skip("the manifest no longer locates the index") from None
    key = place.write_outside("index-copy", data)
    if m.get("absolute") and isinstance(place, LocalPlace):
        key = os.path.join(place.outside, "index-copy")
    index["key"] = key
    place.write(p.root_doc, json.dumps(doc).encode())


def part_listed_twice(place: Place, p: Pristine, m: Mutation) -> None:
    """A part listed twice by an otherwise consistent store: its manifest entry and its index rows
    repeated, the index written anew (named, sized and checksummed by the library's own writer),
    the totals summed. Only the rule "no part listed twice" (§13) stands in the way."""
    from deepspec.cache.backends.writers import open_for_write

    doc = read_doc(place, p, p.root_doc)
    man = manifest_of(doc, p.kind)
    try:
        parts, index = list(man["parts"]), man["index"]
        data = place.read(index["key"])
        off, nbytes, columns = int(index["offset"]), int(index["nbytes"]), len(index["columns"])
        rows = np.frombuffer(data[off:off + nbytes], dtype="<u8").reshape(-1, columns)
        segments = [rows[rows[:, 0] == k] for k in range(len(parts))]
        twice, at = m.get("part"), m.get("at")
        parts.insert(at, copy.deepcopy(parts[twice]))
        segments.insert(at, segments[twice])
        new = np.concatenate([np.column_stack([np.full(len(s), k, dtype="<u8"), s[:, 1:]]) for k, s in
                              enumerate(segments)]).astype("<u8")
        added = dict(man["parts"][twice])
        man["num_samples"] = int(man["num_samples"]) + int(added["samples"])
        man["num_tokens"] = int(man["num_tokens"]) + int(added["tokens"])
        desc = open_for_write(place.url, p.kind, place.options).write_index(new)
    except (Skip, KeyError, TypeError, ValueError, IndexError, OSError, CacheFormatError) as e:
        raise Skip(f"the store no longer has a consistent index to repeat a part in ({type(e).__name__})") from None
    place.created(desc["key"])
    if p.kind == "zarr":
        place.created(desc["key"].removesuffix("/c/0/0") + "/zarr.json")
        place.created("index/zarr.json")
    man["parts"], man["index"] = parts, desc
    place.write(p.root_doc, json.dumps(doc).encode())


def h5_attr_edit(place: Place, p: Pristine, m: Mutation) -> None:
    """A root attribute of an HDF5 part file rewritten by h5py (the part's own commit record); with
    drop_manifest_table the manifest no longer says where the chunk table is, so readers ask the file."""
    import h5py

    with tempfile.TemporaryDirectory(prefix="fuzz-h5-") as tmp:
        path = os.path.join(tmp, "part.h5")
        Path(path).write_bytes(place.read(m.key))
        value = m.get("value")
        try:
            with h5py.File(path, "r+") as f:
                f.attrs[m.get("name")] = np.asarray(value, dtype=np.int64) if isinstance(value, tuple) else value
        except (OSError, ValueError, TypeError, KeyError) as e:  # KeyError: an earlier bit flip broke the file
            raise Skip(f"h5py cannot write that attribute ({e.__class__.__name__})") from None
        place.write(m.key, Path(path).read_bytes())
    if m.get("drop_manifest_table"):
        doc = read_doc(place, p, p.root_doc)
        name = m.key.removeprefix("parts/").removesuffix(".h5")
        for e in manifest_of(doc, p.kind).get("parts") or []:
            if isinstance(e, dict) and e.get("name") == name:
                e.pop("chunk_index", None)
        place.write(p.root_doc, json.dumps(doc).encode())


def fs_edit(place: LocalPlace, m: Mutation) -> None:
    """The local-filesystem mutations: what a path in the store is, not what its bytes are."""
    path = place.path(m.key)
    if m.kind in ("dir_link_outside", "dir_link_inside", "delete_dir"):
        if not os.path.isdir(path) or os.path.realpath(path) != os.path.abspath(path):
            raise Skip(f"{m.key} is no longer a directory reached through no link")
    elif m.kind != "delete":
        place.regular(m.key)
    if m.kind == "link_inside":
        target = place.path(m.get("target"))
        os.unlink(path)
        os.symlink(target if m.get("absolute") else os.path.relpath(target, os.path.dirname(path)), path)
    elif m.kind in ("link_outside", "dir_link_outside"):
        os.makedirs(place.outside, exist_ok=True)
        moved = os.path.join(place.outside, m.key.replace("/", "__"))
        shutil.move(path, moved)
        os.symlink(moved if m.get("absolute") else os.path.relpath(moved, os.path.dirname(path)), path)
    elif m.kind == "dev_zero":
        os.unlink(path)
        os.symlink("/dev/zero", path)
    elif m.kind == "fifo":
        os.unlink(path)
        os.mkfifo(path)
        place.fifos.append(path)
    elif m.kind == "directory":
        os.unlink(path)
        os.mkdir(path)
        if m.get("with_child"):
            Path(path, "0").write_bytes(b"{}")
    elif m.kind == "link_loop":
        os.unlink(path)
        os.symlink(os.path.basename(path), path)
    elif m.kind == "dangling_link":
        os.unlink(path)
        os.symlink(os.path.basename(path) + ".missing", path)
    elif m.kind == "huge_sparse":
        os.truncate(path, HUGE_SPARSE)
    elif m.kind == "dir_link_inside":
        shutil.rmtree(path)
        os.symlink(place.path(m.get("target")) if m.get("target") else place.url, path)
    elif m.kind == "delete_dir":
        shutil.rmtree(path)
    elif m.kind == "delete":
        place.delete(m.key)


def huge_size(key: str) -> int:
    """An oversized object's size: past the document bound for a JSON document (no declared size),
    far past the declared size of anything else."""
    return DOCUMENT_BYTES + 4096 if key.endswith(".json") else HUGE_OBJECT


def apply(place: Place, p: Pristine, m: Mutation) -> str:
    """Apply `m` to the case's copy; returns how it was applied ("skipped: why" when it could not be)."""
    try:
        if m.kind.startswith("json_"):
            json_edit(place, p, m)
        elif m.kind == "truncate":
            place.write(m.key, place.read(m.key)[:m.get("length")])
        elif m.kind == "bitflip":
            data = bytearray(place.read(m.key))
            for at, bit in m.get("flips"):
                if at < len(data):
                    data[at] ^= 1 << bit
            place.write(m.key, bytes(data))
        elif m.kind == "delete" and isinstance(place, S3Place):
            place.read(m.key)
            place.delete(m.key)
        elif m.kind == "shard_index":
            shard_index_edit(place, p, m)
        elif m.kind == "index_row":
            index_row_edit(place, p, m, m.get("value"))
        elif m.kind == "index_key_outside":
            index_key_outside(place, p, m)
        elif m.kind == "part_listed_twice":
            part_listed_twice(place, p, m)
        elif m.kind == "h5_attr":
            h5_attr_edit(place, p, m)
        elif m.kind == "huge_object":
            data = place.read(m.key)
            size = huge_size(m.key)
            place.write(m.key, data + (b" " if m.key.endswith(".json") else b"\0") * (size - len(data)))
        else:
            fs_edit(place, m)
    except Skip as e:
        return f"skipped: {e}"
    return "applied"
