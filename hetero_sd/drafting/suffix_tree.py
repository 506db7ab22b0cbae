"""Suffix trees for the suffix drafter (drafting/suffix.py): the per-request
tree, and what it shares with the global tree (suffix_global.py).

A tree counts, for every string of up to `depth` tokens, how often it occurs
in the indexed sequences. Both trees are suffix tries truncated at `depth` =
max_depth + MAX_DRAFT_TOKENS (room for a full draft after the longest match).
Drafting from either follows the most frequent continuation (ties: the most
recent one), token by token, while the product of count(child) /
count(continuations of the parent) stays at least `min_prob` (_speculate,
shared by both trees).

The request tree (RequestTree) holds this request's prompt and output so far:
it grows one token at a time (only the suffixes that still repeat do work; a
string seen once is a compressed tail read from the sequence) and rolls back
exactly (DraftRequest.base_len).
"""
from __future__ import annotations


class _Node:
    """A request-tree node: the string of `depth` tokens on the path from the
    root, `count` occurrences. (seq, start) is its earliest occurrence: with
    count 1 and no children the node is a compressed tail whose continuation is
    read from the sequence. `stamp`: the latest occurrence's end position (the
    tree's undo log keeps the ones it replaced, for a rollback)."""

    __slots__ = ("count", "children", "parent", "token", "depth", "start", "stamp")

    def __init__(self, parent, token: int, depth: int, start: int, stamp: int):
        self.count, self.children, self.parent, self.token, self.depth = 1, None, parent, token, depth
        self.start, self.stamp = start, stamp

    @property
    def recency(self) -> int:
        return self.stamp


def _is_tail(node: _Node) -> bool:
    return node.count == 1 and node.children is None


def _best(children: dict) -> tuple:
    """(most frequent child, total count); ties go to the most recent occurrence."""
    best, total = None, 0
    for child in children.values():
        total += child.count
        if best is None or child.count > best.count or (child.count == best.count and child.recency > best.recency):
            best = child
    return best, total


_END = object()  # forced(): the string runs out here


def _speculate(node, depth: int, limit: int, min_prob: float, forced, free: int = 0) -> tuple[list[int], float]:
    """Follow the most frequent continuation from (node, depth) in either tree. forced(node,
    depth) is the next token where the string goes on one way only (a tail, an edge), _END
    where it runs out, None at a node whose children branch. The first `free` tokens are
    taken whatever min_prob says (their verify rows cost nothing)."""
    out: list[int] = []
    prob, score = 1.0, 0.0
    while len(out) < limit:
        token = forced(node, depth)
        if token is _END:
            break
        if token is None:
            if node.children is None:
                break
            best, total = _best(node.children)
            prob *= best.count / total
            if prob < min_prob and len(out) >= free:
                break
            token, node = best.token, best
        out.append(token)
        depth += 1
        score += prob
    return out, score


class RequestTree:
    """A depth-limited, frequency-counted suffix trie of one growing sequence.

    Invariants: a node's count is the number of occurrences of its string (of
    at most `depth` tokens); a node that is not a compressed tail has an
    explicit child for every occurrence that continues; `start` is the earliest
    occurrence, which a rollback (it removes the latest first) removes last.
    Each start of the last `depth` positions is tracked where its path ends:
    in an explicit node (its string repeats: count >= 2) or in its own tail.
    """

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"suffix tree depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = _Node(None, -1, 0, 0, -1)
        self.root.count = 0  # (never a compressed tail)
        self.sequence: list[int] = []
        self._explicit: dict[int, _Node] = {}  # start -> node at depth len - start (count >= 2)
        self._tails: dict[int, _Node] = {}  # start -> its own compressed tail
        # Stamps replaced by each append, undone by a rollback: node, old stamp, node, ...
        # (a flat list: no allocation per entry); _marks[p]: its length before token p.
        self._undo: list = []
        self._marks: list[int] = []

    def append(self, token: int) -> None:
        seq, undo = self.sequence, self._undo
        p = len(seq)
        seq.append(token)
        self._marks.append(len(undo))
        explicit = self._explicit
        old = p - self.depth  # its path reached the full depth: it grows no more
        if old >= 0:
            explicit.pop(old, None)
            self._tails.pop(old, None)
        for start, node in list(explicit.items()):
            children = node.children
            child = None if children is None else children.get(token)
            if child is not None and (child.count != 1 or child.children is not None):
                # The common case, inlined (_extend does the same): the string repeats further.
                undo.append(child)
                undo.append(child.stamp)
                child.count += 1
                child.stamp = p
                explicit[start] = child
            else:
                self._extend(start, node, token, p)
        self._extend(p, self.root, token, p)

    def _extend(self, start: int, node: _Node, token: int, p: int) -> None:
        """The occurrence from `start`, whose path ends at `node`, grows by `token` (position p)."""
        children = node.children
        child = None if children is None else children.get(token)
        if child is None:
            tail = _Node(node, token, node.depth + 1, start, p)
            if children is None:
                node.children = {token: tail}
            else:
                children[token] = tail
            self._explicit.pop(start, None)
            self._tails[start] = tail
            return
        if _is_tail(child):
            self._split(child)
        self._undo.append(child)  # the stamp it replaces, for a rollback
        self._undo.append(child.stamp)
        child.count += 1
        child.stamp = p
        self._explicit[start] = child

    def _split(self, tail: _Node) -> None:
        """A second occurrence reaches a compressed tail: the tail's own next token
        becomes an explicit child (a compressed tail of its own)."""
        start, depth, seq = tail.start, tail.depth, self.sequence
        below = None
        if depth < self.depth and start + depth < len(seq):
            token = seq[start + depth]
            below = _Node(tail, token, depth + 1, start, start + depth)
            tail.children = {token: below}
        if self._tails.get(start) is tail:
            if below is not None:
                self._tails[start] = below
            else:
                del self._tails[start]
                self._explicit[start] = tail

    def truncate(self, length: int) -> None:
        """Roll the sequence back to `length` tokens."""
        seq, depth = self.sequence, self.depth
        while len(seq) > length:
            q = len(seq) - 1
            moved = []
            for start in range(max(0, q - depth + 1), q + 1):
                size = q - start + 1  # this occurrence's path length, losing its last token
                node = self._explicit.pop(start, None)
                if node is None:
                    node = self._tails.pop(start)
                    if node.depth < size:  # inside its own compressed tail: it just gets shorter
                        self._tails[start] = node
                        continue
                node.count -= 1
                parent = node.parent
                if node.count == 0:
                    del parent.children[node.token]
                    if not parent.children:
                        parent.children = None
                if size > 1:
                    moved.append((start, parent))
            seq.pop()
            undo, mark = self._undo, self._marks.pop()
            for i in range(len(undo) - 2, mark - 1, -2):
                undo[i].stamp = undo[i + 1]
            del undo[mark:]
            for start, node in moved:
                self._place(start, node)
            back = q - depth  # its path is below the full depth again
            if back >= 0:
                node = self.root
                for i in range(back, q):
                    if _is_tail(node):
                        break
                    node = node.children[seq[i]]
                self._place(back, node)

    def _place(self, start: int, node: _Node) -> None:
        if _is_tail(node):
            self._tails[start] = node
        else:
            self._explicit[start] = node

    def longest_repeat(self, max_len: int) -> tuple[_Node | None, int]:
        """(node, size) of the longest suffix, at most max_len tokens, that occurred
        earlier too (so it has a continuation); size 0 if none."""
        best, size, length = None, 0, len(self.sequence)
        for start, node in self._explicit.items():
            n = length - start
            if size < n <= max_len:
                best, size = node, n
        return best, size

    def speculate(self, node: _Node, depth: int, limit: int, min_prob: float, free: int = 0
                  ) -> tuple[list[int], float]:
        """The most frequent continuation from (node, depth): up to `limit` tokens while
        the product of the choices' frequency ratios stays >= min_prob (the first `free`
        regardless); and the sum of those products (an estimate of how many will be accepted)."""
        seq = self.sequence

        def forced(node: _Node, depth: int):  # a tail: the one occurrence goes on, until the sequence ends
            if not _is_tail(node):
                return None
            idx = node.start + depth
            return _END if depth >= self.depth or idx >= len(seq) else seq[idx]

        return _speculate(node, depth, limit, min_prob, forced, free)
