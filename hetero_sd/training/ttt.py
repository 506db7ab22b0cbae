"""The head's training objective: EAGLE-3's training-time test (TTT).

Row j of a sequence pairs the target's features at j with token j + 1 and is
trained to predict token j + 2 with the target's own distribution there
(soft cross-entropy over the draft vocabulary). Step 0 reads the target's
features; step s > 0 reads the head's own step s - 1 output of row j - 1, as
drafting does, and attends to the real pairs up to j - s plus its own chain
(one key per earlier step, on the diagonal), which is exactly what it sees
when it drafts s tokens ahead. Step s's loss weighs 0.8^s.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from hetero_sd.ir.eagle import EagleHead


def ttt_mask(n: int, steps: int, s: int, device=None) -> torch.Tensor:
    """[n, (s + 1) * n] bool: query row j of step s sees block-0 keys <= j - s and, in block
    t = 1..s, only key j - s + t (its own chain)."""
    j = torch.arange(n, device=device)[:, None]
    keys = torch.arange(n, device=device)[None]
    blocks = [keys <= j - s] + [keys == j - s + t for t in range(1, s + 1)]
    mask = torch.cat(blocks, 1)
    mask[:, 0] |= ~mask.any(1)  # rows j < s (no loss) still see one key: no NaN to spread
    return mask


def ttt_loss(head: EagleHead, tokens: torch.Tensor, features: torch.Tensor, labels: torch.Tensor,
             steps: int, decay: float = 0.8) -> tuple[torch.Tensor, list[float]]:
    """tokens [B, T], features [B, T, F], labels [B, T, N] (target logits over the draft
    vocabulary) -> (weighted loss, top-1 agreement with the target per step)."""
    B, T = tokens.shape
    n = T - 1  # rows 0..T-2: (features j, token j + 1) -> label row j + 1
    inputs, targets = tokens[:, 1:], F.softmax(labels[:, 1:].float(), -1)
    positions = torch.arange(n, device=tokens.device)
    hidden = head.fuse(features[:, :n].float())
    keys, values, total, agree = [], [], 0.0, []
    for s in range(steps):
        q, k, v = head.qkv(hidden, inputs, positions)
        keys.append(k)
        values.append(v)
        mask = ttt_mask(n, steps, s, tokens.device)
        out = head.finish(hidden, q, torch.cat(keys, 2), torch.cat(values, 2), mask)
        logits = head.logits(out)[:, s:]  # rows j >= s have a chain of s real steps behind them
        want = targets[:, s:]
        loss = F.cross_entropy(logits.flatten(0, 1), want.flatten(0, 1))  # soft labels, one fused kernel
        total = total + decay ** s * loss
        agree.append((logits.argmax(-1) == want.argmax(-1)).float().mean().item())
        # the next step's row j reads this step's output of row j - 1
        hidden = torch.cat((torch.zeros_like(out[:, :1]), out[:, :-1]), 1)
    return total, agree
