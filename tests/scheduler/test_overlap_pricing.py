"""scheduler/overlap.py's decision and pricing, and a draft-length policy that prices
drafts a verify hid as free (scheduler/draft_length.py, Round.predrafted)."""
from __future__ import annotations

import pytest

from hetero_sd.scheduler import AdaptiveDraftLength
from hetero_sd.scheduler.overlap import decide, hit_rate, round_seconds, same_device
from hetero_sd.scheduler.round import Round


@pytest.mark.parametrize("mode, target, is_async, draft, predrafts, on, says", [
    ("off", "cuda:0", True, "cpu", True, False, "off"),
    ("auto", "cuda:0", True, None, True, False, "no drafter"),
    ("auto", "cuda:0", True, "cpu", False, False, "hidden states"),
    ("on", "cpu", False, "cpu", True, True, "is on"),
    ("auto", "cpu", False, "cpu", True, False, "synchronous"),
    ("auto", "cuda", True, "cuda:0", True, False, "share cuda"),
    ("auto", "cuda:0", True, "cpu", True, True, "drafts the next round"),
])
def test_decide(mode, target, is_async, draft, predrafts, on, says):
    got = decide(mode, target, is_async, draft, predrafts)
    assert got.on == on and says in got.why


def test_pricing():
    assert same_device("CUDA", "cuda:0") and not same_device("cuda:0", "cuda:1") and not same_device(None, "cpu")
    assert hit_rate(0.9, 0) == 0 and hit_rate(0.5, 2) == pytest.approx(0.125)
    # a pre-draft inside the verify costs nothing; a miss drafts serially
    assert round_seconds(0.020, 0.008, 0.010, 1.0) == pytest.approx(0.020)
    assert round_seconds(0.020, 0.008, 0.010, 0.0) == pytest.approx(0.028)
    assert round_seconds(0.020, 0.008, 0.030, 1.0) == pytest.approx(0.030)  # the pre-draft outlasts the verify


def _rounds(policy, predrafted: bool, n: int = 40) -> None:
    for _ in range(n):
        k = policy.next_k(100)
        rnd = Round(asked=k, drafted=k, accepted=max(0, k - 2), verify_s=0.020 + 0.001 * k,
                    draft_s=0.0 if predrafted else 0.006 * k, overlapped=True, predrafted=predrafted)
        policy.observe(rnd)


def test_hidden_drafts_are_priced_free():
    """Drafts at 6 ms a token against a 20 ms verify: drafting serially, a long draft does not
    pay at this acceptance; when every round's drafts were pre-drafted (hidden), the
    policy drafts further (and the hidden rounds teach the draft curve nothing)."""
    serial, hidden = AdaptiveDraftLength(8), AdaptiveDraftLength(8)
    _rounds(serial, False)
    _rounds(hidden, True)
    assert hidden._hidden > 0.9 and serial._hidden == 0.0
    assert hidden.next_k(100) > serial.next_k(100)
    assert Round(draft_s=0.0, predrafted=True).priced_draft_s is None
