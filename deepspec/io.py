"""Small file helpers shared by every stage: atomic writes, JSONL, stable hashes."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def fingerprint(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj`: equal settings give an equal fingerprint."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def sha256_file(path: str | Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the entries created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: str | Path) -> None:
    """Delete a file or a directory tree, if there. A symbolic link is removed itself, never
    followed: what it points to (another store, a user's files) is not the deleter's."""
    import shutil

    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)  # links inside the tree are removed, not followed, too
    else:
        p.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8", temp: str | Path | None = None):
    """Write to a temp file beside `path` (`temp`, else a fresh hidden name), fsync, then rename and
    fsync the directory: readers, and a power loss, see the old or the new file, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if temp is None:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    else:
        tmp = str(temp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_open(path) as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def write_jsonl(path: str | Path, rows) -> int:
    n = 0
    with atomic_open(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


class JsonlError(ValueError):
    pass


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """Rows of a JSONL file we wrote ourselves; a bad line is an error naming file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise JsonlError(f"{path}:{lineno}: not valid JSON: {e}") from None


def hash_unit(*parts: Any) -> float:
    """A deterministic number in [0, 1) from `parts`: stable row selection that survives growth."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


# IdIndex's page cache in KiB. Lookups that miss it are reads of the temporary file (the OS's
# page cache, not this process's memory): a bounded cost per lookup instead of memory per row.
INDEX_CACHE_KIB = 256


class IdIndex:
    """A set of string ids, each with an integer (a byte offset, a line number), whose memory does not
    grow with the ids: `sqlite3.connect("")` is a private on-disk database in the temporary directory
    (TMPDIR), deleted when closed, behind a page cache of INDEX_CACHE_KIB. It is local even when the
    data it indexes sits on a network filesystem whose locks SQLite cannot trust. Thread-safe (one lock)."""

    def __init__(self):
        self._db = sqlite3.connect("", isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        for pragma in ("journal_mode=OFF", "synchronous=OFF", f"cache_size=-{INDEX_CACHE_KIB}"):
            self._db.execute(f"PRAGMA {pragma}")
        self._db.execute("CREATE TABLE rows (id TEXT PRIMARY KEY, offset INTEGER NOT NULL) WITHOUT ROWID")

    def add(self, row_id: str, offset: int) -> bool:
        """Record `row_id` at `offset` unless it is there already (the first copy counts); whether
        it was new."""
        with self._lock:
            return self._db.execute("INSERT OR IGNORE INTO rows VALUES (?, ?)", (row_id, offset)).rowcount == 1

    def add_many(self, pairs: Iterable[tuple[str, int]]) -> None:
        """`add` for each pair, in one transaction (a pass over a long file)."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany("INSERT OR IGNORE INTO rows VALUES (?, ?)", pairs)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def get(self, row_id: str) -> int | None:
        with self._lock:
            hit = self._db.execute("SELECT offset FROM rows WHERE id = ?", (row_id,)).fetchone()
        return None if hit is None else hit[0]

    def __contains__(self, row_id) -> bool:
        return isinstance(row_id, str) and self.get(row_id) is not None

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM rows").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
