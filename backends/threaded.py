"""Any runner made asynchronous: its calls run on a thread of their own.

A CPU runtime whose calls block the caller (onnxruntime, torch) releases the
GIL while it computes, so with its calls on a DeviceQueue thread the caller is
free meanwhile: the engine can pre-draft the next round with a drafter that
computes elsewhere (a worker process pinned to other cores) while the target
verifies (scheduler/overlap.py). Pool calls (allocate, truncate, ...) run where
they are called: the engine makes them only between a submit's wait and the
next submit, when the queue is idle.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hetero_sd.backends.base import BatchItem, DeviceQueue, Pending, Runner, Wrapping


class ThreadedRunner(Wrapping):
    asynchronous = True

    def __init__(self, inner: Runner):
        super().__init__(inner)
        self.max_batch, self.feature_layers = inner.max_batch, inner.feature_layers
        self.can_copy_prefix, self.location = inner.can_copy_prefix, inner.location
        self.kernel_choice, self.pads_single_row = inner.kernel_choice, inner.pads_single_row
        self._queue = DeviceQueue(f"runner-{inner.device.device}")

    def submit(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int,
               greedy: bool = True) -> Pending:
        call = self.inner.greedy if greedy else self.inner.forward
        return self._queue.submit(call, seq_id, list(tokens), start, num_logits)

    def forward_batch(self, items: Sequence[BatchItem]) -> list[np.ndarray]:
        return self.inner.forward_batch(items)

    def take_features(self, seq_id: int):
        return self.inner.take_features(seq_id)

    def copy_prefix(self, src: int, dst: int, length: int):
        return self.inner.copy_prefix(src, dst, length)

    def draft_only(self) -> None:
        self.inner.draft_only()

    def close(self) -> None:
        self.inner.close()


__all__ = ["ThreadedRunner"]
