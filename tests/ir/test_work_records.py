"""Work IR records pack to fixed layouts and round-trip exactly."""
import pytest
from hypothesis import given, strategies as st

from hetero_sd.ir.work import MAX_DRAFT_TOKENS, DraftRequest, DraftResult, VerifyRequest

ints = st.integers(min_value=0, max_value=2**31 - 1)
tokens = st.lists(ints, max_size=MAX_DRAFT_TOKENS + 1)


@given(ints, ints, st.integers(1, MAX_DRAFT_TOKENS), tokens)
def test_draft_request_roundtrip(seq, base, k, toks):
    rec = DraftRequest(seq, base, k, toks)
    assert DraftRequest.unpack(rec.pack()) == rec


@given(ints, ints, tokens)
def test_verify_records_roundtrip(seq, start, toks):
    assert VerifyRequest.unpack(VerifyRequest(seq, start, toks).pack()) == VerifyRequest(seq, start, toks)
    assert DraftResult.unpack(DraftResult(seq, toks).pack()) == DraftResult(seq, toks)


def test_fixed_size_and_kind_checked():
    rec = DraftResult(3, [10])
    assert len(rec.pack()) == 4 * 4  # kind, n_tokens, seq_id, one token
    assert len(VerifyRequest(1, 2, [5] * 4).pack()) == 4 * (4 + 4)
    with pytest.raises(ValueError, match="not a VerifyRequest"):
        VerifyRequest.unpack(rec.pack())
