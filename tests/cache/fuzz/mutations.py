"""What a case does to its copy, as drawn by hypothesis: the hostile values a JSON field or an index
cell is set to (constants, values near the original, oversized and deeply nested ones), `Mutation`
(a kind, the store file it acts on, its parameters), the kinds each backend has (`kinds_for`) and the
strategies that draw a mutation of any kind (`mutation`) or of a given one (`mutation_of`). How each
kind is applied is edits.py's."""
from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

from hypothesis import strategies as st

from tests.cache.fuzz.stores import Pristine, manifest_of, read_shard_index

COLUMNS = {"part": 0, "offset": 1, "length": 2}  # the index columns a hostile row edit sets


# ---- hostile values -----------------------------------------------------------------------------------

class Raw:
    """JSON text written as it is (a value json.dumps cannot make: deep nesting), shown by name."""

    def __init__(self, name: str, text: str):
        self.name, self.text = name, text

    def __repr__(self) -> str:
        return f"<{self.name}>"


class Big:
    """A large list or string, shown by name (reports stay short)."""

    def __init__(self, name: str, value: Any):
        self.name, self.value = name, value

    def __repr__(self) -> str:
        return f"<{self.name}>"


DEEP = Raw("nesting 100000 deep", "[" * 100_000 + "]" * 100_000)
CONSTANTS: tuple = (
    None, True, False, -1, 0, 1, 2**31, 2**32, 2**48, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 5, 2**64, 10**20,
    -2**63, 0.5, -0.0, 1e308, float("inf"), float("nan"), "", "0", "12", "../x", "/etc/passwd", "p000000",
    "index/0123456789abcdef/c/0/0", [], [0], [-1, -1], {}, {"a": 1},
    Big("list of 100000 zeros", [0] * 100_000), Big("string of 1 MB", "x" * (1 << 20)), DEEP,
)
UINT64: tuple = (0, 1, 2**31, 2**32, 2**40, 2**48, 2**63 - 1, 2**63, 2**64 - 5, 2**64 - 1)


def derived(original: Any) -> list:
    """Values near `original`: off by one, scaled, another type: what passes a careless check."""
    if isinstance(original, bool):
        return [not original, int(original)]
    if isinstance(original, int):
        return [original - 1, original + 1, -original, original * 1000, original + 2**32, str(original),
                float(original), [original]]
    if isinstance(original, float):
        return [original + 1, -original, int(original), str(original)]
    if isinstance(original, str):
        return [original + "x", original[:-1], original.upper(), "../" + original, "/" + original,
                original + "/..", original * 2]
    if isinstance(original, list):
        return [original[:-1], original + original[-1:], original[::-1], [original], original * 1000]
    if isinstance(original, dict):
        return [dict(list(original.items())[:-1]), list(original.values())]
    return []


def hostile(original: Any) -> st.SearchStrategy:
    near = derived(original)
    choices = [st.sampled_from(CONSTANTS), st.integers(-(2**65), 2**65)]
    if near:
        choices.append(st.sampled_from(near))
    return st.one_of(*choices)


def uint64_values(original: int) -> st.SearchStrategy:
    near = [(original + d) % 2**64 for d in (-8, -1, 1, 8, 2**32)] + [original * 1000 % 2**64]
    return st.one_of(st.sampled_from(UINT64), st.sampled_from(near), st.integers(0, 2**64 - 1))


def dumps(node: Any) -> str:
    """JSON text of `node`: Raw as its text, Big as its value, a DupKeys with its repeated keys."""
    if isinstance(node, Raw):
        return node.text
    if isinstance(node, Big):
        return dumps(node.value)
    if isinstance(node, DupKeys):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dumps(v)}" for k, v in node.pairs) + "}"
    if isinstance(node, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dumps(v)}" for k, v in node.items()) + "}"
    if isinstance(node, list):
        return "[" + ", ".join(dumps(v) for v in node) + "]"
    return json.dumps(node)


class DupKeys:
    """A JSON object written with a key twice (Python's json keeps the last)."""

    def __init__(self, pairs: list[tuple[str, Any]]):
        self.pairs = pairs


# ---- mutations ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Mutation:
    kind: str                   # see KINDS
    key: str                    # the store file (object, directory, JSON document) it acts on
    params: tuple = ()          # (name, value) pairs

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    def __str__(self) -> str:
        shown = ", ".join(f"{k}={short(v)}" for k, v in self.params)
        return f"{self.kind} {self.key}" + (f" ({shown})" if shown else "")


def short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


KINDS_ANY = ("json_set", "json_delete", "json_dup_key", "json_dup_item", "truncate", "bitflip", "delete",
             "index_row", "index_key_outside", "part_listed_twice")
KINDS_ZARR = ("shard_index",)
KINDS_HDF5 = ("h5_attr",)
KINDS_LOCAL = ("link_inside", "link_outside", "dev_zero", "fifo", "directory", "link_loop", "dangling_link",
               "huge_sparse", "dir_link_outside", "dir_link_inside", "delete_dir")
KINDS_S3 = ("huge_object",)


def kinds_for(p: Pristine) -> tuple[str, ...]:
    return KINDS_ANY + (KINDS_ZARR if p.kind == "zarr" else KINDS_HDF5) + (KINDS_S3 if p.remote else KINDS_LOCAL)


def path_text(path: tuple) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in path).lstrip(".") or "<document>"


def json_paths(doc: Any, op: str) -> set[tuple]:
    """The paths into `doc` an edit `op` can act on: any node for "set" (the document itself too),
    a key of an object for "dup_key", an item of a list for "dup_item", either for "delete"."""
    out: set[tuple] = {()} if op == "set" else set()

    def walk(node: Any, path: tuple) -> None:
        steps = sorted(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else ()
        for step in steps:
            if op in ("set", "delete") or (op == "dup_key") == isinstance(node, dict):
                out.add(path + (step,))
            walk(node[step], path + (step,))

    walk(doc, ())
    return out


@st.composite
def json_mutation(draw, p: Pristine, op: str) -> Mutation:
    """A JSON edit: a walk from the document's root down to a node `op` can act on, stopping early
    with some chance (the whole document rarely, a field three times in four), so top-level fields
    are drawn as often as the items of long lists."""
    key = draw(st.sampled_from([k for k in sorted(p.docs) if json_paths(p.docs[k], op)]))
    doc = p.docs[key]
    targets = json_paths(doc, op)
    on_the_way = {t[:i] for t in targets for i in range(len(t) + 1)}
    node, path = doc, ()
    while True:
        steps = sorted(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else ()
        children = [s for s in steps if path + (s,) in on_the_way]
        if not children or (path in targets and draw(st.integers(0, 9)) < (1 if not path else 3)):
            break
        step = draw(st.sampled_from(children))
        path, node = path + (step,), node[step]
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    params: list = [("path", path)]
    if op in ("set", "dup_key"):
        params.append(("value", draw(hostile(node))))
    if op == "dup_key":
        params.append(("last", draw(st.booleans())))  # last: the hostile value is the one Python's json keeps
    if op == "dup_item":
        params.append(("at", draw(st.integers(0, len(parent)))))
    return Mutation(f"json_{op}", key, tuple(params))


def mutation(p: Pristine) -> st.SearchStrategy[Mutation]:
    """A mutation of any kind `p`'s backend has, on one of its files."""
    return st.sampled_from(kinds_for(p)).flatmap(lambda kind: mutation_of(p, kind))


@st.composite
def mutation_of(draw, p: Pristine, kind: str) -> Mutation:
    if kind.startswith("json_"):
        return draw(json_mutation(p, kind.removeprefix("json_")))
    files = sorted(p.files)
    if kind in ("truncate", "bitflip", "huge_object"):
        key = draw(st.sampled_from(files))
        size = len(p.files[key])
        if kind == "truncate":
            return Mutation(kind, key, (("length", draw(st.integers(0, max(size - 1, 0)))),))
        if kind == "bitflip":
            flips = draw(st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, 7)), min_size=1, max_size=4,
                                  unique=True))
            return Mutation(kind, key, (("flips", tuple(flips)),))
        return Mutation(kind, key)
    if kind == "index_row":
        row, column = draw(st.integers(0, len(p.samples) - 1)), draw(st.sampled_from(sorted(COLUMNS)))
        index = manifest_of(p.docs[p.root_doc], p.kind)["index"]
        at = int(index["offset"]) + (row * len(index["columns"]) + COLUMNS[column]) * 8
        stored = struct.unpack("<Q", p.files[index["key"]][at:at + 8])[0]
        return Mutation(kind, p.root_doc, (("row", row), ("column", column), ("value", draw(uint64_values(stored)))))
    if kind == "index_key_outside":
        return Mutation(kind, p.root_doc, (("absolute", draw(st.booleans())),))
    if kind == "part_listed_twice":
        n = len(manifest_of(p.docs[p.root_doc], p.kind)["parts"])
        return Mutation(kind, p.root_doc, (("part", draw(st.integers(0, n - 1))), ("at", draw(st.integers(0, n)))))
    if kind == "shard_index":
        key = draw(st.sampled_from(sorted(p.shards)))
        n, _ = p.shards[key]
        chunk = draw(st.integers(0, n - 1))
        field = draw(st.sampled_from(["offset", "nbytes", "absent"]))
        stored = read_shard_index(p.files[key], n)[chunk][0 if field == "offset" else 1]
        value = 0 if field == "absent" else draw(uint64_values(int(stored)))
        return Mutation(kind, key, (("chunk", chunk), ("field", field), ("value", value)))
    if kind == "h5_attr":
        key = draw(st.sampled_from([f for f in files if f.startswith("parts/")]))
        name = draw(st.sampled_from(["committed", "samples", "tokens", "rank", "format", "chunk_index"]))
        value = draw(st.sampled_from([-1, 0, 1, 2**62, 2**63 - 1, "x", "../x", (0, 0, 0), (2**62, 1, 1), (-1,)]))
        return Mutation(kind, key, (("name", name), ("value", value),
                                    ("drop_manifest_table", draw(st.booleans()))))
    if kind in ("link_inside", "link_outside", "dev_zero", "fifo", "directory", "link_loop", "dangling_link",
                "huge_sparse", "delete"):
        key = draw(st.sampled_from(files))
        params: tuple = ()
        if kind == "link_inside":
            params = (("target", draw(st.sampled_from([f for f in files if f != key] or files))),
                      ("absolute", draw(st.booleans())))
        elif kind == "link_outside":
            params = (("absolute", draw(st.booleans())),)
        elif kind == "directory":
            params = (("with_child", draw(st.booleans())),)
        return Mutation(kind, key, params)
    # directories
    key = draw(st.sampled_from(p.dirs))
    if kind == "dir_link_inside":
        return Mutation(kind, key, (("target", draw(st.sampled_from(["", *[d for d in p.dirs if d != key]]))),))
    if kind == "dir_link_outside":
        return Mutation(kind, key, (("absolute", draw(st.booleans())),))
    return Mutation(kind, key)
