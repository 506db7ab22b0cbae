"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM / ArcticInference's
SuffixDecodingCache): model-free drafts from suffix trees.

Two trees:

    per-request  this request's prompt and output so far (grows each round,
                 rolls back with DraftRequest.base_len)          RequestTree
    global       earlier requests' outputs, each after the last `max_depth`
                 tokens of its prompt (so an output is found by the context
                 that led to it); shared by the drafter's forks, bounded by
                 `max_cached_requests` / `max_cached_tokens`, the oldest
                 request evicted first (FIFO)                      GlobalTree

A tree counts, for every string of up to `depth` tokens, how often it occurs
in the indexed sequences. Drafting finds the longest suffix of the context (at
most `max_depth` tokens) that occurred before with something after it, in
either tree (the per-request one when its match is at least as long), and
follows the most frequent continuation (ties: the most recent one), token by
token, while the estimated probability that the whole draft so far is right
(the product of count(child) / count(continuations of the parent)) stays at
least `min_token_prob`; at most min(k, factor * match length) tokens: a long
match earns a long draft. If the preferred tree proposes nothing, the other
one is asked. `match_len`, `score` (the summed probabilities: an estimate of
the accepted length) and `source` ("local" / "global") of the last draft stay
on the drafter for a caller that arbitrates between drafters.

Proposals are a deterministic function of the context and of the global tree
(earlier requests), so under sampling their q is one-hot (probs=None), as
with the n-gram drafter, and greedy output is the target's whatever is drafted.
A sampled request's tokens do depend on its drafts (they decide how its
random draws are used), so a seeded sampled request drafts from its own tree
alone: its output depends on its seed and prompt, never on which requests ran
before (global_for_seeded=True trades that for the global tree's drafts).

Both trees are suffix tries truncated at `depth` = max_depth + MAX_DRAFT_TOKENS
(room for a full draft after the longest match). The request tree grows one
token at a time (only the suffixes that still repeat do work; a string seen
once is a compressed tail read from the sequence) and rolls back exactly. The
global tree is path-compressed (an edge is a run of tokens read from one of
its occurrences), so it holds about two nodes per token whatever the
repetition; a request is inserted and evicted whole, in O(length * depth)
token comparisons. A draft costs O(max_depth) amortised.
"""
from __future__ import annotations

import copy
from collections import deque

from hetero_sd.drafting.base import Drafter
from hetero_sd.ir.errors import ConfigError
from hetero_sd.ir.work import MAX_DRAFT_TOKENS, DraftRequest, DraftResult


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


def _speculate(node, depth: int, limit: int, min_prob: float, forced) -> tuple[list[int], float]:
    """Follow the most frequent continuation from (node, depth) in either tree. forced(node,
    depth) is the next token where the string goes on one way only (a tail, an edge), _END
    where it runs out, None at a node whose children branch."""
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
            if prob < min_prob:
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

    def speculate(self, node: _Node, depth: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation from (node, depth): up to `limit` tokens while
        the product of the choices' frequency ratios stays >= min_prob; and the sum
        of those products (an estimate of how many will be accepted)."""
        seq = self.sequence

        def forced(node: _Node, depth: int):  # a tail: the one occurrence goes on, until the sequence ends
            if not _is_tail(node):
                return None
            idx = node.start + depth
            return _END if depth >= self.depth or idx >= len(seq) else seq[idx]

        return _speculate(node, depth, limit, min_prob, forced)

    def counts(self) -> dict[tuple, int]:
        """Every string the tree holds with its count (tests)."""
        out: dict[tuple, int] = {}
        stack = [(child, (token,)) for token, child in (self.root.children or {}).items()]
        while stack:
            node, path = stack.pop()
            out[path] = node.count
            if _is_tail(node):
                for d in range(node.depth, min(self.depth, len(self.sequence) - node.start)):
                    path = path + (self.sequence[node.start + d],)
                    out[path] = 1
            else:
                stack += [(child, path + (token,)) for token, child in (node.children or {}).items()]
        return out


class _Edge:
    """A global-tree node: the tokens at depths top..depth (1-based) of the path,
    read from its latest occurrence, sequence `seq` from `start` (the tokens at
    depth d is seqs[seq][start + d - 1]); `count` occurrences pass all of it."""

    __slots__ = ("count", "children", "token", "top", "depth", "seq", "start")

    def __init__(self, count: int, token: int, top: int, depth: int, seq: int, start: int):
        self.count, self.children, self.token, self.top, self.depth = count, None, token, top, depth
        self.seq, self.start = seq, start

    @property
    def recency(self) -> tuple[int, int]:
        return self.seq, self.start


class GlobalTree:
    """A path-compressed, depth-limited, frequency-counted suffix trie of finished
    sequences, the oldest evicted first.

    Invariants: an edge ends where its occurrences branch or one of them ends,
    so every occurrence through an edge's top passes all of it; (seq, start) is
    the latest occurrence, which FIFO eviction removes last; no back references
    (an evicted subtree is freed at once).
    """

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"suffix tree depth must be >= 2, got {depth}")
        self.depth, self.version = depth, 0
        self.clear()

    def clear(self) -> None:
        self.root = _Edge(0, -1, 0, 0, -1, 0)
        self.seqs: dict[int, list[int]] = {}
        self.order: deque[int] = deque()  # sequence numbers, oldest first
        self.tokens = 0
        self._next = 0
        self.version += 1  # positions held into the tree (match states) are stale

    def add(self, tokens: list[int]) -> None:
        if not tokens:
            return
        sid, self._next = self._next, self._next + 1
        seq = [int(t) for t in tokens]
        self.seqs[sid] = seq
        self.order.append(sid)
        self.tokens += len(seq)
        for i in range(len(seq)):
            self._insert(sid, seq, i)
        self.version += 1

    def _insert(self, sid: int, seq: list[int], i: int) -> None:
        end = min(self.depth, len(seq) - i)  # this suffix's path length
        node, d = self.root, 0
        while d < end:
            token = seq[i + d]
            children = node.children
            child = None if children is None else children.get(token)
            if child is None:
                leaf = _Edge(1, token, d + 1, end, sid, i)
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
            node, d = child, x

    def _split(self, parent: _Edge, edge: _Edge, depth: int) -> _Edge:
        """Cut `edge` after `depth`: the upper part (returned) becomes its parent."""
        upper = _Edge(edge.count, edge.token, edge.top, depth, edge.seq, edge.start)
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

    def speculate(self, node: _Edge, depth: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """As RequestTree.speculate."""
        def forced(node: _Edge, depth: int):  # inside an edge: every occurrence goes on
            return self.seqs[node.seq][node.start + depth] if depth < node.depth else None

        return _speculate(node, depth, limit, min_prob, forced)

    def nodes(self) -> int:
        n, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            n += 1
            stack += (node.children or {}).values()
        return n

    def counts(self) -> dict[tuple, int]:
        """Every string the tree holds with its count (tests)."""
        out: dict[tuple, int] = {}
        stack = [(child, ()) for child in (self.root.children or {}).values()]
        while stack:
            node, path = stack.pop()
            seq = self.seqs[node.seq]
            for d in range(node.top, node.depth + 1):
                path = path + (seq[node.start + d - 1],)
                out[path] = node.count
            stack += [(child, path) for child in (node.children or {}).values()]
        return out


class SuffixDrafter(Drafter):
    """Suffix decoding (module docstring). `fork()` shares the global tree."""

    name = "suffix"  # deterministic proposals: under sampling its q is one-hot (probs=None)

    def __init__(self, max_depth: int = 24, factor: float = 1.0, min_token_prob: float = 0.1,
                 max_cached_requests: int = 256, max_cached_tokens: int = 1 << 20, global_for_seeded: bool = False):
        if not 1 <= max_depth <= 1024:
            raise ConfigError(f"suffix drafter: max_depth must be in 1..1024, got {max_depth}")
        if not factor > 0:
            raise ConfigError(f"suffix drafter: factor must be > 0, got {factor}")
        if not 0 <= min_token_prob <= 1:
            raise ConfigError(f"suffix drafter: min_token_prob must be in [0, 1], got {min_token_prob}")
        if max_cached_requests < 0 or max_cached_tokens < 0:
            raise ConfigError(f"suffix drafter: cache bounds must be >= 0, got {max_cached_requests} "
                              f"requests, {max_cached_tokens} tokens")
        self.max_depth, self.factor, self.min_token_prob = max_depth, float(factor), float(min_token_prob)
        self.max_cached_requests, self.max_cached_tokens = max_cached_requests, max_cached_tokens
        self.global_for_seeded = global_for_seeded
        self.depth = max_depth + MAX_DRAFT_TOKENS  # room for a full draft after the longest match
        self.global_tree = GlobalTree(self.depth)
        self._fresh()

    def fork(self) -> "SuffixDrafter":
        """A drafter for another concurrent sequence (the batching server): its own
        per-request tree, the same global tree (one thread drives them all)."""
        clone = copy.copy(self)  # (drafters are constructed in drafting.build alone)
        clone._fresh()
        return clone

    def _fresh(self) -> None:
        self.tree = RequestTree(self.depth)
        self._prompt_len: int | None = None  # the first request's context, less its last token
        self._matches: list[tuple[int, _Edge, int]] = []  # (start, node, depth) in the global tree
        self._version = None  # global tree version _matches were computed for
        self._guide = None
        self._use_global = True  # False for a seeded sampled request (module docstring)
        self.match_len, self.score, self.source = 0, 0.0, None

    @property
    def context(self) -> list[int]:
        return self.tree.sequence

    # ------------------------------------------------------------ the protocol
    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        self.reset()
        self._guide = guide
        seeded = sampler is not None and sampler.params.seed is not None
        self._use_global = self.global_for_seeded or not seeded

    def reset(self) -> None:
        """End the sequence: its output (after the prompt's last max_depth tokens)
        joins the global tree, the oldest requests leaving it past the bounds."""
        ctx = self.tree.sequence
        if self._prompt_len is not None and len(ctx) > self._prompt_len and self.max_cached_requests > 0:
            self.add_to_global(ctx[max(0, self._prompt_len - self.max_depth):])
        self._fresh()

    def add_to_global(self, tokens: list[int]) -> None:
        """Index a sequence in the global tree (what reset() does with an output)."""
        tree = self.global_tree
        tree.add(list(tokens))
        while tree.order and (len(tree.order) > self.max_cached_requests or tree.tokens > self.max_cached_tokens):
            tree.evict_oldest()

    def clear_global(self) -> None:
        """Forget every earlier request (this drafter's forks share the loss)."""
        self.global_tree.clear()

    def draft(self, req: DraftRequest) -> DraftResult:
        self._sync(req)
        ctx = self.context
        tokens, self.match_len, self.score, self.source = [], 0, 0.0, None
        node, size = self.tree.longest_repeat(self.max_depth)
        g = next(((s, n, d) for s, n, d in self._matches if self.global_tree.continues(n, d)), None) \
            if self._use_global else None
        g_size = len(ctx) - g[0] if g is not None else 0
        options = []
        if size and size >= g_size:
            options = [(self.tree, node, size, size, "local")]
        if g_size:
            options.append((self.global_tree, g[1], g[2], g_size, "global"))
        if size and size < g_size:
            options.append((self.tree, node, size, size, "local"))
        for tree, at, depth, matched, source in options:  # the other tree if the first has nothing
            limit = min(req.k, int(self.factor * matched + 1e-9))
            if limit <= 0:
                continue
            tokens, score = tree.speculate(at, depth, limit, self.min_token_prob)
            if tokens:
                self.match_len, self.score, self.source = matched, score, source
                break
        if tokens and self._guide is not None:  # drafts the grammar refuses would only be cut
            tokens = tokens[:self._guide.valid_prefix(tokens)]
        return DraftResult(req.seq_id, tokens)

    # ------------------------------------------------------------ context updates
    def _sync(self, req: DraftRequest) -> None:
        ctx, new = self.context, req.new_tokens
        if req.base_len > len(ctx):
            raise ValueError(f"draft request base_len {req.base_len} beyond known {len(ctx)} tokens")
        if self._prompt_len is None:
            self._prompt_len = max(0, req.base_len + len(new) - 1)
        keep, skip = req.base_len, 0  # tokens re-sent unchanged need no rollback
        while keep < len(ctx) and skip < len(new) and ctx[keep] == new[skip]:
            keep, skip = keep + 1, skip + 1
        incremental = self._version == self.global_tree.version
        if keep < len(ctx):
            self.tree.truncate(keep)
            incremental = False
        added = new[skip:]
        for token in added:
            self.tree.append(int(token))
        if not self._use_global:
            return
        if incremental and len(added) < self.max_depth:
            for i, token in enumerate(added):
                self._match_step(len(ctx) - len(added) + i, int(token))
        else:  # recompute from the last max_depth tokens
            self._matches, self._version = [], self.global_tree.version
            for p in range(max(0, len(ctx) - self.max_depth), len(ctx)):
                self._match_step(p, ctx[p])

    def _match_step(self, p: int, token: int) -> None:
        """The global-tree positions of the context's suffixes, after token p."""
        tree, out, max_depth = self.global_tree, [], self.max_depth
        seqs = tree.seqs
        for start, node, depth in self._matches:  # (tree.advance, inlined: this runs per token)
            if depth >= max_depth:
                continue
            if depth < node.depth:
                if seqs[node.seq][node.start + depth] == token:
                    out.append((start, node, depth + 1))
            elif node.children is not None:
                child = node.children.get(token)
                if child is not None:
                    out.append((start, child, depth + 1))
        nxt = tree.advance(tree.root, 0, token)
        if nxt is not None:
            out.append((p, nxt[0], nxt[1]))
        self._matches = out
