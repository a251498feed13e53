"""The regen file's rows as samples: how one row is tokenised with the target's chat template into a
`Sample` under the cache params' rules (`EncodeRules`: too long, cut answers), and the `RowIndex` of
a whole regen file that the part plan is made from (each usable row's id, length, content key and
byte offset, the tokens dropped), built in one pass or from byte-range shares indexed by several
ranks. A planned part's rows are re-read and tokenised from it when the part is computed (stage.py).
"""
from __future__ import annotations

import collections
import json
import os
from array import array
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from deepspec.cache.spec.format import CacheFormatError, sample_id_to_int, sample_key
from deepspec.config import CacheConfig
from deepspec.data.template import TemplateError, encode_conversation
from deepspec.io import JsonlError


@dataclass
class Sample:
    sample_id: int
    input_ids: list[int]
    loss_mask: list[int]
    adjusted: tuple[str, ...] = ()  # what encode_row changed (counted in the stage report)

    @cached_property
    def key(self) -> tuple[int, int]:
        """The content key (format.sample_key): what the target is run on for this sample. Hashed once:
        a computed part's samples are checked against the plan, named and written by it."""
        return sample_key(self.input_ids, self.loss_mask)


@dataclass(frozen=True)
class EncodeRules:
    """How a regen row becomes a sample (cache params `max_length`, `overlong`, `truncated`)."""
    max_length: int
    overlong: str = "cut_turn"   # cut_turn | truncate | drop: a conversation over max_length tokens
    truncated: str = "keep"      # keep | drop: a row with an answer cut by max_tokens (finish_reason length)

    @classmethod
    def of(cls, cfg: CacheConfig) -> "EncodeRules":
        return cls(cfg.max_length, cfg.overlong, cfg.truncated)


def encode_row(tokenizer, row: dict, rules: EncodeRules) -> Sample | dict:
    """The row's sample, or {id, reason, detail} when it is dropped (kept in the stage report). A
    sample may carry `adjusted` reasons (an answer without its end-of-turn label, turns cut)."""
    finish = row.get("finish_reasons") or []
    unfinished = frozenset(k for k, f in enumerate(finish) if f == "length")
    if unfinished and rules.truncated == "drop":
        return {"id": row["id"], "reason": "answer_cut",
                "detail": f"answer {min(unfinished) + 1} ended by max_tokens (finish_reason length)"}
    try:
        enc = encode_conversation(tokenizer, row["conversations"], rules.max_length, unfinished,
                                  "truncate" if rules.overlong == "truncate" else "cut_turn")
    except TemplateError as e:
        return {"id": row["id"], "reason": "template", "detail": str(e)}
    if enc.truncated and rules.overlong == "drop":
        return {"id": row["id"], "reason": "too_long", "detail": f"over cache.max_length = {rules.max_length}"}
    if sum(enc.loss_mask) == 0:
        # nothing to learn from: no anchor can be drawn
        if enc.truncated:
            return {"id": row["id"], "reason": "too_long",
                    "detail": f"the first answer does not fit in cache.max_length = {rules.max_length}"}
        return {"id": row["id"], "reason": "no_loss_tokens", "detail": "no assistant tokens"}
    sample = Sample(sample_id_to_int(row["id"]), enc.input_ids, enc.loss_mask)
    answers = sum(t["role"] == "assistant" for t in row["conversations"])
    sample.adjusted = tuple(
        (["no_end_of_turn_label"] if any(k < enc.answers_kept for k in unfinished) else [])
        + (["cut_at_turn"] if enc.truncated and rules.overlong == "cut_turn" and enc.answers_kept < answers else [])
        + (["truncated"] if enc.truncated and rules.overlong == "truncate" else []))
    return sample


def encode_rows(tokenizer, rows, rules: EncodeRules) -> tuple[list[Sample], list[dict]]:
    """Samples for every usable row; the rest as {id, reason}."""
    samples, dropped = [], []
    for row in rows:
        out = encode_row(tokenizer, row, rules)
        (samples if isinstance(out, Sample) else dropped).append(out)
    return samples, dropped


@dataclass
class RowIndex:
    """The usable rows of a regen file without their tokens: what the part plan needs, and where
    to find a row again when its part is computed. Four numbers a row, whatever the corpus size."""
    path: str
    rows: int  # non-blank lines
    sample_ids: np.ndarray  # uint64, input order
    lengths: np.ndarray  # int64 tokens
    offsets: np.ndarray  # int64 byte offset of the row's line
    lines: np.ndarray  # int64 line number (for error messages)
    dropped: list[dict]
    keys: np.ndarray | None = None  # uint64 [n, 2] content keys (format.sample_key)
    adjusted: dict = field(default_factory=dict)  # usable rows changed by the encode rules, by kind


def _parse_line(path, lineno: int, line: bytes) -> dict:
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise JsonlError(f"{path}:{lineno}: not valid JSON: {e}") from None


def _encode_line(tokenizer, path, lineno: int, line: bytes, rules: EncodeRules) -> Sample | dict:
    try:
        return encode_row(tokenizer, _parse_line(path, lineno, line), rules)
    except CacheFormatError as e:
        raise CacheFormatError(f"{path}:{lineno}: {e}") from None


def line_ranges(path, world: int) -> list[tuple[int, int]]:
    """`world` byte ranges of the file, each starting at a line: equal shares of its bytes."""
    size = os.path.getsize(path)
    starts = [0]
    with open(path, "rb") as f:
        for k in range(1, world):
            f.seek(max(k * size // world - 1, starts[-1]))
            f.readline()  # to the end of the line the cut falls in (a cut at a line start stays there)
            starts.append(max(f.tell(), starts[-1]))
    return list(zip(starts, [*starts[1:], size]))


@dataclass
class IndexShare:
    """One rank's RowIndex of its byte range: line numbers counted from the range's first line,
    `lines_seen` lines in the range, and the first row that cannot be read (JSON, or a row that
    breaks the format) as (relative line, message) instead of an exception, so every rank can
    raise the same error once all shares are gathered."""
    index: RowIndex
    lines_seen: int
    fatal: tuple[int, type, str] | None = None  # (line in the range, error class, message)


def index_share(tokenizer, path, rules: EncodeRules, start: int = 0, end: int | None = None) -> IndexShare:
    """Tokenise each row of the byte range [start, end) of the regen file: keep its id, length, content
    key and byte offset, drop the tokens."""
    ids, lengths, offsets, lines, keys = array("Q"), array("q"), array("q"), array("q"), array("Q")
    rows, dropped, adjusted, fatal, lineno = 0, [], collections.Counter(), None, 0
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        while end is None or offset < end:
            line = f.readline()
            if not line:
                break
            lineno += 1
            here, offset = offset, offset + len(line)
            if not line.strip():
                continue
            rows += 1
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                fatal = (lineno, JsonlError, f"not valid JSON: {e}")
                break
            try:
                out = encode_row(tokenizer, row, rules)
            except CacheFormatError as e:
                fatal = (lineno, CacheFormatError, str(e))
                break
            if isinstance(out, dict):
                dropped.append(out)
                continue
            adjusted.update(out.adjusted)
            ids.append(out.sample_id)
            keys.extend(out.key)
            lengths.append(len(out.input_ids))
            offsets.append(here)
            lines.append(lineno)
    index = RowIndex(str(path), rows, np.frombuffer(ids, np.uint64).copy(), np.frombuffer(lengths, np.int64).copy(),
                     np.frombuffer(offsets, np.int64).copy(), np.frombuffer(lines, np.int64).copy(), dropped,
                     np.frombuffer(keys, np.uint64).copy().reshape(-1, 2), dict(adjusted))
    return IndexShare(index, lineno, fatal)


def merge_shares(path, shares: list[IndexShare]) -> RowIndex:
    """The RowIndex of the whole file from its ranges' shares, in file order: equal to indexing it in
    one pass (line numbers made global); raises the first unreadable row's error, by its global line."""
    bases = np.cumsum([0] + [sh.lines_seen for sh in shares[:-1]])
    for sh, base in zip(shares, bases):
        if sh.fatal is not None:
            line, error, msg = sh.fatal
            raise error(f"{path}:{base + line}: {msg}")
    adjusted = collections.Counter()
    for sh in shares:
        adjusted.update(sh.index.adjusted)
    cat = lambda name, **kw: np.concatenate([getattr(sh.index, name) for sh in shares], **kw)  # noqa: E731
    return RowIndex(str(path), sum(sh.index.rows for sh in shares), cat("sample_ids"), cat("lengths"), cat("offsets"),
                    np.concatenate([sh.index.lines + b for sh, b in zip(shares, bases)]),
                    [d for sh in shares for d in sh.index.dropped], cat("keys", axis=0),
                    dict(sorted(adjusted.items())))


def index_regen(tokenizer, path, rules: EncodeRules) -> RowIndex:
    """The whole regen file's RowIndex, in one pass on this process."""
    return merge_shares(path, [index_share(tokenizer, path, rules)])


def index_key(path, rules: EncodeRules, target: dict) -> str:
    """What a RowIndex is a function of: the regen file's bytes, the encode rules, and the target's
    tokenizer and chat template (models.target.identity's hashes of them)."""
    import hashlib

    h = hashlib.blake2b(digest_size=16, person=b"deepspec-index")
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    h.update(json.dumps([rules.max_length, rules.overlong, rules.truncated, target.get("tokenizer_sha256"),
                         target.get("chat_template_sha256")]).encode())
    return h.hexdigest()


def save_index(index: RowIndex, dest, key: str) -> None:
    """Keep `index` (of the input `key` names, index_key) for a later process: one .npz file, replaced
    atomically."""
    from deepspec.io import atomic_open

    meta = json.dumps({"key": key, "rows": index.rows, "dropped": index.dropped, "adjusted": index.adjusted})
    with atomic_open(dest, "wb", encoding=None) as f:
        np.savez(f, sample_ids=index.sample_ids, lengths=index.lengths, offsets=index.offsets, lines=index.lines,
                 keys=index.keys, meta=np.frombuffer(meta.encode(), np.uint8))


def load_index(src, path, key: str) -> RowIndex | None:
    """The RowIndex save_index kept at `src` for the regen file `path`, if it was made from exactly the
    input `key` names; else None (missing, another input, unreadable): the caller indexes the file."""
    try:
        with np.load(src) as z:
            meta = json.loads(z["meta"].tobytes())
            arrays = {k: z[k] for k in ("sample_ids", "lengths", "offsets", "lines", "keys")}
    except (OSError, ValueError, KeyError, EOFError):
        return None
    n = len(arrays["sample_ids"])
    if meta.get("key") != key or any(len(a) != n for a in arrays.values()) or arrays["keys"].shape != (n, 2):
        return None
    return RowIndex(str(path), int(meta["rows"]), arrays["sample_ids"].astype(np.uint64),
                    arrays["lengths"].astype(np.int64), arrays["offsets"].astype(np.int64),
                    arrays["lines"].astype(np.int64), list(meta["dropped"]), arrays["keys"].astype(np.uint64),
                    dict(meta["adjusted"]))


def load_samples(tokenizer, index: RowIndex, rows: np.ndarray, rules: EncodeRules) -> list[Sample]:
    """Re-read and tokenise the rows `rows` (positions in `index`) of the regen file."""
    samples = []
    with open(index.path, "rb") as f:
        for i in rows.tolist():
            f.seek(int(index.offsets[i]))
            lineno = int(index.lines[i])
            out = _encode_line(tokenizer, index.path, lineno, f.readline(), rules)
            if not isinstance(out, Sample) or out.sample_id != int(index.sample_ids[i]) \
                    or len(out.input_ids) != int(index.lengths[i]) or out.key != tuple(int(v) for v in index.keys[i]):
                raise CacheFormatError(f"{index.path}:{lineno}: the row changed while the cache stage was running "
                                       "(it no longer encodes to the sample planned); rerun the stage")
            samples.append(out)
    return samples


def part_samples(tokenizer, index: RowIndex, plan: list[tuple[str, np.ndarray]], rules: EncodeRules):
    """(name, samples) of each planned part, tokenised only when its turn comes: a rank holds the
    samples of the part being computed, never the corpus's."""
    for name, rows in plan:
        yield name, load_samples(tokenizer, index, rows, rules)
