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

import torch

from hetero_sd.backends.onnx_batch import PoolAttention
from hetero_sd.backends.onnx_native import NativeAttention
from hetero_sd.backends.onnx_blocks import gated_mlp, last_rows, moe, rms_norm, rope, softcap, split
from hetero_sd.backends.onnx_weights import Builder, Linears, wide_blocks
from hetero_sd.ir.families.decoder import qkv_names, rope_cos_sin
from hetero_sd.ir.model import ModelIR

OPSET = 18
DATA_FILE = "weights.bin"


def _attention(b: Builder, q: str, k: str, v: str, mask: str, minus_inf: str, cap: float | None = None) -> str:
    """softmax(q k^T masked) v over the window: q [Hkv, G*T, D] (already
    scaled), k and v [Hkv, W, D] with the new rows in place, mask
    [1, G*T, W]; returns [Hkv, G*T, D]."""
    scores = softcap(b, b.op("MatMul", q, b.op("Transpose", k, perm=[0, 2, 1])), cap)
    probs = b.op("Softmax", b.op("Where", mask, scores, minus_inf), axis=-1)
    return b.op("MatMul", probs, v)


# how rows find their keys: one sequence's slab (OpenVINO), several sequences gathered
# from the pool (onnx_batch.py), or several read where they lie by our own op (onnx_native.py)
ATTENTION = ("slab", "pool", "native")


def build_llama_onnx(model: ModelIR, precision: str, path: Path | None = None, progress=None,
                     attention: str = "slab", native_matmul: bool = False,
                     pairs: bool | None = None) -> onnx.ModelProto:
    """The graph with weights in `precision` (onnx_weights.py). With `path`, the
    weights stream to `path.parent / weights.bin` one tensor at a time and the
    model is saved at `path`; without, they stay inside the returned proto.
    attention: how rows find their keys (ATTENTION); native_matmul: quantized linear
    layers by our BlockMatMul where it covers them (backends/native); pairs: how GGUFMatMul's
    weights are packed (native.gguf_pairs of the library that runs them; None: the default build's)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}: one of {ATTENTION}")
    model.check_weights()
    b = Builder(path.parent / DATA_FILE if path is not None else None)
    try:
        linear = Linears(b, model.weights, precision, wide=wide_blocks(model.config), native=native_matmul,
                         pairs=pairs)
        proto = _build(model, b, linear, progress, attention)
    finally:
        b.close()
    if path is not None:
        onnx.save_model(proto, str(path))
    model.weights.release_pages()  # every tensor was read once: the file's pages need not stay resident here
    return proto


def _rope_tables(b: Builder, cfg, q_pos: str, local: bool) -> tuple[str, str]:
    """cos and sin [1, 1, T, rope_dim] of the rows' positions, from a table of every position."""
    cos, sin = (t.numpy().astype(np.float32) for t in
                rope_cos_sin(cfg, torch.arange(cfg.max_position_embeddings), local))
    shape = b.const([1, 1, -1, cfg.rope_dim], dtype=np.int64)
    return tuple(b.op("Reshape", b.op("Gather", b.const(t, name), q_pos, axis=0), shape)
                 for t, name in ((cos, "cos"), (sin, "sin")))


def _build(model: ModelIR, b: Builder, linear: Linears, progress, attention: str) -> onnx.ModelProto:
    cfg = model.config
    weights = _FloatWeights(model)  # norms and biases: small, read as floats
    # How rows find their keys: one sequence's slab (below), several sequences
    # gathered from the whole pool (onnx_batch.py), or several read in place by our
    # op (onnx_native.py). Everything else is the same graph.
    kv = {"slab": SlabAttention, "pool": PoolAttention, "native": NativeAttention}[attention](b, cfg)
    ropes = {} if kv.takes_qkv else {
        local: _rope_tables(b, cfg, kv.q_pos, local) for local in {cfg.local_rope(i) for i in range(cfg.num_layers)}}
    new_kv = {"k": [], "v": []}  # per layer: [1, Hkv, T, D], stacked into the one new_kv output

    x = b.op("Gather", linear.embedding("model.embed_tokens.weight"), "input_ids", axis=0)
    if cfg.embed_scale is not None:
        x = b.op("Mul", x, b.const(np.float32(cfg.embed_scale)))
    captured = {}  # feature layer -> its output [T, hidden]
    for i in range(cfg.num_layers):
        if progress is not None:
            progress(i, cfg.num_layers, f"layer {i}")
        x = _layer(b, cfg, linear, weights, kv, ropes.get(cfg.local_rope(i)), new_kv, i, x)
        if i in cfg.feature_layers:
            captured[i] = x

    if not kv.takes_qkv:  # (the in-place op writes its own rows)
        stacked = [b.op("Concat", *new_kv[n], axis=0) for n in "kv"]  # [layers, Hkv, T, D]
        b.op("Concat", *[b.op("Unsqueeze", kv_, b.const([0], dtype=np.int64)) for kv_ in stacked], axis=0,
             out="new_kv")

    x = rms_norm(b, kv.logit_rows(x), weights["model.norm.weight"], cfg.rms_norm_eps)
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    if cfg.final_softcap is None:
        linear(x, [head], head=True, out="logits", rows=cfg.output_vocab)
    else:
        b.op("Identity", softcap(b, linear(x, [head], head=True, rows=cfg.output_vocab), cfg.final_softcap),
             out="logits")
    if cfg.feature_layers:
        b.op("Concat", *[captured[i] for i in cfg.feature_layers], axis=-1, out="features")
    return _make_model(b, cfg, kv)


def _layer(b: Builder, cfg, linear: Linears, weights, kv, rope_table, new_kv: dict, i: int, x: str) -> str:
    p = f"model.layers.{i}."
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    i64 = lambda *v: b.const(list(v), dtype=np.int64)  # noqa: E731
    norm = lambda v, name: rms_norm(b, v, weights[p + name], cfg.rms_norm_eps)  # noqa: E731
    h = norm(x, "input_layernorm.weight")
    # q, k and v (and below gate and up) as one wider matmul each: a third
    # fewer weight-layer calls, whose fixed cost dominates this small a
    # model; every output column still reduces over the same inputs.
    fused_bias = np.concatenate([weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]) \
        if cfg.attention_bias else None
    qkv = linear(h, qkv_names(cfg, p), fused_bias)
    if kv.takes_qkv:
        norms = [weights[p + f"self_attn.{n}_norm.weight"] for n in "qk"] if cfg.qk_norm else [None, None]
        return _mlp_half(b, cfg, linear, weights, i, x, kv.attend_qkv(i, qkv, *norms), fused_norms=True)
    q, k, v = split(b, qkv, [H * D, Hkv * D, Hkv * D])
    # q, k and v as [1, heads, T, D]: the layout OpenVINO's RoPE kernel
    # takes (transpose folded in) and the slab's, so new rows scatter as they are.
    q, k, v = (b.op("Transpose", b.op("Reshape", t, i64(1, -1, c, D)), perm=[0, 2, 1, 3])
               for t, c in ((q, H), (k, Hkv), (v, Hkv)))
    if cfg.qk_norm:
        q, k = norm(q, "self_attn.q_norm.weight"), norm(k, "self_attn.k_norm.weight")
    scale = b.const(np.float32(cfg.attention_scale))
    cos, sin = rope_table
    if cfg.uses_rope(i) and cfg.rope_dim == D:
        # q's rows carry the attention scale (q * (cos*s) + rot(q) * (sin*s)):
        # no multiply on the [Hkv, G*T, W] scores; exact where s is a power of two (D = 64, 256).
        q = rope(b, q, b.op("Mul", cos, scale), b.op("Mul", sin, scale), D, D)
        k = rope(b, k, cos, sin, D, D)
    else:
        if cfg.uses_rope(i):
            q, k = rope(b, q, cos, sin, cfg.rope_dim, D), rope(b, k, cos, sin, cfg.rope_dim, D)
        q = b.op("Mul", q, scale)
    new_kv["k"].append(k)
    new_kv["v"].append(v)
    return _mlp_half(b, cfg, linear, weights, i, x, kv.attend(i, q, k, v))  # attend -> [T, H*D]


def _mlp_half(b: Builder, cfg, linear: Linears, weights, i: int, x: str, att: str, fused_norms: bool = False
              ) -> str:
    """The layer from its attention's output [T, H*D] on: o_proj, residuals, norms, MLP."""
    p = f"model.layers.{i}."
    norm = lambda v, name: rms_norm(b, v, weights[p + name], cfg.rms_norm_eps)  # noqa: E731
    out = linear(att, [p + "self_attn.o_proj.weight"])
    if cfg.sandwich_norms:
        x = b.op("Add", x, norm(out, "post_attention_layernorm.weight"))
        h = norm(x, "pre_feedforward_layernorm.weight")
    elif fused_norms:  # the residual add and the norm as one op (onnxruntime's contrib op)
        h, summed = b.name("h"), b.name("x")
        b.nodes.append(helper.make_node(
            "SkipSimplifiedLayerNormalization", [x, out, b.const(weights[p + "post_attention_layernorm.weight"], "norm")],
            [h, "", "", summed], name=h, domain="com.microsoft", epsilon=float(cfg.rms_norm_eps)))
        x = summed
    else:
        x = b.op("Add", x, out)
        h = norm(x, "post_attention_layernorm.weight")
    out = moe(b, linear, cfg, h, p, weights[p + "mlp.gate.weight"]) if cfg.sparse(i) else gated_mlp(b, linear, cfg, h, p)
    if cfg.sandwich_norms:
        out = norm(out, "post_feedforward_layernorm.weight")
    return b.op("Add", x, out)


class SlabAttention:
    """One sequence: its slab's per-layer views are the past inputs."""

    takes_qkv = False  # attend() takes roped q and the new k/v
    domains: tuple[str, ...] = ()  # custom-op domains the graph imports (onnx_native.py)

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
        causal = b.op("LessOrEqual", k_row, q_col)  # [T, W]
        self.masks = {}  # window -> [1, G*T, W]: one per distinct layer window
        for window in cfg.windows:
            visible = causal if window is None else b.op(
                "And", causal, b.op("Less", b.op("Sub", q_col, k_row), b.const(np.int64(window))))
            self.masks[window] = b.op("Reshape", b.op("Expand", b.op("Unsqueeze", visible, i64(0)),
                                                      b.op("Concat", i64(G), T, W, axis=0)),
                                      i64(1, -1, 0), allowzero=0)
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
        att = _attention(b, q, k_all, v_all, self.masks[cfg.window(i)], self.minus_inf, cfg.attn_softcap)
        att = b.op("Reshape", att, i64(H, -1, D))
        return b.op("Reshape", b.op("Transpose", att, perm=[1, 0, 2]), i64(-1, H * D))

    def logit_rows(self, x: str) -> str:
        return last_rows(self.b, x, self.T, "num_logits")

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


def _make_model(b: Builder, cfg, kv) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    outputs = [helper.make_tensor_value_info("logits", f, ["N", cfg.logits_vocab])]
    if not kv.takes_qkv:
        outputs.append(helper.make_tensor_value_info("new_kv", f, [2, cfg.num_layers, cfg.num_kv_heads, "T",
                                                                   cfg.head_dim]))
    if cfg.feature_layers:
        outputs.append(helper.make_tensor_value_info("features", f, ["T", len(cfg.feature_layers) * cfg.hidden_size]))
    if kv.takes_qkv:
        outputs += kv.outputs()
    graph = helper.make_graph(b.nodes, "hetero_sd_llama", kv.inputs(), outputs, b.inits)
    domains = [helper.make_opsetid(d, 1) for d in sorted({*kv.domains, *b.domains})]  # custom ops' domains
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                   helper.make_opsetid("com.microsoft", 1), *domains],
                             producer_name="hetero-sd")
