"""Comparing logits with the oracle's: float32, same shape, within a tolerance, same argmax."""
from __future__ import annotations

import torch

ATOL = 1e-4


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL, what: str = ""):
    assert ours.dtype == torch.float32, f"{what}: reference_logits returned {ours.dtype}, want float32"
    assert tuple(ours.shape) == tuple(ref.shape), f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours - ref).abs()
    worst = diff.max().item()
    pos = int(diff.amax(-1).argmax())
    assert worst <= atol, f"{what}: max |diff| {worst:.3g} > {atol} (worst at position {pos})"
    # Exact logits agree, so the greedy choices must too (gaps here are far above 1e-4).
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), f"{what}: argmax differs"
