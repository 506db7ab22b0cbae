"""NgramDrafter (prompt lookup) against a brute-force reference, fed by DraftRequest deltas."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_sd.drafting import NgramDrafter
from hetero_sd.errors import ConfigError
from hetero_sd.ir.work import DraftRequest


def propose(context: list[int], k: int, min_ngram: int = 2, max_ngram: int = 4) -> list[int]:
    """A fresh drafter fed the whole context in one request."""
    drafter = NgramDrafter(min_ngram, max_ngram)
    return drafter.draft(DraftRequest(0, 0, k, list(context))).tokens


def reference(context: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Brute force: longest n first; latest e < len(context) with context[e-n:e] == the suffix."""
    size = len(context)
    for n in range(max_ngram, min_ngram - 1, -1):
        if size < n:
            continue
        suffix = context[size - n:]
        for e in range(size - 1, n - 1, -1):  # e == size would be the suffix itself
            if context[e - n:e] == suffix:
                return context[e:e + k]
    return []


# ------------------------------------------------------------------ behaviour on fixed contexts
def test_proposes_the_continuation_of_an_earlier_occurrence():
    assert propose([5, 6, 7, 8, 9, 5, 6], k=3) == [7, 8, 9]


def test_k_bounds_the_proposal():
    assert propose([5, 6, 7, 8, 9, 5, 6], k=1) == [7]
    assert propose([5, 6, 7, 8, 9, 5, 6], k=16) == [7, 8, 9, 5, 6]


def test_uses_the_latest_earlier_occurrence():
    # (1, 2) is followed by 7, then later by 8: the later one wins.
    assert propose([1, 2, 7, 1, 2, 8, 1, 2], k=1) == [8]
    assert propose([1, 2, 7, 1, 2, 8, 1, 2], k=4) == [8, 1, 2]


def test_prefers_the_longest_matching_ngram():
    # The 3-gram (1, 2, 3) last occurred followed by 10; the 2-gram (2, 3) more recently by 20.
    context = [1, 2, 3, 10, 0, 2, 3, 20, 1, 2, 3]
    assert propose(context, k=2, min_ngram=2, max_ngram=3) == [10, 0]
    assert propose(context, k=2, min_ngram=2, max_ngram=2) == [20, 1]


def test_falls_back_to_shorter_ngrams_down_to_min_ngram():
    context = [4, 9, 1, 4, 2, 3, 4]  # only the 1-gram (4,) repeats
    assert propose(context, k=2, min_ngram=2, max_ngram=4) == []
    assert propose(context, k=2, min_ngram=1, max_ngram=4) == [2, 3]


def test_returns_nothing_when_nothing_matches():
    assert propose([1, 2, 3, 4, 5, 6], k=5) == []
    assert propose([], k=5) == []
    assert propose([7], k=5) == []


def test_never_proposes_from_the_current_suffix_itself():
    # The suffix (1, 2) occurs only as the suffix: proposing from it would propose nothing useful
    # (or, with a stale index, the suffix's own tokens).
    assert propose([9, 1, 2], k=3) == []
    assert propose([1, 2], k=3, min_ngram=1, max_ngram=2) == []
    # A run: the latest *earlier* (1, 1) is the one ending one token before the end.
    assert propose([1, 1, 1], k=3) == [1]


def test_suffix_that_just_became_indexed_is_not_matched_against_itself():
    drafter = NgramDrafter(2, 2)
    assert drafter.draft(DraftRequest(0, 0, 3, [3, 4])).tokens == []
    # Now (3, 4) is an earlier occurrence, followed by 5; the suffix is (4, 5): no match.
    assert drafter.draft(DraftRequest(0, 2, 3, [5])).tokens == []
    assert drafter.draft(DraftRequest(0, 3, 3, [3, 4])).tokens == [5, 3, 4]


def test_rollback_forgets_tokens_past_base_len():
    drafter = NgramDrafter(2, 3)
    assert drafter.draft(DraftRequest(0, 0, 4, [5, 1, 2, 8, 5, 1, 2])).tokens == [8, 5, 1, 2]
    # Roll back to one committed token and append different ones: the old (5, 1, 2) -> 8 and
    # (1, 2) -> 8 entries are gone, so the new suffix (1, 2) has no earlier occurrence.
    assert drafter.draft(DraftRequest(0, 1, 4, [3, 3, 1, 2])).tokens == []
    assert drafter.context == [5, 3, 3, 1, 2]
    # And the rebuilt index is what a fresh drafter has.
    assert drafter.draft(DraftRequest(0, 5, 4, [3, 3])).tokens == propose([5, 3, 3, 1, 2, 3, 3], 4, 2, 3)


def test_rollback_to_the_start_is_a_fresh_sequence():
    drafter = NgramDrafter()
    drafter.draft(DraftRequest(0, 0, 3, [1, 2, 3, 1, 2]))
    assert drafter.draft(DraftRequest(0, 0, 3, [7, 8, 9, 7, 8])).tokens == [9, 7, 8]
    assert drafter.context == [7, 8, 9, 7, 8]


def test_reset_forgets_everything():
    drafter = NgramDrafter()
    drafter.draft(DraftRequest(0, 0, 3, [1, 2, 3, 1, 2]))
    drafter.reset()
    assert drafter.context == []
    assert drafter.draft(DraftRequest(0, 0, 3, [4, 1, 2])).tokens == []


def test_base_len_beyond_the_known_context_is_refused():
    drafter = NgramDrafter()
    drafter.draft(DraftRequest(0, 0, 3, [1, 2, 3]))
    with pytest.raises(ValueError, match=r"base_len 5 beyond known 3 tokens"):
        drafter.draft(DraftRequest(0, 5, 3, [4]))


def test_bad_ngram_sizes_are_a_config_error():
    with pytest.raises(ConfigError, match=r"min_ngram <= max_ngram, got 3, 2"):
        NgramDrafter(3, 2)
    with pytest.raises(ConfigError, match=r"1 <= min_ngram"):
        NgramDrafter(0, 2)


def test_result_carries_the_sequence_id():
    result = NgramDrafter().draft(DraftRequest(42, 0, 2, [1, 2, 3, 1, 2]))
    assert result.seq_id == 42 and result.tokens == [3, 1]


# ------------------------------------------------------------------ incremental == from scratch
ALPHABET = st.integers(min_value=0, max_value=2)  # small alphabet: many repeats, many matches


@st.composite
def request_streams(draw):
    """(min_ngram, max_ngram, steps); each step is (rollback, new_tokens, k)."""
    min_ngram = draw(st.integers(1, 3))
    max_ngram = draw(st.integers(min_ngram, 4))
    steps = draw(st.lists(
        st.tuples(st.integers(0, 6), st.lists(ALPHABET, max_size=8), st.integers(1, 16)),
        min_size=1, max_size=12))
    return min_ngram, max_ngram, steps


@settings(max_examples=300, deadline=None)
@given(st.lists(ALPHABET, max_size=40), st.integers(1, 16), st.integers(1, 3), st.integers(0, 3))
def test_fresh_drafter_matches_brute_force(context, k, min_ngram, extra):
    max_ngram = min_ngram + extra
    assert propose(context, k, min_ngram, max_ngram) == reference(context, k, min_ngram, max_ngram)


@settings(max_examples=300, deadline=None)
@given(request_streams())
def test_incremental_deltas_match_a_fresh_drafter(stream):
    """Delta requests (growing, and sometimes rolled back) give what a fresh drafter given the
    whole context gives, at every step."""
    min_ngram, max_ngram, steps = stream
    drafter = NgramDrafter(min_ngram, max_ngram)
    context: list[int] = []
    for rollback, new_tokens, k in steps:
        base_len = max(0, len(context) - rollback)
        context = context[:base_len] + new_tokens
        got = drafter.draft(DraftRequest(7, base_len, k, list(new_tokens))).tokens
        assert drafter.context == context
        assert got == propose(context, k, min_ngram, max_ngram)
        assert got == reference(context, k, min_ngram, max_ngram)


@settings(max_examples=200, deadline=None)
@given(st.lists(ALPHABET, min_size=1, max_size=40), st.lists(st.integers(1, 5), min_size=1, max_size=10))
def test_engine_style_appends_match_a_fresh_drafter(tokens, chunk_sizes):
    """The engine's pattern: base_len is always the previous length (no rollback)."""
    drafter = NgramDrafter()
    synced, i = 0, 0
    for size in chunk_sizes * 10:
        if i >= len(tokens):
            break
        chunk = tokens[i:i + size]
        i += len(chunk)
        got = drafter.draft(DraftRequest(0, synced, 5, chunk)).tokens
        synced += len(chunk)
        assert got == propose(tokens[:synced], 5)
