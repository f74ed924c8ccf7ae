"""``RadixTree``: state kept per token-id prefix, bounded in size, evicted least recently used.

A radix tree over token ids (SGLang's RadixAttention keeps its KV cache in
one): each edge holds a run of tokens and a *span*, whatever the owner keeps
for exactly those positions (a transformer's per-layer keys and values; the
dispatcher keeps nothing but the run's length). A prompt's longest cached
prefix is the walk from the root while tokens agree; a prompt inserted after
it was read adds one edge for the part no edge holds yet, splitting the edge
where the two diverge (:meth:`Span.split` cuts a span at a position).

Bounds and eviction:

* the tree holds at most ``capacity`` units of :attr:`Span.size` (bytes for
  a KV cache, tokens for the dispatcher) and, if given, at most ``max_nodes``
  nodes (what the tree itself costs in memory: a node may stand for one
  token); past either, after an insert, leaves are evicted least recently
  used first (a walk through a node, by an insert or by a match that
  ``touch``\\ es, makes it recent);
* only leaves are evicted, so every node's prefix stays whole; a node whose
  last child goes becomes a candidate in turn;
* a :meth:`RadixTree.match` that ``lock``\\ s holds a reference on every node
  of its path until :meth:`RadixTree.release`: a prefix a running request
  still reads is never evicted. A split moves the references to the new
  upper node too, so a release walks up from the node the match ended in.

Candidates for eviction wait in a heap keyed by last use, pushed whenever a
node's use, children or references change and checked when popped (an entry
whose node changed since is skipped); the heap is rebuilt from the tree when
stale entries outnumber the nodes, so it stays proportional to the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, Self, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["Hit", "RadixTree", "Span", "TreeStats"]

#: Token ids: int64 (a model's prompt tensor) or uint32 (a request's ``input_ids``).
Tokens = npt.NDArray[np.int64] | npt.NDArray[np.uint32]


class Span(Protocol):
    """What a node holds for its run of tokens."""

    @property
    def size(self) -> int:
        """What it costs against the tree's capacity (bytes, tokens: the owner's unit)."""
        ...

    def split(self, at: int) -> tuple[Self, Self]:
        """The span cut at position ``at`` (``0 < at < length``): the first part, the rest."""
        ...


S = TypeVar("S", bound=Span)


class _Node(Generic[S]):
    __slots__ = ("children", "last", "parent", "refs", "span", "tokens")

    def __init__(self, tokens: Tokens, span: S | None, parent: _Node[S] | None) -> None:
        self.tokens = tokens
        self.span = span  # None only at the root
        self.parent = parent
        self.children: dict[int, _Node[S]] = {}
        self.refs = 0
        self.last = 0


@dataclass(frozen=True, slots=True)
class Hit(Generic[S]):
    """A match: ``length`` leading tokens are cached, in ``spans`` (root first).

    The last span may run past ``length``: the caller reads only what it
    needs. ``node`` is where the match ended (what :meth:`RadixTree.release` takes).
    """

    length: int
    spans: tuple[S, ...]
    node: _Node[S] | None
    locked: bool


@dataclass(frozen=True, slots=True)
class TreeStats:
    """What the tree holds and has done."""

    nodes: int
    size: int
    capacity: int
    locked_nodes: int
    hit_tokens: int
    miss_tokens: int
    evictions: int
    evicted_size: int


class RadixTree(Generic[S]):
    """Spans of state over token-id prefixes (see the module docstring).

    Args:
        capacity: most :attr:`Span.size` held after an insert (``>= 0``).
        max_nodes: most nodes held after an insert (``>= 0``); ``None``: no bound.

    Raises:
        ValueError: ``capacity`` or ``max_nodes`` is negative.
    """

    def __init__(self, capacity: int, max_nodes: int | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, not {capacity}")
        if max_nodes is not None and max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, not {max_nodes}")
        self.capacity = capacity
        self.max_nodes = max_nodes
        self._root: _Node[S] = _Node(np.empty(0, np.int64), None, None)
        self._clock = itertools.count(1)
        self._order = itertools.count()  # ties in the heap: never compare nodes
        self._heap: list[tuple[int, int, _Node[S]]] = []
        self.size = 0
        self.nodes = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.evictions = 0
        self.evicted_size = 0

    def stats(self) -> TreeStats:
        """A snapshot of the counters (walks the tree for the locked count)."""
        locked = sum(1 for n in self._walk() if n.refs)
        return TreeStats(self.nodes, self.size, self.capacity, locked, self.hit_tokens,
                         self.miss_tokens, self.evictions, self.evicted_size)

    def match(self, tokens: Tokens, *, limit: int | None = None, lock: bool = True,
              count: bool = True, touch: bool = True) -> Hit[S]:
        """The longest cached prefix of ``tokens``, at most ``limit`` tokens long.

        With ``lock``, every node of the path is held until :meth:`release`.
        With ``count``, the hit and miss token counters grow by this match.
        With ``touch``, every node of the path becomes the most recently used;
        without, a look that may come to nothing leaves the eviction order be.
        """
        n = len(tokens) if limit is None else min(limit, len(tokens))
        node, pos, now = self._root, 0, next(self._clock)
        spans: list[S] = []
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            same = _common(child.tokens, tokens[pos:n])
            node = child
            if touch:
                node.last = now
                self._push(node)
            assert node.span is not None
            spans.append(node.span)
            pos += same
            if same < len(child.tokens):
                break
        if count:
            self.hit_tokens += pos
            self.miss_tokens += len(tokens) - pos
        end = node if node is not self._root else None
        if lock and end is not None:
            up: _Node[S] | None = end
            while up is not None and up is not self._root:
                up.refs += 1
                up = up.parent
        return Hit(pos, tuple(spans), end, lock and end is not None)

    def release(self, hit: Hit[S]) -> None:
        """Drop the references a locking :meth:`match` took (once per hit)."""
        if not hit.locked:
            return
        up = hit.node
        while up is not None and up is not self._root:
            up.refs -= 1
            if not up.refs:
                self._push(up)
            up = up.parent

    def insert(self, tokens: Tokens, span_of: Callable[[int, int], S]) -> int:
        """Cache ``tokens``: ``span_of(start, end)`` gives the span of the part not held yet.

        Then evicts down to the capacity. Returns how many tokens were new.
        """
        node, pos, n, now = self._root, 0, len(tokens), next(self._clock)
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                leaf: _Node[S] = _Node(tokens[pos:].copy(), span_of(pos, n), node)
                node.children[int(tokens[pos])] = leaf
                leaf.last = now
                assert leaf.span is not None
                self.size += leaf.span.size
                self.nodes += 1
                self._push(leaf)
                break
            same = _common(child.tokens, tokens[pos:])
            if same < len(child.tokens):
                child = self._split(child, same)
            child.last = now
            self._push(child)
            node, pos = child, pos + same
        new = n - pos if pos < n else 0
        self.evict(self.capacity)
        return new

    def evict(self, down_to: int) -> int:
        """Evict unlocked leaves, least recently used first, until ``size <= down_to``
        and there are at most ``max_nodes`` nodes.

        Returns how much size was freed (less than asked when the rest is locked).
        """
        freed = 0
        heap = self._heap
        most = self.nodes if self.max_nodes is None else self.max_nodes
        while (self.size > down_to or self.nodes > most) and heap:
            last, _, node = heapq.heappop(heap)
            if node.children or node.refs or node.last != last or node.parent is None:
                continue  # changed since it was pushed (a newer entry exists if it matters)
            parent = node.parent
            del parent.children[int(node.tokens[0])]
            node.parent = None
            assert node.span is not None
            size = node.span.size
            self.size -= size
            self.nodes -= 1
            self.evictions += 1
            self.evicted_size += size
            freed += size
            if parent is not self._root and not parent.children:
                self._push(parent)
        return freed

    def set_capacity(self, capacity: int) -> int:
        """Hold at most ``capacity`` from now on; past it, evict now (least recently used
        first, as after an insert). Returns how much size was freed.

        Raises:
            ValueError: ``capacity`` is negative.
        """
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, not {capacity}")
        self.capacity = capacity
        return self.evict(capacity) if self.size > capacity else 0

    def clear(self) -> int:
        """Evict every unlocked leaf, repeatedly (everything when nothing is locked)."""
        return self.evict(0)

    # -- internals ---------------------------------------------------------------

    def _split(self, child: _Node[S], at: int) -> _Node[S]:
        """Cut ``child``'s edge at ``at``: a new upper node takes the first part."""
        assert child.span is not None and child.parent is not None
        before = child.span.size
        head_span, tail_span = child.span.split(at)
        parent = child.parent
        head: _Node[S] = _Node(child.tokens[:at].copy(), head_span, parent)
        head.refs, head.last = child.refs, child.last
        parent.children[int(child.tokens[0])] = head
        child.tokens = child.tokens[at:].copy()
        child.span = tail_span
        child.parent = head
        head.children[int(child.tokens[0])] = child
        self.size += head_span.size + tail_span.size - before
        self.nodes += 1
        return head

    def _push(self, node: _Node[S]) -> None:
        heapq.heappush(self._heap, (node.last, next(self._order), node))
        if len(self._heap) > 4 * self.nodes + 1024:
            self._heap = [(n.last, next(self._order), n) for n in self._walk()
                          if not n.children and not n.refs]
            heapq.heapify(self._heap)

    def _walk(self) -> list[_Node[S]]:
        out: list[_Node[S]] = []
        todo = list(self._root.children.values())
        while todo:
            n = todo.pop()
            out.append(n)
            todo.extend(n.children.values())
        return out


def _common(a: Tokens, b: Tokens) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
