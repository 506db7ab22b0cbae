"""The suffix drafter's trees seen from outside, for tests: what strings a tree
holds (request_counts, global_counts, global_nodes), and brute-force
references to compare the trees and the drafter's proposals with (ref_counts,
ref_walk, ref_draft)."""
from __future__ import annotations

from hetero_sd.drafting.suffix_global import GlobalTree
from hetero_sd.drafting.suffix_tree import RequestTree, _is_tail
from hetero_sd.ir.work import MAX_DRAFT_TOKENS


# ------------------------------------------------------------------ what a tree holds
def request_counts(tree: RequestTree) -> dict[tuple, int]:
    """Every string a request tree holds with its count."""
    out: dict[tuple, int] = {}
    stack = [(child, (token,)) for token, child in (tree.root.children or {}).items()]
    while stack:
        node, path = stack.pop()
        out[path] = node.count
        if _is_tail(node):
            for d in range(node.depth, min(tree.depth, len(tree.sequence) - node.start)):
                path = path + (tree.sequence[node.start + d],)
                out[path] = 1
        else:
            stack += [(child, path + (token,)) for token, child in (node.children or {}).items()]
    return out


def global_counts(tree: GlobalTree) -> dict[tuple, int]:
    """Every string a global tree holds with its count."""
    out: dict[tuple, int] = {}
    stack = [(child, ()) for child in (tree.root.children or {}).values()]
    while stack:
        node, path = stack.pop()
        seq = tree.seqs[node.seq]
        for d in range(node.top, node.depth + 1):
            path = path + (seq[node.start + d - 1],)
            out[path] = node.count
        stack += [(child, path) for child in (node.children or {}).values()]
    return out


def global_nodes(tree: GlobalTree) -> int:
    """How many nodes (edges, and the root) a global tree has."""
    n, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        n += 1
        stack += (node.children or {}).values()
    return n


# ------------------------------------------------------------------ brute-force reference
def ref_counts(seqs: list[list[int]], depth: int) -> dict[tuple, int]:
    """How often every string of up to `depth` tokens occurs in `seqs`."""
    counts: dict[tuple, int] = {}
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                counts[tuple(s[i:i + n])] = counts.get(tuple(s[i:i + n]), 0) + 1
    return counts


def ref_walk(seqs: list[tuple[int, list[int]]], suffix: list[int], limit: int, min_prob: float,
             depth: int) -> list[int]:
    """Follow the most frequent next token (ties: the occurrence ending latest, by
    (sequence number, position)) while the product of the frequency ratios stays >= min_prob."""
    path, out, prob = list(suffix), [], 1.0
    while len(out) < limit and len(path) < depth:
        nexts: dict[int, tuple[int, tuple]] = {}
        for number, s in seqs:
            n = len(path)
            for j in range(len(s) - n):
                if s[j:j + n] == path:
                    token, when = s[j + n], (number, j + n)
                    count, latest = nexts.get(token, (0, when))
                    nexts[token] = (count + 1, max(latest, when))
        if not nexts:
            break
        total = sum(count for count, _ in nexts.values())
        token, (count, _) = max(nexts.items(), key=lambda item: item[1])
        prob *= count / total
        if prob < min_prob:
            break
        out.append(token)
        path.append(token)
    return out


def ref_draft(ctx: list[int], earlier: list[list[int]], k: int, max_depth: int = 24, factor: float = 1.0,
              min_prob: float = 0.1) -> tuple[list[int], int]:
    """(draft, match length): the longest suffix (<= max_depth) seen before with a
    continuation, in the context itself (preferred on a tie) or in `earlier`."""
    depth, n = max_depth + MAX_DRAFT_TOKENS, len(ctx)
    local = next((m for m in range(min(max_depth, n - 1), 0, -1)
                  if any(ctx[j:j + m] == ctx[n - m:] for j in range(n - m))), 0)
    glob = next((m for m in range(min(max_depth, n), 0, -1)
                 if any(s[j:j + m] == ctx[n - m:] for s in earlier for j in range(len(s) - m))), 0)
    mine, theirs = ([(0, ctx)], local), ([(i + 1, s) for i, s in enumerate(earlier)], glob)
    options = [mine, theirs] if local >= glob else [theirs, mine]
    for seqs, m in options:
        limit = min(k, int(factor * m + 1e-9))
        if m and limit > 0:
            out = ref_walk(seqs, ctx[n - m:], limit, min_prob, depth)
            if out:
                return out, m
    return [], 0
