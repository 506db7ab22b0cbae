"""A runner for graph runtimes (onnxruntime, OpenVINO) that follow the
`onnx_llama` contract: the backend owns a numpy KV pool; each sequence is one
contiguous slab [2, layers, kv_heads, reserved, head_dim] bound in place as
the graph's past inputs; the graph returns only the new positions' K/V (one
stacked output), which are written into the slab. Rollback is the allocator's length."""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Sequence

import numpy as np

from hetero_sd.backends.base import BatchItem, DeviceInfo, PrecisionInfo
from hetero_sd.backends.options import DEFAULT as DEFAULT_OPTIONS, BackendOptions
from hetero_sd.backends.pool import ExtentAllocator, PooledRunner
from hetero_sd.backends.row_check import CHECK_VERSION, Verdict, cached_verdict, host_signature, padded, settle
from hetero_sd.ir.cache import cache_dir
from hetero_sd.ir.errors import BackendError, KVBudgetError
from hetero_sd.ir.model import ModelIR


DRAFT_ROWS = "one-token calls unpadded: a draft's rows need not round as in a verify (draft_only)"


class GraphRunner(PooledRunner):
    """Subclasses implement `_infer(feeds, past) -> (logits, new_kv[, features])`:
    feeds are the small per-step inputs, past the sequence's per-layer slab
    views, the same dict object on every call for a sequence (a runtime that
    binds buffers once can tell by identity that nothing moved). The graph has
    the `features` output only when the model names feature layers."""

    WINDOW_BLOCK = 32  # attention windows grow in steps of this many slots

    def __init__(self, model: ModelIR, info: DeviceInfo, precision: PrecisionInfo, kv_budget_bytes: int,
                 pad_single_row: bool = False, options: BackendOptions = DEFAULT_OPTIONS):
        cfg = model.config
        self.options = options
        self.device, self.precision = info, precision
        self.vocab_size, self.max_context = cfg.logits_vocab, cfg.max_position_embeddings
        self._layers = cfg.num_layers
        self._per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # float32 elements
        capacity = min(kv_budget_bytes // (4 * self._per_pos), 1 << 22)
        if capacity < 1:
            raise BackendError(f"memory.kv_budget of {kv_budget_bytes} bytes holds no position")
        self._alloc = ExtentAllocator(capacity, 4 * self._per_pos,
                                      f"{info.backend}:{info.device} {precision.name} pool")
        # zeros, not empty: masked slots are multiplied by 0 in attention and
        # must never hold NaN; calloc'd pages still cost nothing until touched.
        self._pool = np.zeros(capacity * self._per_pos, dtype=np.float32)
        self._kv_shape = (2, cfg.num_layers, cfg.num_kv_heads, None, cfg.head_dim)
        self._kv_heads, self._head_dim = cfg.num_kv_heads, cfg.head_dim
        self._slabs: dict[int, np.ndarray] = {}
        self._past: dict[int, dict[str, np.ndarray]] = {}  # seq -> its slab's per-layer views
        # Quantised-weight kernels may take a path for one row, or for an odd call's
        # last row, that rounds apart from their main one (measured on some hosts);
        # such calls then run one row longer (the last token again, a discarded row)
        # so decode and verify share one kernel. Padded ("pairs", exact wherever any
        # padding is) until settle_padding() finds, by a bitwise check on this host
        # (row_check.py), the cheapest padding that is exact.
        self._checks_rows = pad_single_row
        self._padding = "pairs" if pad_single_row else "none"
        self._drafting = False  # draft_only() was said: a draft never pads (its rows are proposals)
        self._padding_note = ""  # what kernel_choice says of the padding
        self._graph_note = ""  # what kernel_choice says of the graph's kernels (a subclass's)
        self._model = model
        self.feature_layers = cfg.feature_layers  # (): the graph has no features output
        self._features: dict[int, np.ndarray] = {}

    pads_single_row = property(lambda self: padded(self._padding, 1))

    @property
    def kernel_choice(self) -> str:
        """The graph's kernels, then its padding, each rendered from its own note."""
        return "; ".join(note for note in (self._graph_note, self._padding_note) if note)

    padding = property(lambda self: self._padding)  # row_check.PADDINGS: how calls are padded here

    def settle_padding(self, graph: Path, runtime: str) -> None:
        """Decide how calls are padded, once the runtime can run: by the row check's
        verdict for this host, runtime and lowered graph (row_check.py)."""
        if not self._checks_rows:  # float kernels: exact without it (tested)
            return
        if self._drafting:  # a graph reloaded after draft_only(): no check needed
            self._padding, self._padding_note = "none", DRAFT_ROWS
            return
        folder = self._row_check_folder(graph, runtime)
        self._padding = "none"  # the check pads the calls itself
        try:
            verdict = settle(self, folder, self._label(), self.options.forced_padding)
        finally:
            self._padding = "pairs"
        self._padding = verdict.padding
        self._padding_note = verdict.describe()

    def _label(self) -> str:
        """The model and placement, as cached checks and choices name them (hetero-sd devices)."""
        return f"{self._model.source.name} {self.device.backend}:{self.device.device} {self.precision.name}"

    def _row_check_folder(self, graph: Path, runtime: str) -> Path:
        return cache_dir("row-check", self._model.source, check=CHECK_VERSION, host=host_signature(),
                         runtime=runtime, graph=str(graph), precision=self.precision.name)

    def cached_padding(self, graph: Path, runtime: str) -> Verdict | None:
        """The row check's verdict for `graph` here without running it (forced, or cached by
        an earlier load on this host); None where only a check can tell."""
        if not self._checks_rows:
            return Verdict("none", "not needed")
        return cached_verdict(self._row_check_folder(graph, runtime), self.options.forced_padding)

    def draft_only(self) -> None:
        """A drafter's runner (backends/base.py): one-token calls run unpadded, at the
        one-row kernel's speed (0.8x the padded call for SmolLM2 int4 on an AVX2 host),
        whatever the row check found: the target verifies every proposal, and a sampled
        draft's q is its own call's, so a draft row need not round as in a verify."""
        self._drafting = True
        if self._padding != "none":
            self._padding = "none"
            self._padding_note = DRAFT_ROWS

    def take_features(self, seq_id: int) -> np.ndarray | None:
        """The feature layers' hidden states [T, len(layers) * hidden] of the
        sequence's latest call (backends/base.py), then forgotten."""
        return self._features.pop(seq_id, None)

    def allocate(self, capacity: int) -> int:
        # A slab of whole blocks lets every attention window be a whole number
        # of blocks (OpenVINO's kernels round a row alike only for such
        # lengths, measured); where the budget cannot spare the rounding, the
        # exact slab is read whole on every call.
        block = self.WINDOW_BLOCK
        try:
            seq = self._alloc.allocate(_round_up(capacity, block))
        except KVBudgetError:
            seq = self._alloc.allocate(capacity)
        ext = self._alloc.extent(seq)
        capacity = ext.reserved
        flat = self._pool[ext.offset * self._per_pos:(ext.offset + capacity) * self._per_pos]
        shape = list(self._kv_shape)
        shape[3] = capacity
        slab = self._slabs[seq] = flat.reshape(shape)
        self._past[seq] = {f"past_{n}_{i}": slab[j, i][None] for j, n in enumerate("kv") for i in range(self._layers)}
        return seq

    def _infer(self, feeds: dict, past: dict) -> tuple[np.ndarray, ...]:
        raise NotImplementedError

    def forward(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> np.ndarray:
        n = len(tokens)
        self._features.pop(seq_id, None)
        with self._alloc.writing(seq_id, start, n):
            return self._run(seq_id, tokens, start, num_logits)

    def _run(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> np.ndarray:
        slab = self._slabs[seq_id]
        n = len(tokens)
        # (the discarded row needs a slot of its own in the slab)
        pad = padded(self._padding, n) and start + n < slab.shape[3]
        ids = list(tokens) + list(tokens[-1:]) if pad else tokens
        feeds = {"input_ids": np.asarray(ids, dtype=np.int64),
                 "past_len": np.asarray(start, dtype=np.int64),
                 "window": np.asarray(self._window(start + len(ids), slab.shape[3]), dtype=np.int64),
                 "num_logits": np.asarray(num_logits + pad, dtype=np.int64)}
        outs = self._infer(feeds, self._past[seq_id])
        logits, new_kv = outs[0], outs[1]
        slab[:, :, :, start:start + n] = new_kv[:, :, :, :n]
        if self.feature_layers:
            self._features[seq_id] = np.array(outs[2][:n])  # a copy, as the logits
        return np.array(logits[:num_logits])  # a copy: runtimes may reuse output buffers

    def _window(self, end: int, reserved: int) -> int:
        """Slots attention reads: the live length rounded up to a block (the
        runtime's shapes then change once a block, not every step); a slab
        that is not whole blocks is always read whole."""
        block = self.WINDOW_BLOCK
        return reserved if reserved % block else min(reserved, _round_up(end, block))

    max_batch = 1  # sequences per forward_batch call: a runtime with a batched graph raises it

    def _infer_batch(self, feeds: dict) -> tuple[np.ndarray, ...]:
        raise NotImplementedError

    def forward_batch(self, items: Sequence[BatchItem]) -> list[np.ndarray]:
        """Several sequences in one call of a batched graph (onnx_batch.py, onnx_native.py):
        every row rounds as it would in its sequence's own forward."""
        rows = [(list(it.tokens), list(range(it.start, it.start + len(it.tokens))), it.num_logits)
                for it in items]
        if padded(self._padding, sum(len(r[0]) for r in rows)):
            # the call's width would take the kernel's other path: the last row again
            # (its K/V as the row's own, or in the slot past it), its logits dropped
            tokens, positions, computed = rows[-1]
            rows[-1] = (tokens + tokens[-1:], positions + positions[-1:], computed + 1)
        for it in items:
            self._features.pop(it.seq_id, None)
        with ExitStack() as stack:
            for it in items:
                stack.enter_context(self._alloc.writing(it.seq_id, it.start, len(it.tokens)))
            logits, features, offsets = self._call_batch(items, rows)
        out, row = [], 0
        for it, (_, _, computed), off in zip(items, rows, offsets):
            out.append(np.array(logits[row:row + it.num_logits]))  # a copy: runtimes reuse output buffers
            row += computed
            if features is not None:
                self._features[it.seq_id] = np.array(features[off:off + len(it.tokens)])
        return out

    def _call_batch(self, items: Sequence[BatchItem], rows: list[tuple]) -> tuple:
        """Run the pool-gathering graph: (logits of the rows asked, features or None,
        each item's first packed row); the new K/V written into the slabs."""
        feeds, offsets = self._batch_feeds(items, rows)
        outs = self._infer_batch(feeds)
        new_kv = outs[1]
        for it, off in zip(items, offsets):
            n = len(it.tokens)
            self._slabs[it.seq_id][:, :, :, it.start:it.start + n] = new_kv[:, :, :, off:off + n]
        return outs[0], (outs[2] if self.feature_layers else None), offsets

    def _batch_feeds(self, items: Sequence[BatchItem], rows: list[tuple]) -> tuple[dict, list[int]]:
        """The batched graph's inputs; rows: (tokens, positions, logits computed) per item."""
        n = np.array([len(r[0]) for r in rows], dtype=np.int64)
        logits = np.array([r[2] for r in rows], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(n)[:-1]])
        positions = np.concatenate([np.asarray(r[1], dtype=np.int64) for r in rows])
        tmax = int(n.max())
        t = np.minimum(np.arange(tmax)[None, :], n[:, None] - 1)  # padding repeats the last row
        pad_rows = offsets[:, None] + t
        exts = [self._alloc.extent(it.seq_id) for it in items]
        reserved = np.array([e.reserved for e in exts], dtype=np.int64)[:, None, None]
        base = np.array([e.offset * self._per_pos // self._head_dim for e in exts], dtype=np.int64)[:, None, None]
        window = min(_round_up(int(positions.max()) + 1, self.WINDOW_BLOCK), int(reserved.max()))
        slot = np.minimum(np.arange(window)[None, None, :], reserved - 1)  # past a slab's end: masked
        heads = np.arange(self._kv_heads, dtype=np.int64)[None, :, None]
        feeds = {"input_ids": np.fromiter((tok for r in rows for tok in r[0]), np.int64, int(n.sum())),
                 "positions": positions,
                 "pool": self._pool.reshape(-1, self._head_dim),
                 "kv_index": base + heads * reserved + slot,
                 "kv_stride": self._kv_heads * reserved,
                 "pad_rows": pad_rows.ravel(),
                 "q_pos_pad": positions[pad_rows],
                 "unpad_rows": np.concatenate([b * tmax + np.arange(k) for b, k in enumerate(n)]),
                 "logit_rows": np.concatenate([o + k - m + np.arange(m) for o, k, m in zip(offsets, n, logits)])}
        return feeds, offsets.tolist()

    def greedy(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> list[int]:
        return self.forward(seq_id, tokens, start, num_logits).argmax(-1).tolist()

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._slabs.pop(seq_id, None)
        self._past.pop(seq_id, None)
        self._features.pop(seq_id, None)

    def kv_buffers(self) -> tuple[np.ndarray]:
        """The pool's memory (for tests that prove rollback moves no data)."""
        return (self._pool,)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block
