"""Property failures grouped for a report: each failure's class (`failure_class`), a store key with its
part, layer and index names folded (`file_class`), the failing outcomes by (class, where raised)
(`failure_groups`) and those groups as text with their mutation kinds, files and example cases
(`format_groups`)."""
from __future__ import annotations

from tests.cache.fuzz.harness import Outcome


def failure_class(f: str) -> str:
    """"fast: wrong-exception: OverflowError: ..." -> "wrong-exception OverflowError"."""
    body = f.split(": ", 1)[1]
    kind, rest = body.split(": ", 1) if ": " in body else (body, "")
    if kind in ("wrong-exception", "message-without-store"):
        return f"{kind} {rest.split(':', 1)[0]}"
    return kind


def file_class(key: str) -> str:
    """A store key with its part, layer and index names folded: parts/<part>/hidden/<l>/c/0/0."""
    import re

    key = re.sub(r"p\d{6}|p[0-9a-f]{24}", "<part>", key)
    key = re.sub(r"index/[0-9a-f]{16}", "index/<h>", key)
    key = re.sub(r"(hidden|scale)/(-?\d+|last)", r"\1/<l>", key)
    return key


def failure_groups(outcomes: list[Outcome]) -> dict[tuple[str, str], list[Outcome]]:
    """Property failures by (class, where raised) -> their outcomes, fewest applied mutations first
    (the clearest example of a group comes first)."""
    out: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        for r in o.results:
            for f in r.failures:
                group = out.setdefault((failure_class(f"{r.mode}: {f}"), r.where), [])
                if not any(x is o for x in group):
                    group.append(o)
    for outs in out.values():
        outs.sort(key=lambda o: sum(a == "applied" for a in o.applied))
    return dict(sorted(out.items(), key=lambda kv: -len(kv[1])))


def format_groups(groups: dict[tuple[str, str], list[Outcome]], examples: int = 1) -> str:
    """Each failure group: its class, where it was raised, the mutation kinds and files of its cases
    and `examples` whole cases."""
    import collections

    lines = []
    for (cls, where), outs in groups.items():
        applied = [m for o in outs for m, a in zip(o.case.mutations, o.applied) if a == "applied"]
        kinds = collections.Counter(m.kind for m in applied)
        files = collections.Counter(file_class(m.key) for m in applied)
        backends = collections.Counter(o.case.pristine.backend for o in outs)
        lines.append(f"## {cls}  at {where or '-'}: {len(outs)} case(s) "
                     f"[{', '.join(f'{b} {n}' for b, n in backends.items())}]")
        lines.append(f"   kinds: {', '.join(f'{k} {n}' for k, n in kinds.most_common(8))}")
        lines.append(f"   files: {', '.join(f'{k} {n}' for k, n in files.most_common(6))}")
        lines += ["   " + o.report().replace("\n", "\n   ") for o in outs[:examples]]
    return "\n".join(lines)
