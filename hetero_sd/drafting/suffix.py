"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM / ArcticInference's
SuffixDecodingCache): model-free drafts from suffix trees.

Two trees:

    per-request  this request's prompt and output so far (grows each round,
                 rolls back with DraftRequest.base_len)          RequestTree
    global       earlier requests' outputs, each after the last `max_depth`
                 tokens of its prompt (so an output is found by the context
                 that led to it); shared by the drafter's forks, bounded by
                 `max_cached_requests` / `max_cached_tokens`, the oldest
                 request evicted first (FIFO); and a corpus, if given:
                 earlier outputs saved to a file (hetero-sd
                 build-corpus), pinned there for good              GlobalTree

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
Alone, its one-hot drafts are coupled to the target's own draws
(hetero_sd/sampling.py): a seeded sampled output is target-only sampling's
whatever it drafts, so it drafts from everything. Where its lookups decide
drafts that carry distributions (inside a hybrid), a pinned request
(scheduler/mode.py: RequestMode.shares_lookups False) drafts from its own tree
and the corpus alone (a tree of the pinned sequences only, built on the first
such request and shared by the forks), never from earlier requests.

Both trees are suffix tries truncated at `depth` = max_depth + MAX_DRAFT_TOKENS
(room for a full draft after the longest match): the request tree in
suffix_tree.py (it grows one token at a time and rolls back exactly), the
path-compressed global tree in suffix_global.py (a request is inserted and
evicted whole). A draft costs O(max_depth) amortised.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

from hetero_sd.drafting.base import Drafter, round_of
from hetero_sd.drafting.suffix_global import GlobalTree, _Edge
from hetero_sd.drafting.suffix_tree import RequestTree
from hetero_sd.ir.errors import ConfigError
from hetero_sd.ir.work import MAX_DRAFT_TOKENS, DraftRequest, DraftResult
from hetero_sd.scheduler.round import Round


class SuffixDrafter(Drafter):
    """Suffix decoding (module docstring). `fork()` shares the global tree."""

    name = "suffix"  # deterministic proposals: under sampling its q is one-hot (probs=None)
    model_free = True
    one_hot = True
    can_fork = True  # fork(): a drafter per concurrent sequence (the batching server)

    def __init__(self, max_depth: int = 24, factor: float = 1.0, min_token_prob: float = 0.1,
                 max_cached_requests: int = 256, max_cached_tokens: int = 1 << 20,
                 corpus: Iterable[Sequence[int]] = ()):
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
        self.depth = max_depth + MAX_DRAFT_TOKENS  # room for a full draft after the longest match
        self.global_tree = GlobalTree(self.depth)
        for tokens in corpus:  # pinned: beyond the bounds, never evicted, kept by clear_global()
            self.global_tree.add(list(tokens), pinned=True)
        self._corpus_only: dict = {}  # "tree": the corpus alone, for pinned requests (shared by forks)
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
        self._matches: list[tuple[int, _Edge, int]] = []  # (start, node, depth) in self._global
        self._version = None  # self._global's version _matches were computed for
        self._guide = None
        # The shared tree this request drafts from: the global one, or for a seeded sampled
        # request the corpus alone (None without a corpus; module docstring)
        self._global: GlobalTree | None = self.global_tree
        self.match_len, self.score, self.source = 0, 0.0, None

    @property
    def context(self) -> list[int]:
        return self.tree.sequence

    # ------------------------------------------------------------ the protocol
    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        self.reset()
        self._guide = guide
        shares = sampler is None or sampler.mode.shares_lookups  # (scheduler/mode.py)
        self._global = self.global_tree if shares else self._corpus_tree()

    def _corpus_tree(self) -> GlobalTree | None:
        """The corpus's pinned sequences alone, indexed on first use (as long again as
        the global tree took for them); None without a corpus."""
        if "tree" not in self._corpus_only:
            pinned = self.global_tree.pinned_sequences()
            tree = None
            if pinned:
                tree = GlobalTree(self.depth)
                for tokens in pinned:
                    tree.add(tokens, pinned=True)
            self._corpus_only["tree"] = tree
        return self._corpus_only["tree"]

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
        """Forget every earlier request (this drafter's forks share the loss); a corpus stays."""
        self.global_tree.evict_all()

    def draft(self, req: DraftRequest, rnd: Round | None = None) -> DraftResult:
        free = round_of(rnd).free_rows
        self._sync(req)
        ctx = self.context
        tokens, self.match_len, self.score, self.source = [], 0, 0.0, None
        node, size = self.tree.longest_repeat(self.max_depth)
        shared = self._global
        g = next(((s, n, d) for s, n, d in self._matches if shared.continues(n, d)), None) \
            if shared is not None else None
        g_size = len(ctx) - g[0] if g is not None else 0
        options = []
        if size and size >= g_size:
            options = [(self.tree, node, size, size, "local")]
        if g_size:
            options.append((shared, g[1], g[2], g_size, "global"))
        if size and size < g_size:
            options.append((self.tree, node, size, size, "local"))
        for tree, at, depth, matched, source in options:  # the other tree if the first has nothing
            # (a free verify row takes a draft from any match, however short)
            limit = min(req.k, max(int(self.factor * matched + 1e-9), free))
            if limit <= 0:
                continue
            tokens, score = tree.speculate(at, depth, limit, self.min_token_prob, free)
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
        shared = self._global
        incremental = shared is not None and self._version == shared.version
        if keep < len(ctx):
            self.tree.truncate(keep)
            incremental = False
        added = new[skip:]
        for token in added:
            self.tree.append(int(token))
        if shared is None:
            return
        if incremental and len(added) < self.max_depth:
            for i, token in enumerate(added):
                self._match_step(len(ctx) - len(added) + i, int(token))
        else:  # recompute from the last max_depth tokens
            self._matches, self._version = [], shared.version
            for p in range(max(0, len(ctx) - self.max_depth), len(ctx)):
                self._match_step(p, ctx[p])

    def _match_step(self, p: int, token: int) -> None:
        """The global-tree positions of the context's suffixes, after token p."""
        tree, out, max_depth = self._global, [], self.max_depth
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
