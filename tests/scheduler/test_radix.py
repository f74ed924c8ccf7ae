"""``RadixTree``: longest-prefix match, splits, a size bound with LRU eviction, and locks."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.models.radix import RadixTree


class Run:
    """A span that remembers which tokens it stands for (so splits can be checked)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    @property
    def size(self) -> int:
        return len(self.tokens)

    def split(self, at: int) -> tuple[Run, Run]:
        return Run(self.tokens[:at]), Run(self.tokens[at:])


def _t(*ids: int) -> np.ndarray:
    return np.array(ids, np.int64)


def _insert(tree: RadixTree[Run], tokens: np.ndarray) -> int:
    return tree.insert(tokens, lambda a, b: Run(tokens[a:b].tolist()))


def _read(tree: RadixTree[Run], tokens: np.ndarray) -> list[int]:
    """The tokens the matched spans stand for, cut at the match's length."""
    hit = tree.match(tokens, lock=False)
    return [t for s in hit.spans for t in s.tokens][:hit.length]


def test_longest_prefix_and_splits_keep_every_span_right() -> None:
    tree: RadixTree[Run] = RadixTree(1000)
    assert _insert(tree, _t(1, 2, 3, 4, 5)) == 5
    assert _insert(tree, _t(1, 2, 3, 9)) == 1  # splits the first edge after 3
    assert _insert(tree, _t(1, 2, 3, 4, 5)) == 0
    assert tree.size == 6 and tree.nodes == 3
    assert _read(tree, _t(1, 2, 3, 4, 5, 6)) == [1, 2, 3, 4, 5]
    assert _read(tree, _t(1, 2, 3, 9, 9)) == [1, 2, 3, 9]
    assert _read(tree, _t(1, 2, 7)) == [1, 2]
    assert _read(tree, _t(7)) == []
    assert tree.match(_t(1, 2, 3, 4, 5), limit=4, lock=False).length == 4
    stats = tree.stats()
    assert (stats.hit_tokens, stats.miss_tokens) == (5 + 4 + 2 + 0 + 4, 1 + 1 + 1 + 1 + 1)


def test_over_capacity_the_least_recently_used_leaf_goes_first() -> None:
    tree: RadixTree[Run] = RadixTree(10)
    _insert(tree, _t(1, 1, 1, 1))
    _insert(tree, _t(2, 2, 2, 2))
    tree.match(_t(1, 1, 1, 1), lock=False)  # 1s are now more recent than 2s
    _insert(tree, _t(3, 3, 3, 3))
    assert tree.size == 8 and tree.evictions == 1
    assert _read(tree, _t(2, 2, 2, 2)) == []
    assert _read(tree, _t(1, 1, 1, 1)) == [1, 1, 1, 1]


def test_a_locked_prefix_is_never_evicted_until_released() -> None:
    tree: RadixTree[Run] = RadixTree(6)
    _insert(tree, _t(1, 2, 3, 4))
    hit = tree.match(_t(1, 2, 3, 4, 8), limit=4)
    assert hit.length == 4 and hit.locked
    _insert(tree, _t(1, 2, 7, 7))  # splits the locked edge: both parts stay locked
    _insert(tree, _t(5, 5, 5, 5))
    assert _read(tree, _t(1, 2, 3, 4)) == [1, 2, 3, 4]
    assert tree.size <= 6 + 4  # only unlocked leaves went; the locked path stays
    assert tree.stats().locked_nodes == 2
    tree.release(hit)
    assert tree.stats().locked_nodes == 0
    _insert(tree, _t(6, 6, 6))
    assert tree.size <= 6


def test_clear_empties_an_unlocked_tree() -> None:
    tree: RadixTree[Run] = RadixTree(100)
    for i in range(10):
        _insert(tree, _t(1, 2, i, i))
    assert tree.nodes == 11
    assert tree.clear() == 2 + 10 * 2
    assert (tree.size, tree.nodes, tree.stats().nodes) == (0, 0, 0)


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        RadixTree(-1)
    with pytest.raises(ValueError, match="max_nodes"):
        RadixTree(10, max_nodes=-1)
