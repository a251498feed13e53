"""The regen stage's journal: an append-only JSONL of finished rows that makes the stage crash-safe.

Each finished row is one line, flushed and fsync'd as it completes. A rerun reads the file line by
line, drops a torn last line and only asks for what is missing, so after a kill at any point the
output holds every id exactly once. What a run holds of the rows is an index of id -> byte offset
(`deepspec.io.IdIndex`, on disk behind a small page cache): its memory does not grow with the corpus
(1.3 M rows of 4 k-token answers are tens of GB of journal), and the rows themselves are read back
from the file when the output is written. The index is derived data, rebuilt at every open, so the
journal file stays the one record.

The journal carries a fingerprint of everything that shapes an answer; a change sets it aside
(`journal-stale-<fingerprint>`), and params that switch back resume it.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from deepspec.io import IdIndex, write_json

log = logging.getLogger(__name__)

class JournalError(ValueError):
    """The journal holds a line that is not a finished row (damaged, not a torn last write)."""


class Journal:
    """Append-only JSONL of finished samples, valid for one fingerprint."""

    def __init__(self, directory: Path, fp: str):
        self.dir = directory
        self.rows_path = directory / "rows.jsonl"
        meta = directory / "meta.json"
        if directory.exists():
            old = json.loads(meta.read_text()).get("fingerprint") if meta.exists() else None
            if old != fp:
                aside = self.stale_dir(directory, old)
                if aside.exists():  # an older journal of the same fingerprint: keep both
                    aside = aside.with_name(f"{aside.name}-{time.strftime('%Y%m%dT%H%M%S')}")
                log.warning("regen journal fingerprint changed (%s -> %s): %s set aside as %s (delete it "
                            "to reclaim the space)", old, fp, directory, aside)
                directory.rename(aside)
        back = self.stale_dir(directory, fp)
        if not directory.exists() and back.is_dir():  # params switched back: its finished rows count again
            log.info("regen journal: resuming %s, set aside earlier under these params", back)
            back.rename(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if not meta.exists():
            write_json(meta, {"fingerprint": fp})
        self.index = IdIndex()
        self._reader = None
        self.done = JournalRows(self)
        try:
            self.index.add_many(self._recover())
        except BaseException:
            self.index.close()
            raise
        self._f = open(self.rows_path, "ab")

    @staticmethod
    def stale_dir(directory: Path, fp: str | None) -> Path:
        """Where a journal of another fingerprint is set aside: a sibling, never inside an output."""
        return directory.with_name(f"{directory.name}-stale-{fp}")

    def _recover(self) -> Iterator[tuple[str, int]]:
        """(id, offset) of each finished row, in one pass over the file, line by line; a torn last
        line is cut off the file once the pass reaches it."""
        if not self.rows_path.exists():
            return
        offset = 0
        with open(self.rows_path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.endswith(b"\n"):  # a kill mid-write leaves at most one torn line at the end
                    log.warning("regen journal: dropping a torn last line (%d bytes)", len(line))
                    break
                yield self._row_id(line, lineno), offset
                offset += len(line)
        if offset < self.rows_path.stat().st_size:
            with open(self.rows_path, "r+b") as f:
                f.truncate(offset)

    def _row_id(self, line: bytes, lineno: int) -> str:
        # a newline-terminated line was written whole: if it does not parse, the file was damaged
        # after the fact. Stop and say where rather than re-request (or lose) it silently.
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and isinstance(row.get("id"), str)
        except (ValueError, UnicodeDecodeError) as e:
            ok, why = False, f"not JSON ({e})"
        else:
            why = "not a finished row (a JSON object with an \"id\")"
        if not ok:
            raise JournalError(
                f"{self.rows_path}:{lineno}: corrupt journal line, {why}: {line[:80]!r}. It ends with a "
                "newline, so it is not an interrupted write: the file was damaged. Delete that line to "
                "have its row regenerated, or delete the directory to regenerate everything.")
        return row["id"]

    def append(self, row: dict) -> None:
        offset = self._f.tell()
        self._f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        self._f.flush()
        os.fsync(self._f.fileno())
        self.index.add(row["id"], offset)

    def read(self, row_id: str) -> dict:
        offset = self.index.get(row_id)
        if offset is None:
            raise KeyError(row_id)
        return self.read_at(offset)

    def read_at(self, offset: int) -> dict:
        """The row whose line starts at `offset` (an offset the index gave)."""
        if self._reader is None:
            self._reader = open(self.rows_path, "rb")
        self._reader.seek(offset)
        return json.loads(self._reader.readline())

    def ids(self) -> Iterator[str]:
        """The finished ids in journal order, each once: a pass over the file (the index is unordered)."""
        self._f.flush()
        with open(self.rows_path, "rb") as f:
            offset = 0
            for line in f:
                row_id = json.loads(line)["id"]
                if self.index.get(row_id) == offset:  # the copy that counts, not a later duplicate
                    yield row_id
                offset += len(line)

    def in_order(self, rows: Iterable[dict]) -> "FinishedRows":
        """The finished rows among `rows` (re-iterable), in their order."""
        return FinishedRows(self, rows)

    def close(self) -> None:
        self._f.close()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self.index.close()


class JournalRows(Mapping):
    """A journal's finished rows by id, each read from the file when asked for."""

    def __init__(self, journal: Journal):
        self._journal = journal

    def __getitem__(self, row_id: str) -> dict:
        return self._journal.read(row_id)

    def __contains__(self, row_id) -> bool:
        return row_id in self._journal.index

    def __iter__(self) -> Iterator[str]:
        return self._journal.ids()

    def __len__(self) -> int:
        return len(self._journal.index)


class FinishedRows(Iterable):
    """The finished rows among `rows` (a re-iterable of input rows: a list, or a SplitRows), in
    their order, read from the journal as they are iterated: what the stage writes out without
    holding the corpus's answers."""

    def __init__(self, journal: Journal, rows: Iterable[dict]):
        self._journal, self._rows = journal, rows

    def _offsets(self) -> Iterator[int]:
        """The journal offset of each finished row, one index lookup a row."""
        for r in self._rows:
            offset = self._journal.index.get(r["id"])
            if offset is not None:
                yield offset

    def __len__(self) -> int:
        return sum(1 for _ in self._offsets())

    def __getitem__(self, k: int) -> dict:
        return list(self)[k]

    def __iter__(self) -> Iterator[dict]:
        return (self._journal.read_at(offset) for offset in self._offsets())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)
