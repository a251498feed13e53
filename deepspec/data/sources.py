"""Where conversations come from: the packaged corpus, a local JSONL, JSON-array or Parquet file (the
first two also gzip-compressed, `.jsonl.gz` / `.json.gz`), or a HF dataset.

Every source yields `RawRow`s in source order; a row that cannot even be parsed carries the reason
instead of a dict, so the split can count it with its line number rather than stop.
"""
from __future__ import annotations

import io
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator

from deepspec.config import ConfigError


class SourceError(RuntimeError):
    """The source as a whole is unusable (missing, unreadable): nothing is written."""


class TruncatedSource(SourceError):
    """The file ends part-way (a download that stopped): every row yielded before it was whole."""

    KEEP_HINT = "; nothing was read from this source (split.truncated_source: keep keeps the rows before the cut)"


@dataclass
class RawRow:
    where: str                      # "file.jsonl:12", "builtin:chat#7", "hf:org/name[train]#3"
    row: dict | None = None
    reason: str | None = None       # set when the row could not be parsed
    detail: str = ""


class _Gunzip(io.RawIOBase):
    """A gzip file's decompressed bytes. A stream that ends early ends as a plain EOF after everything
    it decompressed, with `truncated` set (gzip.open raises instead, dropping the block it was
    decompressing: the rows before a cut would be lost)."""

    def __init__(self, path: Path):
        self.raw = open(path, "rb")
        self.z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self.pending, self.started, self.truncated = b"", False, False

    def readable(self) -> bool:
        return True

    def readinto(self, out) -> int:
        while not self.pending:
            block = self.raw.read(1 << 16)
            if not block:
                self.truncated = self.started and not self.z.eof
                return 0
            self.started = True
            try:
                self.pending = self.z.decompress(block)
            except zlib.error as e:
                raise SourceError(f"{self.raw.name}: damaged gzip data near compressed byte {self.raw.tell()}: {e}") \
                    from None
            while self.z.eof and self.z.unused_data:  # the next member of a multi-member file
                rest, self.z = self.z.unused_data, zlib.decompressobj(16 + zlib.MAX_WBITS)
                self.pending += self.z.decompress(rest)
        n = min(len(out), len(self.pending))
        out[:n], self.pending = self.pending[:n], self.pending[n:]
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def _open(path: Path, text: bool):
    """The file, decompressed on the fly when its name ends in .gz."""
    try:
        if path.suffix == ".gz":
            stream = io.BufferedReader(_Gunzip(path))
            return io.TextIOWrapper(stream, encoding="utf-8") if text else stream
        return open(path, **({"encoding": "utf-8"} if text else {"mode": "rb"}))
    except OSError as e:
        raise SourceError(f"{path}: cannot read source file: {e.strerror}") from None


def _cut_short(f) -> bool:
    """The compressed stream behind `f` ended before its end marker."""
    raw = getattr(getattr(f, "buffer", f), "raw", None)
    return bool(getattr(raw, "truncated", False))


def _lines(f, path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line). A compressed stream that ends early: every whole line, then a
    TruncatedSource naming the last one (a last line the cut left without its newline is not one)."""
    lineno, last = 0, None
    for lineno, raw in enumerate(f, 1):
        if last is not None:
            yield last
        last = (lineno, raw)
    if _cut_short(f):
        if last is not None and last[1].endswith(b"\n"):
            yield last
        whole = lineno if last is not None and last[1].endswith(b"\n") else lineno - 1
        raise TruncatedSource(f"{path}: the compressed file is truncated after line {whole}"
                              + TruncatedSource.KEEP_HINT)
    if last is not None:
        yield last


def _jsonl_rows(path: Path) -> Iterator[RawRow]:
    with _open(path, text=False) as f:
        for lineno, raw in _lines(f, path):
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield RawRow(where, reason="non_utf8", detail=f"byte {e.start}: {e.reason}")
                continue
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield RawRow(where, reason="malformed_json", detail=e.msg)
                continue
            if not isinstance(obj, dict):
                yield RawRow(where, reason="not_an_object", detail=type(obj).__name__)
                continue
            yield RawRow(where, obj)


def json_array_rows(path: Path, chunk_chars: int = 1 << 20) -> Iterator[RawRow]:
    """The elements of a JSON array file (`[{...}, {...}]`, the form most chat dumps ship in), one at a
    time: the file is read in chunks and only the current element is held as Python objects. A `.json`
    file whose first value is an object is JSON Lines under another name and read as such."""
    decoder = json.JSONDecoder()
    with _open(path, text=True) as f:
        buf, pos, base, eof = "", 0, 0, False   # base: bytes of the file before buf

        def more() -> bool:
            nonlocal buf, pos, base, eof
            if eof:
                return False
            try:
                data = f.read(chunk_chars)
            except UnicodeDecodeError as e:
                raise SourceError(f"{path}: not UTF-8 near byte {base + len(buf[:pos].encode())}: {e.reason}") from None
            base += len(buf[:pos].encode())
            buf, pos = buf[pos:] + data, 0
            eof = not data
            return bool(data)

        def skip_space() -> str:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf) or not more():
                    return buf[pos] if pos < len(buf) else ""

        def offset() -> int:
            return base + len(buf[:pos].encode())

        first = skip_space()
        if first != "[":
            f.close()
            yield from _jsonl_rows(path)
            return
        pos += 1
        index = 0
        while True:
            c = skip_space()
            if c == "]" and index == 0:
                pos += 1
                break
            start = offset()
            while True:
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    if more():
                        continue
                    raise TruncatedSource(f"{path}: element {index + 1} at byte {start}: the JSON array is "
                                          f"truncated or malformed ({e.msg})" + TruncatedSource.KEEP_HINT) from None
                # a number or literal at the end of the buffer may continue in the next chunk
                if end == len(buf) and not eof and not isinstance(obj, (dict, list, str)):
                    more()
                    continue
                break
            pos = end
            index += 1
            where = f"{path}:element {index}"
            if isinstance(obj, dict):
                yield RawRow(where, obj)
            else:
                yield RawRow(where, reason="not_an_object", detail=type(obj).__name__)
            c = skip_space()
            if c == ",":
                pos += 1
            elif c == "]":
                pos += 1
                break
            else:
                if c:
                    raise SourceError(f"{path}: byte {offset()}: expected ',' or ']' after element {index} of the "
                                      f"JSON array, found {c!r}")
                raise TruncatedSource(f"{path}: the JSON array ends after element {index} at byte {offset()} without "
                                      "its closing ']' (a truncated file)" + TruncatedSource.KEEP_HINT)
        if skip_space():
            raise SourceError(f"{path}: byte {offset()}: data after the JSON array's closing ']'")
        if _cut_short(f):  # the array is whole, but the compressed stream lost its end
            raise TruncatedSource(f"{path}: the compressed file is truncated after its JSON array's last element"
                                  + TruncatedSource.KEEP_HINT)


def _parquet_rows(path: Path) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as e:
        raise SourceError(f"{path}: cannot read Parquet source: {e}") from None
    index = 0
    for batch in pf.iter_batches(batch_size=4096):
        for obj in batch.to_pylist():
            index += 1
            yield RawRow(f"{path}:row {index}", obj)


def _hf_rows(spec: str, split: str) -> Iterator[RawRow]:
    import datasets

    name = spec[len("hf:"):]
    local = Path(name)
    hub = not local.exists()
    try:
        if local.is_dir() and (local / "dataset_info.json").exists() and (local / "state.json").exists():
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            if hub:  # through the hub cache: what is there already is used as is, offline or not
                from huggingface_hub import snapshot_download

                repo, _, revision = name.partition("@")
                local = Path(snapshot_download(repo, repo_type="dataset", revision=revision or None))
            ds = datasets.load_dataset(str(local), split=split)
    except Exception as e:  # datasets raises many types; all mean "this source is unusable"
        hint = ""
        if hub:
            from deepspec.hub import offline_hint

            hint = f". {offline_hint()}"
        raise SourceError(f"{spec}: cannot load dataset (split {split!r}): {type(e).__name__}: "
                          f"{str(e)[:300]}{hint}") from None
    for i, obj in enumerate(ds):
        yield RawRow(f"{spec}[{split}]#{i}", dict(obj))


# `builtin:<name>` sources: packaged corpora that register themselves here (`deepspec.embedded`
# registers builtin:chat when imported), so this module never imports the embedded default
BUILTIN_SOURCES: dict[str, Callable[[], Iterable[dict]]] = {}


def register_source(spec: str, rows: Callable[[], Iterable[dict]]) -> None:
    """Make `split.source: <spec>` read the rows `rows()` gives (a `builtin:` name)."""
    if not spec.startswith("builtin:"):
        raise ValueError(f"a registered source is named builtin:<name>, got {spec!r}")
    BUILTIN_SOURCES[spec] = rows


def iter_source(spec: str, hf_split: str = "train") -> Iterator[RawRow]:
    if spec in BUILTIN_SOURCES:
        for i, obj in enumerate(BUILTIN_SOURCES[spec]()):
            yield RawRow(f"{spec}#{i}", obj)
        return
    if spec.startswith("hf:"):
        yield from _hf_rows(spec, hf_split)
        return
    if spec.startswith("builtin:") or (":" in spec.split("/")[0] and not Path(spec).exists()):
        builtins = ", ".join(sorted(BUILTIN_SOURCES)) or "builtin:chat once deepspec.embedded is imported"
        raise ConfigError(f"split.source: unknown source {spec!r} "
                          f"(use {builtins}, hf:<dataset id or local dir>, or a .jsonl/.json/.parquet path, "
                          ".jsonl.gz/.json.gz compressed)")
    path = Path(spec)
    if not path.exists():
        raise SourceError(f"{spec}: source file does not exist")
    kind = path.suffixes[-2] if path.suffix == ".gz" and len(path.suffixes) > 1 else path.suffix
    if kind == ".jsonl":
        yield from _jsonl_rows(path)
    elif kind == ".json":
        yield from json_array_rows(path)
    elif kind == ".parquet" and path.suffix != ".gz":
        yield from _parquet_rows(path)
    else:
        raise ConfigError(f"split.source: {spec!r} is none of .jsonl, .json (an array), .parquet, .jsonl.gz, "
                          ".json.gz")
