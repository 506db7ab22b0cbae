"""Running the in-place graph (onnx_gqa.py): one onnxruntime I/O binding per
sequence, made when the sequence is allocated, that binds each layer's slab
views as both the attention op's past inputs and its present outputs. A step
then binds only its few small inputs; the op reads the live slots where they
lie and writes the new rows into the slab itself."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hetero_sd.ir.errors import KVBudgetError


class InPlaceGraph:
    def __init__(self, session, num_layers: int, has_features: bool):
        self._session, self._layers, self._has_features = session, num_layers, has_features
        self._bindings: dict[int, object] = {}

    def bind(self, seq_id: int, slab: np.ndarray) -> None:
        """slab [2, layers, Hkv, R, D], the sequence's memory for as long as it lives."""
        io = self._session.io_binding()
        # logits (and features) first: run() reads outputs by this order
        io.bind_output("logits")
        if self._has_features:
            io.bind_output("features")
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
        rows = max(n, 2)  # attention runs on two rows at least (onnx_gqa.py)
        if start + rows > reserved:
            raise KVBudgetError(f"sequence {seq_id}: a call at {start} of {n} rows needs {start + rows} slots, "
                                f"{reserved} are reserved")
        io = self._bindings[seq_id]
        io.bind_cpu_input("input_ids", np.asarray(tokens, dtype=np.int64))
        io.bind_cpu_input("att_rows", np.minimum(np.arange(rows), n - 1))
        io.bind_cpu_input("seqlens_k", np.array([start + rows - 1], dtype=np.int32))
        io.bind_cpu_input("total_len", np.array(start + rows, dtype=np.int32))
        io.bind_cpu_input("num_logits", np.array(num_logits, dtype=np.int64))
        # rebound unallocated each call (a kept one would be taken as pre-allocated, of last call's shape);
        # a name bound again keeps its place among the outputs
        io.bind_output("logits")
        if self._has_features:
            io.bind_output("features")
        self._session.run_with_iobinding(io)
        outs = io.get_outputs()
        logits = np.array(outs[0].numpy())  # copies: the binding's buffers are reused
        return logits, (np.array(outs[1].numpy()) if self._has_features else None)
