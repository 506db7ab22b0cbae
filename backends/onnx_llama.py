"""Lower a Llama-family model IR to an ONNX graph (used by onnxruntime and OpenVINO).

Graph contract, designed for pre-allocated KV pools and batch invariance:
  inputs   input_ids int64 [T], past_len int64 [], num_logits int64 [],
           past_k_{i}, past_v_{i} float [kv_heads, R, head_dim] per layer:
           the sequence's whole reserved slab (R fixed per sequence), bound in
           place; positions >= past_len hold stale data and are masked.
  outputs  logits float [num_logits, vocab] (LM head only on those rows),
           new_kv float [2, layers, kv_heads, T, head_dim]: only the new
           positions' K and V, which the backend writes into its pool (it
           stays owner) with one strided copy: one output, not two per layer,
           keeps the per-step work outside the runtime to a few calls.
Attention runs over all R slots with the new keys placed at their absolute
positions, so every row reduces over the same R values in the same order
whatever T is: a k-token verify rounds exactly like k one-token steps.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from hetero_sd.ir.families.llama import rope_inv_freq
from hetero_sd.ir.model import ModelIR

OPSET = 18
GRAPH_VERSION = 8  # part of the cache key: bump when the graph changes


class _Builder:
    def __init__(self):
        self.nodes, self.inits, self._n = [], [], 0

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value, hint="c", dtype=None) -> str:
        arr = np.asarray(value, dtype=dtype)
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        out = out or self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out


def _rms_norm(b: _Builder, x: str, weight: np.ndarray, eps: float) -> str:
    # The canonical Pow/ReduceMean/Add/Sqrt/Div/Mul chain: onnxruntime fuses
    # it into SimplifiedLayerNormalization and OpenVINO into its RMS kernel.
    mean = b.op("ReduceMean", b.op("Pow", x, b.const(np.float32(2.0))), b.const([-1], dtype=np.int64), keepdims=1)
    norm = b.op("Div", x, b.op("Sqrt", b.op("Add", mean, b.const(np.float32(eps)))))
    return b.op("Mul", norm, b.const(weight.astype(np.float32), "norm"))


def _linear(b: _Builder, x: str, weight: np.ndarray, bias: np.ndarray | None = None) -> str:
    y = b.op("MatMul", x, b.const(np.ascontiguousarray(weight.T, dtype=np.float32), "w"))
    return b.op("Add", y, b.const(bias.astype(np.float32), "b")) if bias is not None else y


def _rope(b: _Builder, x: str, cos: str, sin: str, half: int) -> str:
    lo, hi = b.name("lo"), b.name("hi")
    b.nodes.append(helper.make_node("Split", [x, b.const([half, half], dtype=np.int64)], [lo, hi], axis=-1))
    rotated = b.op("Concat", b.op("Neg", hi), lo, axis=-1)
    return b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))


def build_llama_onnx(model: ModelIR, progress=None) -> onnx.ModelProto:
    cfg = model.config
    weights = {n: t.numpy() for n, t in model.iter_weights(progress)}
    b = _Builder()
    H, Hkv, D, G = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    i64 = lambda *v: b.const(list(v), dtype=np.int64)  # noqa: E731

    # Positions, RoPE rows, and the [T, R] visibility mask shared by all layers.
    T = b.op("Shape", "input_ids")
    R = b.op("Gather", b.op("Shape", "past_k_0"), i64(1), axis=0)
    q_pos = b.op("Add", b.op("Range", b.const(np.int64(0)), b.op("Squeeze", T), b.const(np.int64(1))), "past_len")
    k_idx = b.op("Range", b.const(np.int64(0)), b.op("Squeeze", R), b.const(np.int64(1)))
    inv = rope_inv_freq(cfg).numpy().astype(np.float32)
    angles = np.arange(cfg.max_position_embeddings, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    cos = b.op("Gather", b.const(np.cos(emb).astype(np.float32), "cos"), q_pos, axis=0)  # [T, D]
    sin = b.op("Gather", b.const(np.sin(emb).astype(np.float32), "sin"), q_pos, axis=0)
    q_col, k_row = b.op("Unsqueeze", q_pos, i64(1)), b.op("Unsqueeze", k_idx, i64(0))
    visible = b.op("LessOrEqual", k_row, q_col)  # [T, R]
    if cfg.sliding_window:
        visible = b.op("And", visible, b.op("Less", b.op("Sub", q_col, k_row), b.const(np.int64(cfg.sliding_window))))
    visible = b.op("Reshape", b.op("Expand", b.op("Unsqueeze", visible, i64(0)),
                                   b.op("Concat", i64(G), T, R, axis=0)), i64(1, -1, 0), allowzero=0)
    # New keys land at their absolute slots past_len .. past_len + T - 1 of a
    # copy of the slab (ScatterElements along the position axis: a copy and T
    # writes, where selecting over all R slots read three R-long tensors).
    slots = b.op("Expand", b.op("Reshape", q_pos, i64(1, -1, 1)), i64(Hkv, 1, D))  # [Hkv, T, D]
    minus_inf = b.const(np.float32(-np.inf))
    scale = b.const(np.float32(1.0 / np.sqrt(D)))

    x = b.op("Gather", b.const(weights["model.embed_tokens.weight"], "embed"), "input_ids", axis=0)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        bias = (lambda n: weights[p + f"self_attn.{n}_proj.bias"]) if cfg.attention_bias else (lambda n: None)
        h = _rms_norm(b, x, weights[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        # q, k and v (and below gate and up) as one wider matmul each: a third
        # fewer weight-layer calls, whose fixed cost dominates this small a
        # model; every output column still reduces over the same inputs.
        qkv = (("q", H), ("k", Hkv), ("v", Hkv))
        fused_bias = np.concatenate([bias(n) for n, _ in qkv]) if cfg.attention_bias else None
        y = _linear(b, h, np.concatenate([weights[p + f"self_attn.{n}_proj.weight"] for n, _ in qkv]), fused_bias)
        parts = [b.name(n) for n, _ in qkv]
        b.nodes.append(helper.make_node("Split", [y, b.const([c * D for _, c in qkv], dtype=np.int64)], parts,
                                        axis=-1))
        heads = {n: b.op("Transpose", b.op("Reshape", part, i64(-1, c, D)), perm=[1, 0, 2])
                 for (n, c), part in zip(qkv, parts)}
        q = _rope(b, heads["q"], cos, sin, D // 2)
        b.op("Identity", _rope(b, heads["k"], cos, sin, D // 2), out=f"new_k_{i}")
        b.op("Identity", heads["v"], out=f"new_v_{i}")
        k_all = b.op("ScatterElements", f"past_k_{i}", slots, f"new_k_{i}", axis=1)
        v_all = b.op("ScatterElements", f"past_v_{i}", slots, f"new_v_{i}", axis=1)
        # The 1/sqrt(D) scale on q ([H, T, D]), not on the [Hkv, G*T, R] scores:
        # R/D times fewer multiplies, and for a power-of-two D it is exact.
        q = b.op("Reshape", b.op("Mul", q, scale), i64(Hkv, -1, D))  # [Hkv, G*T, D]: q heads grouped by kv head
        scores = b.op("MatMul", q, b.op("Transpose", k_all, perm=[0, 2, 1]))
        probs = b.op("Softmax", b.op("Where", visible, scores, minus_inf), axis=-1)
        att = b.op("Reshape", b.op("MatMul", probs, v_all), i64(H, -1, D))
        att = b.op("Reshape", b.op("Transpose", att, perm=[1, 0, 2]), i64(-1, H * D))
        x = b.op("Add", x, _linear(b, att, weights[p + "self_attn.o_proj.weight"]))
        h = _rms_norm(b, x, weights[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        inter = weights[p + "mlp.gate_proj.weight"].shape[0]
        gate_up = _linear(b, h, np.concatenate([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]))
        gate, up = b.name("gate"), b.name("up")
        b.nodes.append(helper.make_node("Split", [gate_up, b.const([inter, inter], dtype=np.int64)], [gate, up],
                                        axis=-1))
        gate = b.op("Mul", gate, b.op("Sigmoid", gate))
        x = b.op("Add", x, _linear(b, b.op("Mul", gate, up), weights[p + "mlp.down_proj.weight"]))

    layers = range(cfg.num_layers)
    stacked = [b.op("Concat", *[b.op("Unsqueeze", f"new_{n}_{i}", i64(0)) for i in layers], axis=0) for n in "kv"]
    b.op("Concat", *[b.op("Unsqueeze", kv, i64(0)) for kv in stacked], axis=0, out="new_kv")

    start = b.op("Sub", T, b.op("Reshape", "num_logits", i64(1)))
    x = b.op("Slice", x, start, b.op("Reshape", b.op("Squeeze", T), i64(1)), i64(0))
    x = _rms_norm(b, x, weights["model.norm.weight"], cfg.rms_norm_eps)
    head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    _linear_out = b.op("MatMul", x, b.const(np.ascontiguousarray(head.T), "lm_head"), out="logits")
    del _linear_out
    return _make_model(b, cfg)


def _make_model(b: _Builder, cfg) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    kv = lambda n, length: helper.make_tensor_value_info(n, f, [cfg.num_kv_heads, length, cfg.head_dim])  # noqa
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["T"]),
              helper.make_tensor_value_info("past_len", TensorProto.INT64, []),
              helper.make_tensor_value_info("num_logits", TensorProto.INT64, [])]
    outputs = [helper.make_tensor_value_info("logits", f, ["N", cfg.vocab_size]),
               helper.make_tensor_value_info("new_kv", f, [2, cfg.num_layers, cfg.num_kv_heads, "T", cfg.head_dim])]
    for i in range(cfg.num_layers):
        inputs += [kv(f"past_k_{i}", "R"), kv(f"past_v_{i}", "R")]
    graph = helper.make_graph(b.nodes, "hetero_sd_llama", inputs, outputs, b.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                             producer_name="hetero-sd")
