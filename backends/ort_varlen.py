"""Running the varlen graph (onnx_native.py): one onnxruntime I/O binding whose
`pool` input is the runner's KV pool, bound once (the pool never moves), so
SlabAttention reads every sequence's keys where they lie and writes the new
rows into them. A call binds only its few small inputs and its output buffers."""
from __future__ import annotations

import numpy as np

from hetero_sd.backends.base import BatchItem

KEPT_ROWS = 32  # output buffers of up to this many rows are kept for the next call


class VarlenGraph:
    def __init__(self, session, pool: np.ndarray, vocab: int, features: int):
        """pool: the runner's flat float32 pool; features: the width of the features
        output (0: the graph has none)."""
        self._session = session
        self._pool = pool  # the binding holds its address: keep it alive
        self._io = session.io_binding()
        self._io.bind_input("pool", "cpu", 0, np.float32, [pool.size], pool.ctypes.data)
        self._widths = {"logits": vocab, **({"features": features} if features else {})}
        # output buffers by name and row count, bound per call
        self._buffers: dict[tuple[str, int], np.ndarray] = {}

    def run(self, items: list[BatchItem], rows: list[int], logits: list[int], slabs: list[tuple[int, int]]
            ) -> tuple[np.ndarray, np.ndarray | None, list[int]]:
        """items' tokens (each item's `rows` of them: a padded call's last item one more,
        its last token again, whose K/V lands in the slot past it), `logits` rows each
        (its last ones), slabs (reserved positions, float offset in the pool) ->
        (logits [sum(logits), vocab], features [T, .] or None, each item's first row): views."""
        n = np.asarray(rows, dtype=np.int64)
        first = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
        ids = np.concatenate([np.asarray(list(it.tokens) + list(it.tokens[-1:]) * (k - len(it.tokens)),
                                         dtype=np.int64) for it, k in zip(items, rows)])
        seqs = np.array([(f, k, it.start, r, off) for it, f, k, (r, off) in zip(items, first, rows, slabs)],
                        dtype=np.int64)
        wanted = np.concatenate([np.arange(f + k - m, f + k) for f, k, m in zip(first, rows, logits)])
        io = self._io
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("seqs", seqs)
        io.bind_cpu_input("logit_rows", wanted.astype(np.int64))
        outs = {name: self._buffer(name, len(wanted) if name == "logits" else len(ids)) for name in self._widths}
        self._session.run_with_iobinding(io)
        return outs["logits"], outs.get("features"), first.tolist()

    def _buffer(self, name: str, rows: int) -> np.ndarray:
        buf = self._buffers.get((name, rows))
        if buf is None:
            buf = np.empty((rows, self._widths[name]), dtype=np.float32)
            if rows <= KEPT_ROWS:  # (a long prefill's rows are not kept)
                self._buffers[name, rows] = buf
        self._io.bind_output(name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
        return buf
