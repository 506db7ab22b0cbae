"""Running the varlen graph (onnx_native.py): one onnxruntime I/O binding whose
`pool` input is the runner's KV pool, bound once (the pool never moves), so
SlabAttention reads every sequence's keys where they lie and writes the new
rows into them. A call binds only its few small inputs and its output buffers."""
from __future__ import annotations

import numpy as np

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

    def run(self, tokens: list[list[int]], starts: list[int], logits: list[int], slabs: list[tuple[int, int]]
            ) -> tuple[np.ndarray, np.ndarray | None, list[int]]:
        """Each sequence's tokens (a padded call's last one longer by its last token again,
        whose K/V lands in the slot past it) at its start, its last `logits` rows scored,
        its slab (reserved positions, float offset in the pool) -> (logits [sum(logits),
        vocab], features [T, .] or None, each sequence's first packed row): views."""
        n = np.fromiter(map(len, tokens), np.int64, len(tokens))
        first = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
        ids = np.fromiter((t for seq in tokens for t in seq), np.int64, int(n.sum()))
        seqs = np.array([(f, k, s, r, off) for f, k, s, (r, off) in zip(first, n, starts, slabs)], dtype=np.int64)
        wanted = np.concatenate([np.arange(f + k - m, f + k, dtype=np.int64) for f, k, m in zip(first, n, logits)])
        io = self._io
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("seqs", seqs)
        io.bind_cpu_input("logit_rows", wanted)
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
