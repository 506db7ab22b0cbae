"""The global suffix tree of the suffix drafter (drafting/suffix.py): earlier
requests' outputs, each after the last `max_depth` tokens of its prompt, shared
by the drafter's forks, the oldest request evicted first (FIFO); and a corpus's
sequences (drafter.suffix_corpus), pinned: never evicted.

It counts strings and is read as the request tree (suffix_tree.py) is, but is
path-compressed (an edge is a run of tokens read from one of its occurrences),
so it holds about two nodes per token whatever the repetition; a request is
inserted and evicted whole, in O(length * depth) token comparisons.
"""
from __future__ import annotations

from collections import deque

from hetero_sd.drafting.suffix_tree import _speculate


class _Edge:
    """A global-tree node: the tokens at depths top..depth (1-based) of the path,
    read from its latest occurrence, sequence `seq` from `start` (the tokens at
    depth d is seqs[seq][start + d - 1]); `count` occurrences pass all of it."""

    __slots__ = ("count", "children", "token", "top", "depth", "seq", "start", "pin")

    def __init__(self, count: int, token: int, top: int, depth: int, seq: int, start: int, pin=None):
        self.count, self.children, self.token, self.top, self.depth = count, None, token, top, depth
        self.seq, self.start = seq, start
        self.pin = pin  # (seq, start) of a pinned occurrence, where one passes: the reference left
        # when the latest occurrence is evicted (pinned ones are older than every request and stay)

    @property
    def recency(self) -> tuple[int, int]:
        return self.seq, self.start


class GlobalTree:
    """A path-compressed, depth-limited, frequency-counted suffix trie of finished
    sequences, the oldest evicted first.

    Invariants: an edge ends where its occurrences branch or one of them ends,
    so every occurrence through an edge's top passes all of it; (seq, start) is
    the latest occurrence, which FIFO eviction removes last of the evictable ones
    (then `pin`, a pinned occurrence, takes its place); no back references (an
    evicted subtree is freed at once). Pinned sequences are neither in `order`
    nor counted in `tokens` (the bounds on earlier requests).
    """

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"suffix tree depth must be >= 2, got {depth}")
        self.depth, self.version = depth, 0
        self.clear()

    def pinned_sequences(self) -> list[list[int]]:
        """The pinned sequences, oldest first (they are the oldest of all)."""
        evictable = set(self.order)
        return [seq for sid, seq in self.seqs.items() if sid not in evictable]

    def evict_all(self) -> None:
        """Every evictable sequence goes; pinned ones stay."""
        while self.order:
            self.evict_oldest()

    def clear(self) -> None:
        self.root = _Edge(0, -1, 0, 0, -1, 0)
        self.seqs: dict[int, list[int]] = {}
        self.order: deque[int] = deque()  # sequence numbers, oldest first
        self.tokens = 0  # in evictable sequences
        self.pinned_tokens = 0
        self._next = 0
        self.version += 1  # positions held into the tree (match states) are stale

    def add(self, tokens: list[int], pinned: bool = False) -> None:
        """Index a sequence; a pinned one is never evicted."""
        if not tokens:
            return
        if pinned and self.order:
            raise ValueError("pinned sequences go in before any evictable one (they must be the oldest)")
        sid, self._next = self._next, self._next + 1
        seq = [int(t) for t in tokens]
        self.seqs[sid] = seq
        if pinned:
            self.pinned_tokens += len(seq)
        else:
            self.order.append(sid)
            self.tokens += len(seq)
        for i in range(len(seq)):
            self._insert(sid, seq, i, pinned)
        self.version += 1

    def _insert(self, sid: int, seq: list[int], i: int, pinned: bool) -> None:
        end = min(self.depth, len(seq) - i)  # this suffix's path length
        node, d = self.root, 0
        while d < end:
            token = seq[i + d]
            children = node.children
            child = None if children is None else children.get(token)
            if child is None:
                leaf = _Edge(1, token, d + 1, end, sid, i, (sid, i) if pinned else None)
                if children is None:
                    node.children = {token: leaf}
                else:
                    children[token] = leaf
                return
            ref, at, x, stop = self.seqs[child.seq], child.start - i, d + 1, min(child.depth, end)
            while x < stop and ref[at + i + x] == seq[i + x]:
                x += 1
            if x < child.depth:  # this suffix branches off or ends inside the edge
                child = self._split(node, child, x)
            child.count += 1
            child.seq, child.start = sid, i
            if pinned:
                child.pin = (sid, i)
            node, d = child, x

    def _split(self, parent: _Edge, edge: _Edge, depth: int) -> _Edge:
        """Cut `edge` after `depth`: the upper part (returned) becomes its parent."""
        upper = _Edge(edge.count, edge.token, edge.top, depth, edge.seq, edge.start, edge.pin)
        token = self.seqs[edge.seq][edge.start + depth]
        edge.top, edge.token = depth + 1, token
        upper.children = {token: edge}
        parent.children[upper.token] = upper
        return upper

    def evict_oldest(self) -> None:
        sid = self.order.popleft()
        seq = self.seqs[sid]
        for i in range(len(seq)):
            end = min(self.depth, len(seq) - i)
            parent, node, d = None, self.root, 0
            while d < end:
                child = node.children[seq[i + d]]
                child.count -= 1
                if child.count == 0:  # this occurrence alone below: its subtree goes
                    del node.children[child.token]
                    if not node.children:
                        node.children = None
                    break
                if child.seq == sid and child.pin is not None:  # the latest occurrence goes:
                    child.seq, child.start = child.pin  # pinned ones are all that can be left
                parent, node, d = node, child, child.depth
            # Only the deepest edge left can have become a plain run into its one child.
            if parent is not None and node.children is not None and len(node.children) == 1:
                (below,) = node.children.values()
                if below.count == node.count:
                    below.top, below.token = node.top, node.token
                    parent.children[node.token] = below
        del self.seqs[sid]
        self.tokens -= len(seq)
        self.version += 1

    # ------------------------------------------------------------ reading
    def advance(self, node: _Edge, depth: int, token: int):
        """The position after `token` from (node, depth), or None."""
        if depth < node.depth:
            return (node, depth + 1) if self.seqs[node.seq][node.start + depth] == token else None
        children = node.children
        child = None if children is None else children.get(token)
        return None if child is None else (child, depth + 1)

    def continues(self, node: _Edge, depth: int) -> bool:
        """Whether any occurrence of the string at (node, depth) has a next token."""
        return depth < node.depth or node.children is not None

    def speculate(self, node: _Edge, depth: int, limit: int, min_prob: float, free: int = 0
                  ) -> tuple[list[int], float]:
        """As RequestTree.speculate (suffix_tree.py)."""
        def forced(node: _Edge, depth: int):  # inside an edge: every occurrence goes on
            return self.seqs[node.seq][node.start + depth] if depth < node.depth else None

        return _speculate(node, depth, limit, min_prob, forced, free)
