"""SuffixDrafter (suffix decoding): the drafting rules on fixed contexts, and
rollback. The trees against a brute-force reference: test_suffix_trees.py; the
configuration and the engine: test_suffix.py."""
from __future__ import annotations

import pytest

from hetero_sd.drafting.suffix import SuffixDrafter
from hetero_sd.errors import ConfigError
from hetero_sd.ir.work import DraftRequest
from helpers.suffix_trees import ref_counts, request_counts


def propose(context: list[int], k: int, **kwargs) -> list[int]:
    return SuffixDrafter(**kwargs).draft(DraftRequest(0, 0, k, list(context))).tokens


# ------------------------------------------------------------------ drafting rules on fixed contexts
def test_proposes_the_continuation_of_an_earlier_occurrence():
    # The suffix (5, 6) matched 2 tokens: with factor 1 the draft is at most 2 long.
    assert propose([5, 6, 7, 8, 9, 5, 6], k=8) == [7, 8]
    assert propose([5, 6, 7, 8, 9, 5, 6], k=8, factor=2.0) == [7, 8, 9, 5]
    assert propose([5, 6, 7, 8, 9, 5, 6], k=1, factor=2.0) == [7]


def test_draft_length_follows_the_match_length():
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    drafter = SuffixDrafter()
    assert drafter.draft(DraftRequest(0, 0, 16, text + text[:3])).tokens == text[3:6]
    assert drafter.match_len == 3 and drafter.source == "local"
    assert drafter.draft(DraftRequest(0, 15, 16, text[3:7])).tokens == text[7:12] + text[:2]
    assert drafter.match_len == 7
    assert drafter.draft(DraftRequest(0, 19, 4, [])).tokens == text[7:11]  # k still bounds it


def test_the_most_frequent_continuation_wins():
    # (1, 2) was followed by 3 twice, by 4 once (most recently): 3 wins, unlike prompt lookup.
    context = [1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2]
    assert propose(context, k=1) == [3]


def test_a_tie_goes_to_the_most_recent_continuation():
    assert propose([1, 2, 3, 5, 1, 2, 4, 6, 1, 2], k=1) == [4]
    assert propose([1, 2, 4, 5, 1, 2, 3, 6, 1, 2], k=1) == [3]


def test_low_probability_continuations_are_not_drafted():
    context = [1, 2, 3, 5, 1, 2, 4, 6, 1, 2]  # 3 and 4 after (1, 2): each has probability 1/2
    assert propose(context, k=2, min_token_prob=0.5) == [4, 6]
    assert propose(context, k=2, min_token_prob=0.6) == []
    # The product of the ratios is what is bounded. After (1, 2): 3 twice, 6 twice (6 latest);
    # after (1, 2, 6): 8 once, 9 once (9 latest): 6 has 1/2, then 9 has 1/2 * 1/2.
    context = [1, 2, 3, 4, 10, 1, 2, 3, 5, 11, 1, 2, 6, 8, 12, 1, 2, 6, 9, 13, 1, 2]
    drafter = SuffixDrafter(min_token_prob=0.3, factor=4.0)
    assert drafter.draft(DraftRequest(0, 0, 2, context)).tokens == [6]
    assert drafter.score == pytest.approx(0.5)
    drafter = SuffixDrafter(min_token_prob=0.2, factor=4.0)
    assert drafter.draft(DraftRequest(0, 0, 2, context)).tokens == [6, 9]
    assert drafter.score == pytest.approx(0.75)


def test_the_longest_match_is_used():
    # (2, 3) alone was last followed by 20; (1, 2, 3) by 10.
    context = [1, 2, 3, 10, 0, 2, 3, 20, 5, 1, 2, 3]
    drafter = SuffixDrafter()
    assert drafter.draft(DraftRequest(0, 0, 1, context)).tokens == [10]
    assert drafter.match_len == 3
    assert propose(context, k=1, max_depth=2) == [20]


def test_nothing_to_draft():
    assert propose([], k=4) == []
    assert propose([1, 2, 3, 4], k=4) == []
    drafter = SuffixDrafter()
    assert drafter.draft(DraftRequest(0, 0, 4, [9, 1, 2])).tokens == []
    assert (drafter.match_len, drafter.score, drafter.source) == (0, 0.0, None)


def test_result_carries_the_sequence_id_and_no_distributions():
    result = SuffixDrafter().draft(DraftRequest(42, 0, 2, [1, 2, 3, 1, 2]))
    assert result.seq_id == 42 and result.tokens == [3, 1] and result.probs is None


def test_a_grammar_cuts_the_draft_where_it_refuses():
    class Guide:
        def valid_prefix(self, tokens):
            return tokens.index(9) if 9 in tokens else len(tokens)

    drafter = SuffixDrafter(factor=4.0)
    drafter.begin(64, guide=Guide())
    assert drafter.draft(DraftRequest(0, 0, 4, [1, 2, 3, 9, 4, 1, 2])).tokens == [3]


def test_bad_parameters_are_config_errors():
    for kwargs, message in [({"max_depth": 0}, "max_depth"), ({"factor": 0}, "factor"),
                            ({"min_token_prob": 1.5}, "min_token_prob"), ({"max_cached_requests": -1}, "cache")]:
        with pytest.raises(ConfigError, match=message):
            SuffixDrafter(**kwargs)


def test_base_len_beyond_the_known_context_is_refused():
    drafter = SuffixDrafter()
    drafter.draft(DraftRequest(0, 0, 3, [1, 2, 3]))
    with pytest.raises(ValueError, match=r"base_len 5 beyond known 3 tokens"):
        drafter.draft(DraftRequest(0, 5, 3, [4]))


# ------------------------------------------------------------------ rollback
def test_rollback_forgets_tokens_past_base_len():
    drafter = SuffixDrafter(factor=4.0)
    assert drafter.draft(DraftRequest(0, 0, 4, [5, 1, 2, 8, 5, 1, 2])).tokens == [8, 5, 1, 2]
    # Back to one token, then others: (5, 1, 2) -> 8 is forgotten.
    assert drafter.draft(DraftRequest(0, 1, 4, [3, 3, 1, 2])).tokens == []
    assert drafter.context == [5, 3, 3, 1, 2]
    assert request_counts(drafter.tree) == ref_counts([[5, 3, 3, 1, 2]], drafter.depth)
    assert drafter.draft(DraftRequest(0, 5, 4, [3, 3])).tokens == propose([5, 3, 3, 1, 2, 3, 3], 4, factor=4.0)


def test_rollback_restores_recency():
    # (1, 2) is followed by 3, 5, 6, then 3 again: rolled back, the tie among 3, 5 and 6
    # goes to 6, the latest left (3's recency is its first occurrence again).
    context = [1, 2, 3, 10, 1, 2, 5, 11, 1, 2, 6, 12, 1, 2, 3]
    drafter = SuffixDrafter()
    drafter.draft(DraftRequest(0, 0, 1, context))
    assert drafter.draft(DraftRequest(0, 14, 1, [])).tokens == [6] == propose(context[:14], 1)


def test_resent_tokens_are_not_rolled_back():
    drafter = SuffixDrafter()
    drafter.draft(DraftRequest(0, 0, 4, [1, 2, 3, 1, 2]))
    nodes = drafter.tree.root.children[1]
    drafter.draft(DraftRequest(0, 0, 4, [1, 2, 3, 1, 2, 3]))
    assert drafter.tree.root.children[1] is nodes and drafter.context == [1, 2, 3, 1, 2, 3]
