"""Which samples go into which part: a pure function of the samples (docs/cache-format.md §7).

A part's hidden states depend on which samples it holds, not only on each sample: the target runs
a part's samples in padded batches, and a batch's composition changes the floating-point results
in their last bits. So for a store to equal a from-scratch build of its input, every part must hold
exactly the samples a from-scratch build would put in it. Parts are therefore cut by *content*, as
content-defined chunking cuts a byte stream: walking the samples in input order, a part ends after a
sample whose key (a uniform hash) falls below `length / CUT_GAP`, once the part holds `MIN_FILL` of
`part_tokens`, and always before a sample that would overflow `part_tokens`. A cut depends only on
the samples since the previous cut, so a changed, removed or inserted sample changes the part it
lands in (and, rarely, the next); every other part keeps its samples, its name and its files.
Appending samples changes only the last part. The expected part is 0.5-0.6 x part_tokens, by the
length distribution (tests/cache/test_plan.py checks two).
"""
from __future__ import annotations

import numpy as np

MIN_FILL = 0.25  # a content cut needs this fraction of part_tokens in the part already
CUT_GAP = 0.5    # beyond it, a cut is expected every CUT_GAP x part_tokens tokens


def part_ranges(lengths: np.ndarray, keys: np.ndarray, part_tokens: int) -> list[tuple[int, int]]:
    """Consecutive ranges [a, b) of the samples (input order) that form the parts. `keys` uint64
    [n, 2] are the samples' content keys (format.sample_key); only their low word is used here."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return []
    least = max(1, int(part_tokens * MIN_FILL))
    gap = max(1.0, part_tokens * CUT_GAP)
    # a sample ends its part with probability min(1, length / gap): a cut every `gap` tokens on
    # average, whatever the length distribution
    u = np.asarray(keys, dtype=np.uint64).reshape(n, 2)[:, 1].astype(np.float64) / 2.0**64
    content_cut = (u < lengths / gap).tolist()
    out, start, tokens = [], 0, 0
    for i, length in enumerate(lengths.tolist()):
        if i > start and tokens + length > part_tokens:
            out.append((start, i))
            start, tokens = i, 0
        tokens += length
        if tokens >= least and content_cut[i]:
            out.append((start, i + 1))
            start, tokens = i + 1, 0
    if start < n:
        out.append((start, n))
    return out


def store_order(rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A part's samples as stored: longest first, ties in input order (the order the forward
    batches take them in, so a part's shards are written batch by batch)."""
    rows = np.asarray(rows, dtype=np.int64)
    return rows[np.lexsort((rows, -np.asarray(lengths)[rows]))]


def pack_ranges(lengths, budget: int, padded: bool = False) -> list[tuple[int, int]]:
    """Consecutive ranges [a, b) of `lengths`, packed greedily in order within `budget` tokens each
    (a longer sample gets a range of its own). A range costs the sum of its lengths, or with `padded`
    its longest length x its count: what a right-padded batch of those samples costs (the cache
    stage's forward batches, the loader's token-budget batches). The one packer of the package."""
    out, start, tokens, longest = [], 0, 0, 0
    for k, n in enumerate(np.asarray(lengths).tolist()):
        cost = max(longest, n) * (k - start + 1) if padded else tokens + n
        if k > start and cost > budget:
            out.append((start, k))
            start, tokens, longest = k, 0, 0
        tokens += n
        longest = max(longest, n)
    if len(lengths) > start:
        out.append((start, len(lengths)))
    return out
