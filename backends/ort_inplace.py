"""Running the in-place graph (onnx_gqa.py): one onnxruntime I/O binding per
sequence, made when the sequence is allocated, that binds each layer's slab
views as both the attention op's past inputs and its present outputs. A step
then binds only its few small inputs; the op reads the live slots where they
lie and writes the new rows into the slab itself."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hetero_sd.ir.errors import KVBudgetError


KEPT_ROWS = 32  # output buffers of up to this many rows are kept for the next call


class InPlaceGraph:
    def __init__(self, session, num_layers: int, vocab: int, features: int):
        """features: the width of the features output (0: the graph has none)."""
        self._session, self._layers = session, num_layers
        # GroupQueryAttention's graph attends on two rows at least (onnx_gqa.py); our
        # SlabAttention's on the call's own rows (onnx_native.py), with no row inputs
        self.pads_rows = "att_rows" in {i.name for i in session.get_inputs()}
        self._widths = {"logits": vocab, **({"features": features} if features else {})}
        self._bindings: dict[int, object] = {}
        # output buffers by name and row count, bound per call: reading outputs back
        # through the binding would wrap every present_* output too (~0.13 ms a call)
        self._buffers: dict[tuple[str, int], np.ndarray] = {}

    def bind(self, seq_id: int, slab: np.ndarray) -> None:
        """slab [2, layers, Hkv, R, D], the sequence's memory for as long as it lives."""
        io = self._session.io_binding()
        shape = [1, *slab.shape[2:]]
        for j, n in enumerate("kv"):
            for i in range(self._layers):
                view = slab[j, i]  # [Hkv, R, D], contiguous
                for name, bind in ((f"past_{n}_{i}", io.bind_input), (f"present_{n}_{i}", io.bind_output)):
                    bind(name, "cpu", 0, np.float32, shape, view.ctypes.data)
        self._bindings[seq_id] = io

    def release(self, seq_id: int) -> None:
        self._bindings.pop(seq_id, None)

    def run(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int, reserved: int
            ) -> tuple[np.ndarray, np.ndarray | None]:
        """Logits [num_logits, vocab] (and features [T, .]) of tokens at start.., copies."""
        n = len(tokens)
        rows = max(n, 2) if self.pads_rows else n  # (onnx_gqa.py: two rows at least)
        if start + rows > reserved:
            raise KVBudgetError(f"sequence {seq_id}: a call at {start} of {n} rows needs {start + rows} slots, "
                                f"{reserved} are reserved")
        io = self._bindings[seq_id]
        io.bind_cpu_input("input_ids", np.asarray(tokens, dtype=np.int64))
        if self.pads_rows:
            io.bind_cpu_input("att_rows", np.minimum(np.arange(rows), n - 1))
            io.bind_cpu_input("seqlens_k", np.array([start + rows - 1], dtype=np.int32))
        io.bind_cpu_input("total_len", np.array(start + rows, dtype=np.int32))
        io.bind_cpu_input("num_logits", np.array(num_logits, dtype=np.int64))
        outs = {name: self._buffer(io, name, num_logits if name == "logits" else n) for name in self._widths}
        self._session.run_with_iobinding(io)
        # copies: the buffers serve the next call
        return outs["logits"].copy(), (outs["features"].copy() if "features" in outs else None)

    def _buffer(self, io, name: str, rows: int) -> np.ndarray:
        buf = self._buffers.get((name, rows))
        if buf is None:
            buf = np.empty((rows, self._widths[name]), dtype=np.float32)
            if rows <= KEPT_ROWS:  # (a long prefill's rows are not kept)
                self._buffers[name, rows] = buf
        io.bind_output(name, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
        return buf
