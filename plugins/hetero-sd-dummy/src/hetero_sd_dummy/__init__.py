"""hetero-sd-dummy: an example third-party backend, built only on hetero-sd's
public API, the way a plugin author would write one.

What a plugin provides (see hetero_sd.backends.base):
- a Backend class with `name`, `api_version = API_VERSION`, a cheap `probe()`
  listing its devices and precisions, and `load()` returning a Runner;
- a Runner (a subclass of hetero_sd.backends.base.Runner, API version 2) with its
  own KV pool: allocate / forward / greedy / truncate (O(1)) / length / release /
  usage; the optional capabilities (batched forward, hidden states, prefix copy)
  are declared on Runner with their defaults, so leaving them out is declaring
  none;
- an entry point in the `hetero_sd.backends` group (pyproject.toml).

Building blocks it reuses instead of writing them again:
- `hetero_sd.backends.base.resolve` to match the device and precision strings;
- `hetero_sd.backends.pool.ExtentAllocator` / `PooledRunner` (a Runner) for the pool's
  bookkeeping (which positions belong to which sequence; truncate is a length
  change), so only the buffers and the forward are the plugin's own;
- the model IR: `model.config` for shapes, `model.iter_weights()` for the
  weights. A real plugin hands those weights to its vendor runtime; this one
  runs the IR's reference forward (`model.family.Forward`) in torch on the CPU.

Lossless by construction: every row whose logits are returned runs as a
one-token call, so a k-token verify rounds exactly like k decode steps (the
precision is honestly batch-invariant, at the price of a slower verify).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hetero_sd.backends.base import API_VERSION, DeviceInfo, PrecisionInfo, resolve
from hetero_sd.backends.pool import ExtentAllocator, PooledRunner
from hetero_sd.errors import BackendError

__all__ = ["DummyBackend", "DummyRunner"]

PRECISION = PrecisionInfo("fp32", True, "scored rows run one at a time")


class DummyBackend:
    name = "dummy"
    api_version = API_VERSION

    def probe(self) -> list[DeviceInfo]:
        return [DeviceInfo(self.name, "dummy:0", "example plugin: IR reference forward on the host CPU",
                           (PRECISION,), PRECISION.name)]

    def load(self, model, device: str, precision: str, kv_budget_bytes: int, progress=None) -> "DummyRunner":
        info, prec = resolve(self.probe(), self.name, device, precision)
        return DummyRunner(model, info, prec, kv_budget_bytes, progress)


class DummyRunner(PooledRunner):
    """truncate / length / release / usage come from PooledRunner."""

    def __init__(self, model, info: DeviceInfo, precision: PrecisionInfo, kv_budget_bytes: int,
                 progress=None):
        cfg = model.config
        self.device, self.precision = info, precision
        self.vocab_size, self.max_context = cfg.vocab_size, cfg.max_position_embeddings
        weights = {name: t.to(torch.float32) for name, t in model.iter_weights(progress)}
        bytes_per_token = cfg.kv_bytes_per_token(4)
        capacity = min(kv_budget_bytes // bytes_per_token, 1 << 20)
        if capacity < 1:
            raise BackendError(f"dummy:0: a KV budget of {kv_budget_bytes} bytes holds no position "
                               f"({bytes_per_token} bytes each)")
        self._alloc = ExtentAllocator(capacity, bytes_per_token, "dummy:0 fp32 pool")
        shape = (cfg.num_layers, cfg.num_kv_heads, capacity, cfg.head_dim)
        self._k, self._v = torch.zeros(shape), torch.zeros(shape)  # allocated once, at load
        self._forward = model.family.Forward(cfg, weights, torch.float32)

    def allocate(self, capacity: int) -> int:
        return self._alloc.allocate(capacity)

    def _step(self, seq_id: int, tokens: Sequence[int], start: int) -> torch.Tensor:
        """One runtime call: tokens at [start, start+T), the last row's logits."""
        with self._alloc.writing(seq_id, start, len(tokens)) as ext:
            region = slice(ext.offset, ext.offset + ext.reserved)
            ids = torch.as_tensor(list(tokens), dtype=torch.int64)
            return self._forward(ids, start, self._k[:, :, region], self._v[:, :, region], 1)

    @torch.inference_mode()
    def _logits(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> torch.Tensor:
        if not 1 <= num_logits <= len(tokens):
            raise ValueError(f"num_logits must be in 1..{len(tokens)}, got {num_logits}")
        head = len(tokens) - num_logits  # rows nobody reads run together (a prompt)
        rows: list[torch.Tensor] = []
        ran = False  # some positions were written
        try:
            if head:
                self._step(seq_id, tokens[:head], start)
                ran = True
            for i, token in enumerate(tokens[head:]):
                rows.append(self._step(seq_id, [token], start + head + i))
                ran = True
        except Exception:
            if ran:  # undo the part that ran: a failed call leaves the length as it was
                self.truncate(seq_id, start)
            raise
        return torch.cat(rows)

    def forward(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> np.ndarray:
        return self._logits(seq_id, tokens, start, num_logits).numpy()

    def greedy(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> list[int]:
        return self._logits(seq_id, tokens, start, num_logits).argmax(-1).tolist()
