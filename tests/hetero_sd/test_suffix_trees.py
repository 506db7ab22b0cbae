"""SuffixDrafter's trees (suffix decoding) against a brute-force reference: the
request tree's depth limit, the global tree's bounds, eviction and sharing, and
incremental drafts (rolled back, with earlier outputs) equal to the reference's.
The drafting rules and rollback: test_suffix_rules.py; the configuration and
the engine: test_suffix.py."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_sd.drafting.suffix import SuffixDrafter
from hetero_sd.drafting.suffix_global import GlobalTree
from hetero_sd.drafting.suffix_tree import RequestTree
from hetero_sd.ir.work import DraftRequest
from helpers.suffix_trees import global_counts, global_nodes, ref_counts, ref_draft, request_counts


def finish(drafter: SuffixDrafter, prompt: list[int], output: list[int]) -> None:
    """A request as the engine makes it: prompt + first token, then the rest, then reset."""
    drafter.begin(len(prompt) + len(output))
    drafter.draft(DraftRequest(0, 0, 4, prompt + output[:1]))
    drafter.draft(DraftRequest(0, len(prompt) + 1, 4, output[1:]))
    drafter.reset()


# ------------------------------------------------------------------ the request tree
def test_request_tree_depth_limit():
    tree = RequestTree(3)
    for token in [1, 2, 3, 4, 1, 2, 3, 4]:
        tree.append(token)
    assert request_counts(tree) == ref_counts([[1, 2, 3, 4, 1, 2, 3, 4]], 3)
    assert max(map(len, request_counts(tree))) == 3


# ------------------------------------------------------------------ the global tree
def test_an_earlier_output_is_drafted_from():
    drafter = SuffixDrafter()
    prompt, output = [50, 51, 52, 53], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]
    finish(drafter, prompt, output)
    assert global_counts(drafter.global_tree) == ref_counts([prompt + output], drafter.depth)
    # The same prompt again: its last tokens lead into the earlier output at once.
    drafter.begin(64)
    assert drafter.draft(DraftRequest(0, 0, 8, prompt + output[:1])).tokens == output[1:6]
    assert drafter.source == "global" and drafter.match_len == 5
    drafter.reset()
    # Another prompt: a piece of the earlier output, then its continuation.
    drafter.begin(64)
    assert drafter.draft(DraftRequest(0, 0, 3, [7, 7, 62, 63])).tokens == [64, 65]


def test_only_the_prompt_tail_joins_the_global_tree():
    drafter = SuffixDrafter(max_depth=2)
    finish(drafter, [1, 2, 3, 4, 5], [6, 7, 8])
    assert global_counts(drafter.global_tree) == ref_counts([[4, 5, 6, 7, 8]], drafter.depth)
    drafter.begin(8)
    drafter.reset()  # a request that drafted nothing adds nothing
    assert len(drafter.global_tree.order) == 1


def test_the_per_request_tree_wins_a_tie():
    for context, want, source in [([1, 2, 3, 1, 2], [3], "local"),  # both match (1, 2)
                                  ([8, 1, 2, 3, 4, 1, 2], [9], "global")]:  # (4, 1, 2) only before
        drafter = SuffixDrafter()
        drafter.add_to_global([4, 1, 2, 9])
        assert drafter.draft(DraftRequest(0, 0, 1, context)).tokens == want
        assert drafter.source == source


def test_the_global_tree_is_bounded_fifo():
    drafter = SuffixDrafter(max_cached_requests=2)
    outputs = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(3)]
    for i, output in enumerate(outputs):
        finish(drafter, [i], output)
    assert len(drafter.global_tree.order) == 2
    assert global_counts(drafter.global_tree) == ref_counts([[1] + outputs[1], [2] + outputs[2]], drafter.depth)
    assert propose_after(drafter, [10, 20]) == []  # the oldest is gone
    assert propose_after(drafter, [11, 21]) == [31, 41]
    tokens = SuffixDrafter(max_cached_tokens=9)
    for i, output in enumerate(outputs):
        finish(tokens, [i], output)
    assert tokens.global_tree.tokens == 5 and len(tokens.global_tree.order) == 1


def propose_after(drafter: SuffixDrafter, context: list[int], k: int = 4) -> list[int]:
    drafter.begin(64)
    out = drafter.draft(DraftRequest(0, 0, k, context)).tokens
    drafter._fresh()  # (a probe, not a request: nothing joins the global tree)
    return out


def test_eviction_frees_the_tree():
    drafter = SuffixDrafter(max_cached_requests=3)
    for i in range(40):
        finish(drafter, [i % 5, 1, 2], [3, 4, i % 7, 5, 6, i % 3, 7, 8])
    tree = drafter.global_tree
    kept = [tree.seqs[sid] for sid in tree.order]
    assert len(kept) == 3 and tree.tokens == sum(map(len, kept))
    assert global_counts(tree) == ref_counts(kept, drafter.depth)
    assert global_nodes(tree) <= 2 * tree.tokens + 1
    drafter.clear_global()
    assert global_nodes(tree) == 1 and tree.tokens == 0


def test_forks_share_the_global_tree_and_keep_their_own_context():
    parent = SuffixDrafter()
    fork = parent.fork()
    assert fork.global_tree is parent.global_tree and fork.tree is not parent.tree
    parent.begin(64)
    fork.begin(64)
    parent.draft(DraftRequest(0, 0, 4, [1, 2, 3, 4, 5]))
    assert fork.draft(DraftRequest(1, 0, 4, [9, 1, 2])).tokens == []  # the parent's context is not the fork's
    assert fork.context == [9, 1, 2] and parent.context == [1, 2, 3, 4, 5]
    parent.draft(DraftRequest(0, 5, 4, [6, 7, 8]))
    parent.reset()  # the parent's output joins the shared tree: the fork, mid-request, sees it
    assert fork.draft(DraftRequest(1, 3, 4, [3])).tokens == [4, 5, 6]
    assert fork.source == "global"
    fork.reset()
    assert len(parent.global_tree.order) == 2


def test_clear_global_forgets_earlier_requests():
    drafter = SuffixDrafter()
    finish(drafter, [1], [2, 3, 4, 5, 6])
    fork = drafter.fork()
    assert propose_after(fork, [9, 3, 4]) == [5, 6]
    drafter.clear_global()
    assert propose_after(fork, [9, 3, 4]) == [] and propose_after(drafter, [9, 3, 4]) == []


def test_global_tree_splits_and_merges_edges():
    tree = GlobalTree(6)
    tree.add([1, 2, 3, 4, 5])
    tree.add([1, 2, 3, 9])
    tree.add([2, 3, 4, 5, 6])
    assert global_counts(tree) == ref_counts([[1, 2, 3, 4, 5], [1, 2, 3, 9], [2, 3, 4, 5, 6]], 6)
    tree.evict_oldest()
    assert global_counts(tree) == ref_counts([[1, 2, 3, 9], [2, 3, 4, 5, 6]], 6)
    edge = tree.root.children[2]  # (2, 3) then 4 5 6 or 9: one edge down to the branch
    assert (edge.top, edge.depth, edge.count) == (1, 2, 2)
    # An edge split for an occurrence that is evicted becomes one edge again.
    tree = GlobalTree(6)
    tree.add([1, 2, 3, 4])
    tree.add([1, 2, 5])
    assert tree.root.children[1].depth == 2
    tree.evict_oldest()
    assert tree.root.children[1].depth == 3 and global_nodes(tree) == 4  # the root, (1 2 5), (2 5), (5)


# ------------------------------------------------------------------ incremental == reference
ALPHABET = st.integers(min_value=0, max_value=3)  # small: many repeats, ties and branches


@st.composite
def streams(draw):
    """Drafter parameters, earlier outputs, and delta steps (rollback, new tokens, k)."""
    params = {"max_depth": draw(st.integers(1, 6)), "factor": draw(st.sampled_from([0.5, 1.0, 3.0])),
              "min_token_prob": draw(st.sampled_from([0.0, 0.1, 0.4]))}
    earlier = draw(st.lists(st.lists(ALPHABET, min_size=1, max_size=25), max_size=3))
    steps = draw(st.lists(st.tuples(st.integers(0, 6), st.lists(ALPHABET, max_size=8), st.integers(1, 16)),
                          min_size=1, max_size=10))
    return params, earlier, steps


@settings(max_examples=400, deadline=None)
@given(streams())
def test_incremental_drafts_match_the_reference(stream):
    """Delta requests, sometimes rolled back, with earlier outputs in the global
    tree: every draft is the reference's, and the trees hold exactly the counts."""
    params, earlier, steps = stream
    drafter = SuffixDrafter(**params)
    for output in earlier:
        drafter.add_to_global(output)
    assert global_counts(drafter.global_tree) == ref_counts(earlier, drafter.depth)
    context: list[int] = []
    for rollback, new_tokens, k in steps:
        base_len = max(0, len(context) - rollback)
        context = context[:base_len] + new_tokens
        got = drafter.draft(DraftRequest(7, base_len, k, list(new_tokens)))
        want, match = ref_draft(context, earlier, k, params["max_depth"], params["factor"],
                                params["min_token_prob"])
        assert drafter.context == context
        assert got.tokens == want
        assert drafter.match_len == match
        assert request_counts(drafter.tree) == ref_counts([context], drafter.depth)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(ALPHABET, min_size=1, max_size=12), st.lists(ALPHABET, min_size=1, max_size=20)),
                min_size=1, max_size=8), st.integers(1, 4), st.integers(1, 5))
def test_requests_in_turn_match_the_reference(requests, cap, max_depth):
    """Whole requests through begin/draft/reset: the global tree holds the last
    `cap` outputs (each after its prompt's last max_depth tokens), evicted FIFO."""
    drafter, earlier = SuffixDrafter(max_depth=max_depth, max_cached_requests=cap), []
    for prompt, output in requests:
        drafter.begin(64)
        context, synced = prompt + output[:1], 0
        for i in range(1, len(output) + 1):
            got = drafter.draft(DraftRequest(0, synced, 5, context[synced:])).tokens
            assert got == ref_draft(context, earlier, 5, max_depth)[0]
            synced, context = len(context), context + output[i:i + 1]
        drafter.reset()
        earlier = (earlier + [prompt[max(0, len(prompt) - max_depth):] + output])[-cap:]
        assert global_counts(drafter.global_tree) == ref_counts(earlier, drafter.depth)
