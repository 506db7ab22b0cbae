"""Lower a Llama-family model IR to an ONNX graph (used by onnxruntime and OpenVINO).

Graph contract, designed for pre-allocated KV pools and batch invariance:
  inputs   input_ids int64 [T], past_len int64 [], num_logits int64 [],
           window int64 []: attention reads slots [0, window), past_len + T
           <= window <= R (the runner rounds it up to a block, so it changes
           every block of tokens, not every step),
           past_k_{i}, past_v_{i} float [1, kv_heads, R, head_dim] per layer:
           the sequence's whole reserved slab (R fixed per sequence), bound in
           place; positions >= past_len hold stale data and are masked.
  outputs  logits float [num_logits, vocab] (LM head only on those rows),
           new_kv float [2, layers, kv_heads, T, head_dim]: only the new
           positions' K and V, which the backend writes into its pool (it
           stays owner) with one strided copy: one output, not two per layer,
           keeps the per-step work outside the runtime to a few calls,
           features float [T, len(feature_layers) * hidden]: only when the
           model's config names feature layers, every row's residual stream
           after each of those layers (before the final norm), concatenated
           in their order; a graph without them has no such output.
Attention runs over the window's slots with the new keys placed at their
absolute positions, so every row reduces over the same values in the same
order whatever T is, the masked tail adding exact zeros: a k-token verify
rounds exactly like k one-token steps (tests prove it bitwise). The window,
not the reserved R, sets the cost: a request for 2k new tokens does not pay
for 2k slots from its first step.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from hetero_sd.backends.onnx_batch import PoolAttention
from hetero_sd.backends.onnx_weights import Builder, Linears
from hetero_sd.ir.families.llama import rope_inv_freq
from hetero_sd.ir.model import ModelIR

OPSET = 18
GRAPH_VERSION = 16  # part of the cache key: bump when the graph changes
DATA_FILE = "weights.bin"


def _rms_norm(b: Builder, x: str, weight: np.ndarray, eps: float) -> str:
    # The canonical Pow/ReduceMean/Add/Sqrt/Div/Mul chain: onnxruntime fuses
    # it into SimplifiedLayerNormalization and OpenVINO into its RMS kernel.
    mean = b.op("ReduceMean", b.op("Pow", x, b.const(np.float32(2.0))), b.const([-1], dtype=np.int64), keepdims=1)
    norm = b.op("Div", x, b.op("Sqrt", b.op("Add", mean, b.const(np.float32(eps)))))
    return b.op("Mul", norm, b.const(weight.astype(np.float32), "norm"))


def _rope(b: Builder, x: str, cos: str, sin: str, half: int) -> str:
    """x [1, heads, T, D] * cos + rotate_half(x) * sin, cos/sin [1, 1, T, D].
    Written as OpenVINO's GPT-NeoX RoPE pattern (rank 4, split on axis 3,
    the negation as a multiply by -1, exact) so its CPU plugin runs one RoPE
    kernel instead of six elementwise nodes."""
    lo, hi = b.name("lo"), b.name("hi")
    b.nodes.append(helper.make_node("Split", [x, b.const([half, half], dtype=np.int64)], [lo, hi], axis=3))
    rotated = b.op("Concat", b.op("Mul", hi, b.const(np.float32(-1.0))), lo, axis=-1)
    return b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))


def _attention(b: Builder, q: str, k: str, v: str, mask: str, minus_inf: str) -> str:
    """softmax(q k^T masked) v over the window: q [Hkv, G*T, D] (already
    scaled), k and v [Hkv, W, D] with the new rows in place, mask
    [1, G*T, W]; returns [Hkv, G*T, D]."""
    scores = b.op("MatMul", q, b.op("Transpose", k, perm=[0, 2, 1]))
    probs = b.op("Softmax", b.op("Where", mask, scores, minus_inf), axis=-1)
    return b.op("MatMul", probs, v)


def build_llama_onnx(model: ModelIR, precision: str, path: Path | None = None, progress=None,
                     batched: bool = False) -> onnx.ModelProto:
    """The graph with weights in `precision` (onnx_weights.py). With `path`, the
    weights stream to `path.parent / weights.bin` one tensor at a time and the
    model is saved at `path`; without, they stay inside the returned proto."""
    model.check_weights()
    b = Builder(path.parent / DATA_FILE if path is not None else None)
    try:
        proto = _build(model, b, Linears(b, model.weights, precision), progress, batched)
    finally:
        b.close()
    if path is not None:
        onnx.save_model(proto, str(path))
    model.weights.release_pages()  # every tensor was read once: the file's pages need not stay resident here
    return proto


def _build(model: ModelIR, b: Builder, linear: Linears, progress, batched: bool = False) -> onnx.ModelProto:
    cfg = model.config
    weights = _FloatWeights(model)  # norms and biases: small, read as floats
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    i64 = lambda *v: b.const(list(v), dtype=np.int64)  # noqa: E731
    # How rows find their keys: one sequence's slab (below), or several
    # sequences gathered from the whole pool (onnx_batch.py). Everything else
    # is the same graph, so a row rounds alike in both.
    kv = PoolAttention(b, cfg) if batched else SlabAttention(b, cfg)

    inv = rope_inv_freq(cfg).numpy().astype(np.float32)
    angles = np.arange(cfg.max_position_embeddings, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = (b.op("Reshape", b.op("Gather", b.const(f(emb).astype(np.float32), f.__name__), kv.q_pos, axis=0),
                     i64(1, 1, -1, D)) for f in (np.cos, np.sin))  # [1, 1, T, D]
    # q's rows carry the 1/sqrt(D) attention scale (q * (cos*s) + rot(q) * (sin*s)):
    # one multiply per graph instead of one per layer, and none on the
    # [Hkv, G*T, W] scores; exact where s is a power of two (D = 64, 256).
    scale = b.const(np.float32(1.0 / np.sqrt(D)))
    cos_q, sin_q = b.op("Mul", cos, scale), b.op("Mul", sin, scale)
    new_kv = {"k": [], "v": []}  # per layer: [1, Hkv, T, D], stacked into the one new_kv output

    x = b.op("Gather", linear.embedding("model.embed_tokens.weight"), "input_ids", axis=0)
    captured = {}  # feature layer -> its output [T, hidden]
    for i in range(cfg.num_layers):
        if progress is not None:
            progress(i, cfg.num_layers, f"layer {i}")
        p = f"model.layers.{i}."
        bias = (lambda n: weights[p + f"self_attn.{n}_proj.bias"]) if cfg.attention_bias else (lambda n: None)
        h = _rms_norm(b, x, weights[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        # q, k and v (and below gate and up) as one wider matmul each: a third
        # fewer weight-layer calls, whose fixed cost dominates this small a
        # model; every output column still reduces over the same inputs.
        qkv = (("q", H), ("k", Hkv), ("v", Hkv))
        fused_bias = np.concatenate([bias(n) for n, _ in qkv]) if cfg.attention_bias else None
        y = linear(h, [p + f"self_attn.{n}_proj.weight" for n, _ in qkv], fused_bias)
        parts = [b.name(n) for n, _ in qkv]
        b.nodes.append(helper.make_node("Split", [y, b.const([c * D for _, c in qkv], dtype=np.int64)], parts,
                                        axis=-1))
        # q, k and v as [1, heads, T, D]: the layout OpenVINO's RoPE kernel
        # takes (transpose folded in) and the slab's, so new rows scatter as they are.
        heads = {n: b.op("Transpose", b.op("Reshape", part, i64(1, -1, c, D)), perm=[0, 2, 1, 3])
                 for (n, c), part in zip(qkv[:2], parts[:2])}
        new_kv["k"].append(_rope(b, heads["k"], cos, sin, D // 2))
        new_kv["v"].append(b.op("Transpose", b.op("Reshape", parts[2], i64(1, -1, Hkv, D)), perm=[0, 2, 1, 3]))
        q = _rope(b, heads["q"], cos_q, sin_q, D // 2)
        att = kv.attend(i, q, new_kv["k"][-1], new_kv["v"][-1])  # [T, H*D]
        x = b.op("Add", x, linear(att, [p + "self_attn.o_proj.weight"]))
        h = _rms_norm(b, x, weights[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        inter = cfg.intermediate_size
        gate_up = linear(h, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        gate, up = b.name("gate"), b.name("up")
        b.nodes.append(helper.make_node("Split", [gate_up, b.const([inter, inter], dtype=np.int64)], [gate, up],
                                        axis=-1))
        gate = b.op("Mul", gate, b.op("Sigmoid", gate))
        x = b.op("Add", x, linear(b.op("Mul", gate, up), [p + "mlp.down_proj.weight"]))
        if i in cfg.feature_layers:
            captured[i] = x

    stacked = [b.op("Concat", *new_kv[n], axis=0) for n in "kv"]  # [layers, Hkv, T, D]
    b.op("Concat", *[b.op("Unsqueeze", kv_, i64(0)) for kv_ in stacked], axis=0, out="new_kv")

    x = _rms_norm(b, kv.logit_rows(x), weights["model.norm.weight"], cfg.rms_norm_eps)
    linear(x, ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"], head=True,
           out="logits", rows=cfg.output_vocab)
    if cfg.feature_layers:
        b.op("Concat", *[captured[i] for i in cfg.feature_layers], axis=-1, out="features")
    return _make_model(b, cfg, kv.inputs())


class SlabAttention:
    """One sequence: its slab's per-layer views are the past inputs."""

    def __init__(self, b: Builder, cfg):
        self.b, self.cfg = b, cfg
        i64 = self._i64
        Hkv, D, G = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
        self.T = T = b.op("Shape", "input_ids")
        W = b.op("Reshape", "window", i64(1))
        self.W = W
        self.q_pos = q_pos = b.op("Add", b.op("Range", b.const(np.int64(0)), b.op("Squeeze", T),
                                              b.const(np.int64(1))), "past_len")
        k_idx = b.op("Range", b.const(np.int64(0)), "window", b.const(np.int64(1)))
        q_col, k_row = b.op("Unsqueeze", q_pos, i64(1)), b.op("Unsqueeze", k_idx, i64(0))
        visible = b.op("LessOrEqual", k_row, q_col)  # [T, W]
        if cfg.sliding_window:
            visible = b.op("And", visible, b.op("Less", b.op("Sub", q_col, k_row),
                                                b.const(np.int64(cfg.sliding_window))))
        self.mask = b.op("Reshape", b.op("Expand", b.op("Unsqueeze", visible, i64(0)),
                                         b.op("Concat", i64(G), T, W, axis=0)),
                         i64(1, -1, 0), allowzero=0)  # [1, G*T, W]
        # New keys land at their absolute slots past_len .. past_len + T - 1 of a
        # copy of the window (ScatterElements along the position axis: a copy and
        # T writes, where selecting over all slots read three window-long tensors).
        self.slots = b.op("Expand", b.op("Reshape", q_pos, i64(1, 1, -1, 1)), i64(1, Hkv, 1, D))  # [1, Hkv, T, D]
        self.minus_inf = b.const(np.float32(-np.inf))

    def _i64(self, *v):
        return self.b.const(list(v), dtype=np.int64)

    def attend(self, i: int, q: str, k_new: str, v_new: str) -> str:
        """q [1, H, T, D] (roped, scaled), the layer's new k/v [1, Hkv, T, D] -> [T, H*D]."""
        b, cfg, i64 = self.b, self.cfg, self._i64
        Hkv, H, D = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
        k_all, v_all = (b.op("Reshape", b.op("ScatterElements", b.op("Slice", f"past_{n}_{i}", i64(0), self.W, i64(2)),
                                             self.slots, new, axis=2), i64(Hkv, -1, D))
                        for n, new in (("k", k_new), ("v", v_new)))
        q = b.op("Reshape", q, i64(Hkv, -1, D))  # grouped by kv head
        att = b.op("Reshape", _attention(b, q, k_all, v_all, self.mask, self.minus_inf), i64(H, -1, D))
        return b.op("Reshape", b.op("Transpose", att, perm=[1, 0, 2]), i64(-1, H * D))

    def logit_rows(self, x: str) -> str:
        b, i64 = self.b, self._i64
        start = b.op("Sub", self.T, b.op("Reshape", "num_logits", i64(1)))
        return b.op("Slice", x, start, b.op("Reshape", b.op("Squeeze", self.T), i64(1)), i64(0))

    def inputs(self) -> list:
        cfg = self.cfg
        kv = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT,  # noqa: E731
                                                     [1, cfg.num_kv_heads, "R", cfg.head_dim])
        out = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["T"]),
               helper.make_tensor_value_info("past_len", TensorProto.INT64, []),
               helper.make_tensor_value_info("window", TensorProto.INT64, []),
               helper.make_tensor_value_info("num_logits", TensorProto.INT64, [])]
        for i in range(cfg.num_layers):
            out += [kv(f"past_k_{i}"), kv(f"past_v_{i}")]
        return out


class _FloatWeights:
    """Name -> float32 array, read when asked (the whole model never sits in memory)."""

    def __init__(self, model: ModelIR):
        self._source = model.weights

    def __getitem__(self, name: str) -> np.ndarray:
        return self._source.get(name).numpy()


def _make_model(b: Builder, cfg, inputs: list) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    outputs = [helper.make_tensor_value_info("logits", f, ["N", cfg.logits_vocab]),
               helper.make_tensor_value_info("new_kv", f, [2, cfg.num_layers, cfg.num_kv_heads, "T", cfg.head_dim])]
    if cfg.feature_layers:
        outputs.append(helper.make_tensor_value_info("features", f, ["T", len(cfg.feature_layers) * cfg.hidden_size]))
    graph = helper.make_graph(b.nodes, "hetero_sd_llama", inputs, outputs, b.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                   helper.make_opsetid("com.microsoft", 1)],
                             producer_name="hetero-sd")
