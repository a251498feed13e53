"""The part plan (deepspec/cache/spec/plan.py): parts cut by content, so a change of the input changes
only the parts around it, on any length distribution."""
import numpy as np
import pytest

from deepspec.cache.spec.plan import MIN_FILL, pack_ranges, part_ranges

LENGTHS = {  # a short-chat corpus like the embedded default's, and the reference's long answers
    "chat": lambda rng, n: rng.integers(10, 120, n),
    "long": lambda rng, n: np.minimum(rng.lognormal(6.5, 0.9, n).astype(np.int64) + 20, 4096),
}


def corpus(kind: str, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return LENGTHS[kind](rng, n), rng.integers(0, 2**63, (n, 2), dtype=np.uint64) * 2


def tokens(lengths, ranges):
    return np.array([lengths[a:b].sum() for a, b in ranges])


@pytest.mark.parametrize("kind,part_tokens", [("chat", 4096), ("long", 1 << 18)])
def test_parts_tile_the_input_within_the_budget_and_fill_about_sixty_percent(kind, part_tokens):
    lengths, keys = corpus(kind, 20000)
    ranges = part_ranges(lengths, keys, part_tokens)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(lengths)
    assert all(a < b for a, b in ranges) and all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
    fill = tokens(lengths, ranges) / part_tokens
    assert fill.max() <= 1.0 and fill[:-1].min() >= MIN_FILL * 0.99
    assert 0.5 <= fill.mean() <= 0.75, fill.mean()


@pytest.mark.parametrize("kind,part_tokens", [("chat", 4096), ("long", 1 << 18)])
@pytest.mark.parametrize("change", ["rewrite", "drop", "insert", "append"])
def test_a_change_moves_only_the_parts_around_it(kind, part_tokens, change):
    lengths, keys = corpus(kind, 20000)
    before = part_ranges(lengths, keys, part_tokens)
    at = len(lengths) // 2
    rng = np.random.default_rng(1)
    new_len, new_key = LENGTHS[kind](rng, 1), rng.integers(0, 2**63, (1, 2), dtype=np.uint64)
    if change == "rewrite":
        lengths2, keys2 = lengths.copy(), keys.copy()
        lengths2[at], keys2[at] = new_len[0], new_key[0]
    elif change == "drop":
        lengths2, keys2 = np.delete(lengths, at), np.delete(keys, at, axis=0)
    elif change == "insert":
        lengths2, keys2 = np.insert(lengths, at, new_len), np.insert(keys, at, new_key, axis=0)
    else:
        more_len, more_key = corpus(kind, 300, seed=5)
        lengths2, keys2 = np.concatenate([lengths, more_len]), np.concatenate([keys, more_key])
    after = part_ranges(lengths2, keys2, part_tokens)
    # compare parts by the samples they hold (the keys in order), as their names do
    held = lambda ln, ks, rs: {ks[a:b].tobytes() for a, b in rs}  # noqa: E731
    old, new = held(lengths, keys, before), held(lengths2, keys2, after)
    assert len(old - new) <= (1 if change == "append" else 3), len(old - new)
    assert len(old & new) >= len(old) - 3


def test_a_sample_longer_than_the_budget_is_a_part_of_its_own():
    lengths = np.array([10, 500, 10, 10])
    keys = np.full((4, 2), 2**63, dtype=np.uint64)  # no content cut
    assert part_ranges(lengths, keys, 100) == [(0, 1), (1, 2), (2, 4)]


def test_pack_ranges_packs_greedily():
    assert pack_ranges(np.array([3, 9, 5, 9, 1, 7, 30]), 26) == [(0, 4), (4, 6), (6, 7)]
