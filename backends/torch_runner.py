"""The torch backend's runner: the IR's reference forward with weights cast to
the precision and a KV pool pre-allocated to the budget (torch_backend.py
probes devices and loads it; importing this module imports torch)."""
from __future__ import annotations

from contextlib import ExitStack
from typing import Sequence

import numpy as np
import torch

from hetero_sd.backends.base import BatchItem, DeviceInfo, PrecisionInfo
from hetero_sd.backends.pool import ExtentAllocator, PooledRunner
from hetero_sd.backends.torch_numerics import RowStableLinear
from hetero_sd.ir.errors import BackendError
from hetero_sd.ir.model import ModelIR

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TorchRunner(PooledRunner):
    def __init__(self, model: ModelIR, info: DeviceInfo, precision: PrecisionInfo,
                 kv_budget_bytes: int, progress=None):
        cfg = model.config
        if cfg.output_vocab is not None:
            raise BackendError("torch: a restricted output vocabulary (vocab:) is not supported here; "
                               "run that draft on onnxruntime or openvino, or drop vocab:")
        self.device, self.precision = info, precision
        self.vocab_size, self.max_context = cfg.vocab_size, cfg.max_position_embeddings
        self._torch_device = torch.device(info.device)
        dtype = DTYPES[precision.name]
        weights = {}
        for name, tensor in model.iter_weights(progress):
            weights[name] = tensor.to(device=self._torch_device, dtype=dtype)
            # the file's pages just read leave the resident set as each tensor is converted:
            # else a mapped GGUF counts once more on top of the weights (the 1.5B in fp32
            # peaked at 8.6 GB, 7.7 GB with this; a tensor kept as a view is read back on use)
            model.weights.release_pages()
        bytes_per_token = cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
        capacity = min(kv_budget_bytes // bytes_per_token, 1 << 22)
        if capacity < 1:
            raise BackendError(f"memory.kv_budget of {kv_budget_bytes} bytes holds no position "
                               f"({bytes_per_token} bytes each)")
        self._alloc = ExtentAllocator(capacity, bytes_per_token,
                                      f"torch:{info.device} {precision.name} pool")
        shape = (cfg.num_layers, cfg.num_kv_heads, capacity, cfg.head_dim)
        # zeros, not empty: stale slots must never hold NaN garbage (a masked
        # read of NaN still poisons a sum); allocated once, at load.
        self._k = torch.zeros(shape, dtype=dtype, device=self._torch_device)
        self._v = torch.zeros(shape, dtype=dtype, device=self._torch_device)
        exact = None
        if precision.batch_invariant:
            exact = RowStableLinear()
            for name, tensor in weights.items():
                if tensor.dim() == 2 and (name != "model.embed_tokens.weight" or cfg.tie_word_embeddings):
                    exact.calibrate(tensor)
        self._forward = model.family.Forward(cfg, weights, dtype, exact_linear=exact)
        self.feature_layers = cfg.feature_layers  # (): the forward captures nothing
        self._features: dict[int, np.ndarray] = {}

    def take_features(self, seq_id: int) -> np.ndarray | None:
        """The feature layers' hidden states [T, len(layers) * hidden] of the
        sequence's latest call (backends/base.py), then forgotten."""
        return self._features.pop(seq_id, None)

    def _keep_features(self, seq_ids, feats: list) -> None:
        for seq_id, f in zip(seq_ids, feats):
            self._features[seq_id] = f.cpu().numpy()

    def allocate(self, capacity: int) -> int:
        return self._alloc.allocate(capacity)

    @torch.inference_mode()
    def _run(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> torch.Tensor:
        with self._alloc.writing(seq_id, start, len(tokens)) as ext:
            region = slice(ext.offset, ext.offset + ext.reserved)
            ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=self._torch_device)
            # Rows whose logits are returned run batch-invariant kernels, so a
            # k-token verify equals k one-token steps. A prefill (fewer logits
            # than rows) is the same call in every mode and may take fast kernels.
            exact = self.precision.batch_invariant and num_logits == len(tokens)
            self._features.pop(seq_id, None)
            feats = [] if self.feature_layers else None
            out = self._forward(ids, start, self._k[:, :, region], self._v[:, :, region], num_logits, exact, feats)
            if feats:
                self._keep_features([seq_id], feats)
            return out

    def forward(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> np.ndarray:
        return self._run(seq_id, tokens, start, num_logits).cpu().numpy()

    max_batch = 64  # sequences per batched call

    @torch.inference_mode()
    def forward_batch(self, items: Sequence[BatchItem]) -> list[np.ndarray]:
        """Several sequences in one pass (Forward.forward_batch). Rows whose logits
        are all returned run the batch-invariant kernels, as in forward; a
        prefill among them (fewer logits than rows) takes its own call, as alone."""
        solo = [it for it in items if it.num_logits != len(it.tokens)]
        together = [it for it in items if it.num_logits == len(it.tokens)]
        out = {id(it): self.forward(it.seq_id, it.tokens, it.start, it.num_logits) for it in solo}
        if together:
            with ExitStack() as stack:
                seqs = []
                for it in together:
                    ext = stack.enter_context(self._alloc.writing(it.seq_id, it.start, len(it.tokens)))
                    region = slice(ext.offset, ext.offset + ext.reserved)
                    ids = torch.as_tensor(np.asarray(it.tokens, dtype=np.int64), device=self._torch_device)
                    seqs.append((ids, it.start, self._k[:, :, region], self._v[:, :, region], it.num_logits))
                    self._features.pop(it.seq_id, None)
                feats = [] if self.feature_layers else None
                logits = self._forward.forward_batch(seqs, self.precision.batch_invariant, feats)
            if feats:
                self._keep_features([it.seq_id for it in together], feats)
            out.update({id(it): row.cpu().numpy() for it, row in zip(together, logits)})
        return [out[id(it)] for it in items]

    def greedy(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> list[int]:
        return self._run(seq_id, tokens, start, num_logits).argmax(-1).tolist()

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._features.pop(seq_id, None)

    def kv_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's K and V buffers (for tests and tools that inspect the pool)."""
        return self._k, self._v
