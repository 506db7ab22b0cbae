"""The cuda backend's runner: weights and a KV pool on the device, every call
through the Triton forward (forward.py), greedy ids chosen on the device.

Importing this module imports torch and Triton; the backend (backend.py)
probes without either.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import triton

from hetero_sd.backends.base import BatchItem, DeviceInfo, Pending, PrecisionInfo
from hetero_sd.backends.cuda.forward import CudaForward, Rows, rope_tables
from hetero_sd.backends.cuda.graphs import GraphCache
from hetero_sd.backends.cuda.ops import Kernels
from hetero_sd.backends.cuda.weights import estimate_bytes, load_weights, weight_bytes
from hetero_sd.backends.pool import ExtentAllocator, PooledRunner
from hetero_sd.ir.errors import BackendError
from hetero_sd.ir.model import ModelIR

GiB = 1 << 30


@dataclass(frozen=True)
class Tiles:
    """The shapes that fix the attention's reduction order (kernels.py): positions per
    KV split and per block. A runner's results depend on them, never on a call's rows;
    the tests shrink them to reach several splits on tiny contexts."""
    attn_split: int = 256
    attn_block: int = 32
    graphs: bool = True  # capture decode / verify calls as CUDA graphs (cuda devices only)
    graph_widths: int = 17  # 1 .. k_max + 1 rows a call


def free_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device's memory (the host's, for the interpreter's cpu)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class CudaRunner(PooledRunner):
    max_batch = 64  # sequences per call
    can_copy_prefix = True

    def __init__(self, model: ModelIR, info: DeviceInfo, precision: PrecisionInfo, dtype: torch.dtype,
                 kv_budget_bytes: int, progress=None, tiles: Tiles = Tiles()):
        cfg = model.config
        self.device, self.precision = info, precision
        self.vocab_size, self.max_context = cfg.logits_vocab, cfg.max_position_embeddings
        self._dev = torch.device(info.device)
        # calls are launched on the stream and return before the GPU is done (submit);
        # interpreted kernels on the cpu device run where they are called
        self.asynchronous = self._dev.type == "cuda"
        self._dtype, self._tiles = dtype, tiles
        blocks = precision.name == "gguf"
        bytes_per_token = cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
        capacity = min(kv_budget_bytes // bytes_per_token, 1 << 22)
        if capacity < 1:
            raise BackendError(f"memory.kv_budget of {kv_budget_bytes} bytes holds no position "
                               f"({bytes_per_token} bytes each)")
        self._refuse_if_too_big(model, estimate_bytes(model, torch.finfo(dtype).bits // 8, blocks),
                                capacity * bytes_per_token)
        weights = load_weights(model, dtype, self._dev, blocks, progress)
        self.weight_bytes = weight_bytes(weights)
        self._alloc = ExtentAllocator(capacity, bytes_per_token, f"cuda:{info.device} {precision.name} pool")
        shape = (cfg.num_layers, cfg.num_kv_heads, capacity, cfg.head_dim)
        # zeros: a stale slot never holds NaN (a masked read of NaN would still poison a sum)
        self._k = torch.zeros(shape, dtype=dtype, device=self._dev)
        self._v = torch.zeros(shape, dtype=dtype, device=self._dev)
        sms = torch.cuda.get_device_properties(self._dev).multi_processor_count if self._dev.type == "cuda" else 1
        self.ops = Kernels(dtype, sms, tiles.attn_split, tiles.attn_block)
        ropes = rope_tables(cfg, min(capacity, cfg.max_position_embeddings), self._dev)
        self._forward = CudaForward(cfg, weights, self.ops, self._k, self._v, ropes)
        self.feature_layers = cfg.feature_layers
        self._features: dict[int, np.ndarray] = {}
        capture = tiles.graphs and self._dev.type == "cuda" and cfg.moe is None
        self._graphs = GraphCache(self._forward, self.ops, tiles.graph_widths) if capture else None
        self.kernel_choice = (f"Triton kernels{' (interpreted)' if self._dev.type == 'cpu' else ''}, "
                              f"batch-invariant; {'CUDA graphs per call width' if capture else 'no CUDA graphs'}")

    def _refuse_if_too_big(self, model: ModelIR, weights: int, pool: int) -> None:
        free, total = free_bytes(self._dev)
        if weights + pool > free:
            raise BackendError(
                f"{model.source.name} does not fit on {self.device.backend}:{self.device.device}: it needs "
                f"about {(weights + pool) / GiB:.2f} GiB (weights {weights / GiB:.2f} GiB at "
                f"{self.precision.name}, KV pool {pool / GiB:.2f} GiB) and the device has "
                f"{free / GiB:.2f} GiB free of {total / GiB:.2f} GiB; lower memory.kv_budget, "
                f"take precision gguf, or a smaller model")

    # ---------------------------------------------------------------- calls
    def allocate(self, capacity: int) -> int:
        return self._alloc.allocate(capacity)

    def _rows(self, items: Sequence[BatchItem], exts) -> Rows:
        ids, pos, base, logit_rows, off = [], [], [], [], 0
        for it, ext in zip(items, exts):
            n = len(it.tokens)
            ids.extend(it.tokens)
            pos.extend(range(it.start, it.start + n))
            base.extend([ext.offset] * n)
            logit_rows.extend(range(off + n - it.num_logits, off + n))
            off += n
        pos_t = torch.tensor(pos, dtype=torch.int32)
        base_t = torch.tensor(base, dtype=torch.int32)
        put = lambda t: t.to(self._dev, non_blocking=True)  # noqa: E731
        return Rows(put(torch.tensor(ids, dtype=torch.int64)), put(pos_t), put(base_t),
                    put((base_t + pos_t).to(torch.int64)), put(torch.tensor(logit_rows, dtype=torch.int64)),
                    triton.cdiv(max(pos) + 1, self._tiles.attn_split), tuple(len(it.tokens) for it in items))

    @torch.inference_mode()
    def _run(self, items: Sequence[BatchItem], greedy: bool) -> list[torch.Tensor]:
        """Logits (or argmax ids, when greedy) of every item, each [num_logits, ...]."""
        with ExitStack() as stack:
            exts = [stack.enter_context(self._alloc.writing(it.seq_id, it.start, len(it.tokens)))
                    for it in items]
            for it in items:
                self._features.pop(it.seq_id, None)
            feats = [] if self.feature_layers else None
            one = items[0]
            if self._graphs is not None and feats is None and len(items) == 1 \
                    and one.num_logits == len(one.tokens) and self._graphs.fits(len(one.tokens)):
                out = self._graphs.run(self._rows(items, exts), greedy)
            else:
                logits = self._forward(self._rows(items, exts), feats)
                out = self.ops.argmax(logits) if greedy else logits
        if feats:
            for it, f in zip(items, feats):
                self._features[it.seq_id] = f.cpu().numpy()
        return list(out.split([it.num_logits for it in items]))

    def forward(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> np.ndarray:
        return self._run([BatchItem(seq_id, tokens, start, num_logits)], False)[0].cpu().numpy()

    def greedy(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> list[int]:
        """Only the chosen ids leave the device."""
        return self._run([BatchItem(seq_id, tokens, start, num_logits)], True)[0].tolist()

    def submit(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int,
               greedy: bool = True) -> Pending:
        """Launch the call and return: its result is copied to pinned host memory behind an
        event, and wait() synchronizes on that event alone (not the whole device)."""
        if not self.asynchronous:
            return super().submit(seq_id, tokens, start, num_logits, greedy)
        out = self._run([BatchItem(seq_id, tokens, start, num_logits)], greedy)[0]
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait():
            done.synchronize()
            return host.tolist() if greedy else host.numpy()
        return Pending(wait)

    def forward_batch(self, items: Sequence[BatchItem]) -> list[np.ndarray]:
        """Every item's rows in one pass, prefills among them: one kernel set serves all."""
        return [t.cpu().numpy() for t in self._run(list(items), False)]

    def take_features(self, seq_id: int) -> np.ndarray | None:
        return self._features.pop(seq_id, None)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """The KV of src's first `length` positions into the empty dst: bitwise what a
        prefill writes, since a row's K and V depend on its own prefix alone."""
        s = self._alloc.extent(src)
        if length > s.length:
            raise ValueError(f"sequence {src} holds {s.length} positions, not {length}")
        with self._alloc.writing(dst, 0, length) as d:
            for pool in (self._k, self._v):
                pool[:, :, d.offset:d.offset + length] = pool[:, :, s.offset:s.offset + length]

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._features.pop(seq_id, None)

    def kv_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's K and V buffers (tests and tools that inspect the pool)."""
        return self._k, self._v
