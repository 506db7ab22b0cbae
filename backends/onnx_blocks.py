"""The pieces of a decoder layer as ONNX nodes (onnx_llama.py assembles them):
RMSNorm, RoPE, the gated MLP and the mixture-of-experts block, each computing
what the IR's reference forward does (ir/families/forward.py)."""
from __future__ import annotations

import numpy as np
from onnx import helper

from hetero_sd.ir.families.decoder import down_name, gate_up_names


def rms_norm(b, x: str, weight: np.ndarray, eps: float) -> str:
    # The canonical Pow/ReduceMean/Add/Sqrt/Div/Mul chain: onnxruntime fuses
    # it into SimplifiedLayerNormalization and OpenVINO into its RMS kernel.
    mean = b.op("ReduceMean", b.op("Pow", x, b.const(np.float32(2.0))), b.const([-1], dtype=np.int64), keepdims=1)
    norm = b.op("Div", x, b.op("Sqrt", b.op("Add", mean, b.const(np.float32(eps)))))
    return b.op("Mul", norm, b.const(weight.astype(np.float32), "norm"))


def split(b, x: str, sizes: list[int], axis: int = -1) -> list[str]:
    outs = [b.name("part") for _ in sizes]
    b.nodes.append(helper.make_node("Split", [x, b.const(sizes, dtype=np.int64)], outs, axis=axis))
    return outs


def last_rows(b, x: str, T: str, count: str) -> str:
    """Rows [T - count, T) of x: T the shape [1] of the call's rows, count an int64 scalar input."""
    one = b.const([1], dtype=np.int64)
    start = b.op("Sub", T, b.op("Reshape", count, one))
    return b.op("Slice", x, start, b.op("Reshape", b.op("Squeeze", T), one), b.const([0], dtype=np.int64))


def rope(b, x: str, cos: str, sin: str, rot: int, head_dim: int) -> str:
    """x [1, heads, T, D] * cos + rotate_half(x) * sin on its first `rot`
    values, cos/sin [1, 1, T, rot]. Written as OpenVINO's GPT-NeoX RoPE pattern
    (rank 4, split on axis 3, the negation as a multiply by -1, exact) so its
    CPU plugin runs one RoPE kernel instead of six elementwise nodes."""
    rest = None
    if rot != head_dim:
        x, rest = split(b, x, [rot, head_dim - rot], axis=3)
    lo, hi = split(b, x, [rot // 2, rot // 2], axis=3)
    rotated = b.op("Concat", b.op("Mul", hi, b.const(np.float32(-1.0))), lo, axis=-1)
    out = b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))
    return out if rest is None else b.op("Concat", out, rest, axis=-1)


def softcap(b, x: str, cap: float | None) -> str:
    if cap is None:
        return x
    return b.op("Mul", b.op("Tanh", b.op("Div", x, b.const(np.float32(cap)))), b.const(np.float32(cap)))


def _activation(b, x: str, kind: str) -> str:
    if kind == "silu":
        return b.op("Mul", x, b.op("Sigmoid", x))
    # GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as torch's approximate="tanh"
    f = lambda v: b.const(np.float32(v))  # noqa: E731
    inner = b.op("Mul", f(np.sqrt(2.0 / np.pi)), b.op("Add", x, b.op("Mul", f(0.044715), b.op("Mul", x, b.op("Mul", x, x)))))
    return b.op("Mul", b.op("Mul", f(0.5), x), b.op("Add", f(1.0), b.op("Tanh", inner)))


def gated_mlp(b, linear, cfg, h: str, p: str, expert: int | None = None) -> str:
    """down(act(gate(h)) * up(h)); gate and up as one wider matmul."""
    width = cfg.moe.intermediate_size if expert is not None else cfg.intermediate_size
    names = gate_up_names(p, cfg, expert)
    fused = linear.gated(h, names, cfg.hidden_act)  # (one op where the lowering has one)
    if fused is not None:
        return linear(fused, [down_name(p, expert)])
    gate, up = split(b, linear(h, names), [width, width])
    return linear(b.op("Mul", _activation(b, gate, cfg.hidden_act), up), [down_name(p, expert)])


def moe(b, linear, cfg, h: str, p: str, router: np.ndarray) -> str:
    """Every expert on every row, each row's output the sum of its chosen
    experts' in expert-index order, weighted by the router (zero for the
    others: adding an exact zero changes no sum). A row's result never depends
    on the other rows, so a verify rounds like one-token steps. The router runs
    in float32 whatever the precision, so quantized weights never change which
    experts a row takes. Dense costs num_experts / experts_per_token times the
    chosen experts' work: right for the small expert counts tested here, not
    for a 128-expert model (gathering each row's experts is the torch backend's way)."""
    m = cfg.moe
    probs = b.op("Softmax", b.op("MatMul", h, b.const(np.ascontiguousarray(router.T, dtype=np.float32), "router")),
                 axis=-1)  # [T, E]
    top, chosen = b.name("top"), b.name("chosen")
    b.nodes.append(helper.make_node("TopK", [probs, b.const([m.experts_per_token], dtype=np.int64)], [top, chosen],
                                    axis=-1, largest=1, sorted=1))
    if m.normalize_topk:
        top = b.op("Div", top, b.op("ReduceSum", top, b.const([-1], dtype=np.int64), keepdims=1))
    weights = b.op("ScatterElements", b.op("Mul", probs, b.const(np.float32(0.0))), chosen, top, axis=1)  # [T, E]
    out = None
    for e in range(m.num_experts):
        w = b.op("Slice", weights, b.const([e], dtype=np.int64), b.const([e + 1], dtype=np.int64),
                 b.const([1], dtype=np.int64))
        y = b.op("Mul", gated_mlp(b, linear, cfg, h, p, e), w)
        out = y if out is None else b.op("Add", out, y)
    return out
