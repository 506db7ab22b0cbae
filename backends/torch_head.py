"""An EAGLE-3 draft head (ir/eagle.py) on torch: its KV cache and its step.

The head-runner contract (what drafting.head.HeadDrafter drives; backends/onnx_head.py
offers the same on onnxruntime):

    runner.begin(capacity)                     a fresh KV cache for `capacity` positions
    out, logits = runner.run(tokens, start, first, features=rows)   real pairs: fc(features)
    out, logits = runner.run([token], start, first, hidden=out)      a draft step: own output
        rows at positions start.. (causal among themselves) attend to the cached
        rows from `first`; their K/V are written at start..; `out` is the last
        row's pre-norm output (opaque: fed back as `hidden`), `logits` its
        draft-vocabulary logits, float32 numpy [draft_vocab]
    runner.target_ids    numpy int64 [draft_vocab]: draft id -> target token id
    runner.feature_layers, runner.vocab_size (the target's), runner.fork() (shares weights)
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from hetero_sd.ir.eagle import EagleHead
from hetero_sd.ir.work import MAX_DRAFT_TOKENS


class TorchHeadRunner:
    def __init__(self, head: EagleHead, device: str = "cpu"):
        self.device = torch.device(device)
        self.head = head.to(self.device).eval()
        cfg = head.cfg
        self.feature_layers, self.vocab_size = cfg.feature_layers, cfg.model.vocab_size
        self.target_ids = head.target_ids.cpu().numpy()
        self._cache = None

    def fork(self) -> "TorchHeadRunner":
        clone = copy.copy(self)
        clone._cache = None
        return clone

    def begin(self, capacity: int) -> None:
        m = self.head.cfg.model
        shape = (1, m.num_kv_heads, capacity + MAX_DRAFT_TOKENS + 1, m.head_dim)
        if self._cache is None or self._cache[0].shape[2] < shape[2]:
            self._cache = tuple(torch.zeros(shape, device=self.device) for _ in range(2))

    @torch.inference_mode()
    def run(self, tokens: list[int], start: int, first: int, features: np.ndarray | None = None,
            hidden: torch.Tensor | None = None):
        if features is not None:
            hidden = self.head.fuse(torch.as_tensor(np.asarray(features, dtype=np.float32), device=self.device)[None])
        ids = torch.tensor([tokens], device=self.device)
        n = len(tokens)
        q, k, v = self.head.qkv(hidden, ids, torch.arange(start, start + n, device=self.device))
        keys, values = self._cache
        keys[:, :, start:start + n], values[:, :, start:start + n] = k, v
        mask = None
        if n > 1:  # causal among the new rows
            span = start + n - first
            mask = torch.arange(span, device=self.device)[None] <= \
                torch.arange(start - first, span, device=self.device)[:, None]
        out = self.head.finish(hidden, q, keys[:, :, first:start + n], values[:, :, first:start + n], mask)
        last = out[:, -1:]
        return last, self.head.logits(last)[0, -1].float().cpu().numpy()
