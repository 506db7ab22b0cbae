"""An EAGLE-3 draft head (ir/eagle.py) lowered to ONNX and run by onnxruntime.

    runner = OrtHeadRunner(head, "int8")     # or "fp32", "int4"; threads=None: this process's CPUs

The head-runner contract of backends/torch_head.py (HeadDrafter drives either;
`out` is a numpy array here), built for a cheap one-row draft step on a CPU:
the layer's linears are MatMulNBits (int8/int4, onnx_weights.Linears; the LM
head over the draft vocabulary at 8 bits) or fp32 MatMuls, q/k/v and gate/up
fused into one matmul each, RoPE onnxruntime's RotaryEmbedding, and the rest
a few small ops (~30 nodes).

Two graphs, built in memory at load (no disk cache: under a second):
  fc    features float [n, aux * target_hidden] -> hidden float [n, hidden]
        (run only for real pairs: a draft step feeds its own output back)
  step  emb float [1, n, hidden]   the tokens' embedding rows (gathered in
                                   numpy: the table stays out of the graph)
        hidden float [1, n, hidden]
        start int64 [1]            absolute position of the first row (RoPE)
        past_k, past_v float [1, P, kv_heads * head_dim]   cached rows first..start-1
        -> out float [1, 1, hidden] (the last row's pre-norm output),
           logits float [1, 1, draft_vocab] (its),
           new_kv float [2, n, kv_heads * head_dim] (every new row's K and V)
Only the last row attends and goes through the MLP and LM head: the other
rows' outputs are never returned and their K/V do not depend on attention, so
what a call returns is the same as with every row computed under a causal
mask (the last row sees them all: no mask at all).

The KV cache is one numpy array [2, capacity, kv_heads * head_dim] owned by the
runner: position-major, so the window [first, start) of K (and of V) is one
contiguous slice the runtime reads in place; the new rows' K/V come back as
one output, written with one strided copy (rollback is a smaller `start` next
time). The 1/sqrt(head_dim) attention scale is folded into q's weight rows
(exact for a power-of-two head_dim).
"""
from __future__ import annotations

import copy
import os

import numpy as np
import torch
from onnx import TensorProto, helper

from hetero_sd.backends.onnx_blocks import rms_norm
from hetero_sd.backends.onnx_llama import OPSET
from hetero_sd.backends.onnx_weights import Builder, Linears
from hetero_sd.ir.eagle import EagleHead
from hetero_sd.ir.families.llama import rope_inv_freq
from hetero_sd.ir.weights import WeightSource
from hetero_sd.ir.work import MAX_DRAFT_TOKENS

PRECISIONS = ("fp32", "int8", "int4")  # int4: the layer's linears at 4 bits, the LM head at 8 (as onnx_weights)


class _Tensors(WeightSource):
    """A weight source (ir/weights.py) over the head's tensors, for Linears."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._t = tensors

    def names(self) -> list[str]:
        return list(self._t)

    def get(self, name: str) -> torch.Tensor:
        return self._t[name]


def _weights(head: EagleHead) -> dict[str, torch.Tensor]:
    m = head.cfg.model
    scale = 1.0 / float(np.sqrt(m.head_dim))
    w = {name: getattr(head, name).weight.detach().float().cpu()
         for name in ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")}
    w["q_proj"] = w["q_proj"] * scale  # the attention scale, once, in the weights
    for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm", "norm"):
        w[name] = getattr(head, name).detach().float().cpu()
    return w


def build_step_graph(head: EagleHead, precision: str):
    """The step graph (module docstring) with weights in `precision`."""
    m = head.cfg.model
    H, Hq, Hkv, D = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    G, eps = Hq // Hkv, m.rms_norm_eps
    w = _weights(head)
    b = Builder()
    linear = Linears(b, _Tensors(w), precision)
    i64 = lambda *v: b.const(list(v), dtype=np.int64)  # noqa: E731
    norm = lambda x, name: rms_norm(b, x, w[name].numpy(), eps)  # noqa: E731

    x = b.op("Concat", norm("emb", "input_layernorm"), norm("hidden", "hidden_norm"), axis=-1)  # [1, n, 2H]
    qkv = linear(x, ["q_proj", "k_proj", "v_proj"])
    q, k, v = b.name("q"), b.name("k"), b.name("v")
    b.nodes.append(helper.make_node("Split", [qkv, i64(Hq * D, Hkv * D, Hkv * D)], [q, k, v], axis=-1))

    # RoPE at absolute positions start .. start + n - 1 (onnxruntime's RotaryEmbedding: position_ids
    # of shape [1] are the first row's position), over a table of every position the model allows
    inv = rope_inv_freq(m).numpy().astype(np.float32)
    angles = np.arange(_positions(m), dtype=np.float32)[:, None] * inv[None, :]  # [positions, D/2]
    cos, sin = (b.const(f(angles).astype(np.float32), f.__name__) for f in (np.cos, np.sin))
    q, k = (b.op("RotaryEmbedding", t, "start", cos, sin, domain="com.microsoft", num_heads=heads, interleaved=0)
            for t, heads in ((q, Hq), (k, Hkv)))  # [1, n, heads*D]
    b.op("Concat", k, v, axis=0, out="new_kv")  # [2, n, Hkv*D]: the cache's layout
    k_all, v_all = (b.op("Reshape", b.op("Concat", past, new, axis=1), i64(-1, Hkv, D))  # [S, Hkv, D], S = P + n
                    for past, new in (("past_k", k), ("past_v", v)))

    # Only the last row goes on: the others' outputs are never returned and their K/V (above) do not
    # depend on attention, so it is all a call computes beyond K/V (and it sees every row: no mask).
    last = lambda t: b.op("Slice", t, i64(-1), i64(np.iinfo(np.int64).max), i64(1))  # noqa: E731  [1, 1, .]
    # q grouped by kv head [Hkv, G, D] (query head h = kv head h // G), k^T [Hkv, D, S], v [Hkv, S, D]
    scores = b.op("MatMul", b.op("Reshape", last(q), i64(Hkv, G, D)), b.op("Transpose", k_all, perm=[1, 2, 0]))
    att = b.op("MatMul", b.op("Softmax", scores, axis=-1), b.op("Transpose", v_all, perm=[1, 0, 2]))  # [Hkv, G, D]
    res = b.op("Add", last("hidden"), linear(b.op("Reshape", att, i64(1, 1, Hq * D)), ["o_proj"]))
    h = norm(res, "post_attention_layernorm")
    inter = m.intermediate_size
    gate, up = b.name("gate"), b.name("up")
    b.nodes.append(helper.make_node("Split", [linear(h, ["gate_proj", "up_proj"]), i64(inter, inter)], [gate, up],
                                    axis=-1))
    out = b.op("Add", res, linear(b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up), ["down_proj"]),
               out="out")
    linear(norm(out, "norm"), ["lm_head"], head=True, out="logits")

    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("emb", f, [1, "n", H]),
              helper.make_tensor_value_info("hidden", f, [1, "n", H]),
              helper.make_tensor_value_info("start", TensorProto.INT64, [1]),
              helper.make_tensor_value_info("past_k", f, [1, "P", Hkv * D]),
              helper.make_tensor_value_info("past_v", f, [1, "P", Hkv * D])]
    outputs = [helper.make_tensor_value_info("out", f, [1, 1, H]),
               helper.make_tensor_value_info("logits", f, [1, 1, head.cfg.draft_vocab]),
               helper.make_tensor_value_info("new_kv", f, [2, "n", Hkv * D])]
    return _model(b, "hetero_sd_eagle_step", inputs, outputs)


def _positions(m) -> int:
    """Positions the RoPE table covers: the model's context and a draft past its end."""
    return m.max_position_embeddings + MAX_DRAFT_TOKENS + 1


def build_fc_graph(head: EagleHead, precision: str):
    """features [n, aux * target_hidden] -> hidden [n, hidden] (the fc, in `precision`)."""
    b = Builder()
    Linears(b, _Tensors(_weights(head)), precision)("features", ["fc"], out="hidden")
    f = TensorProto.FLOAT
    return _model(b, "hetero_sd_eagle_fc", [helper.make_tensor_value_info("features", f, ["n", head.fc.in_features])],
                  [helper.make_tensor_value_info("hidden", f, ["n", head.cfg.model.hidden_size])])


def _model(b: Builder, name: str, inputs: list, outputs: list):
    graph = helper.make_graph(b.nodes, name, inputs, outputs, b.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                   helper.make_opsetid("com.microsoft", 1)],
                             producer_name="hetero-sd")


def _session(proto, threads: int):
    import onnxruntime as ort

    from hetero_sd.backends.ort_backend import session_options

    return ort.InferenceSession(proto.SerializeToString(), session_options(threads),
                                providers=["CPUExecutionProvider"])


def _raw_run(session):
    """session.run(names, feeds), through the compiled session where onnxruntime exposes it."""
    raw = getattr(session, "_sess", None)
    return (lambda names, feeds: raw.run(names, feeds, None)) if raw is not None else session.run


class OrtHeadRunner:
    """The head-runner contract (backends/torch_head.py) on onnxruntime's CPU provider.
    precision: fp32 (the head's float weights), int8 or int4 (weight-only MatMulNBits,
    the LM head at 8 bits). threads: onnxruntime's intra-op threads (None: this process's CPUs,
    as the onnxruntime backend)."""

    def __init__(self, head: EagleHead, precision: str = "int8", threads: int | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"no onnxruntime head precision {precision!r} (one of {', '.join(PRECISIONS)})")
        cfg, m = head.cfg, head.cfg.model
        self.precision = precision
        self.feature_layers, self.vocab_size = cfg.feature_layers, m.vocab_size
        self.target_ids = head.target_ids.cpu().numpy()
        self._embed = np.ascontiguousarray(head.embed.detach().float().cpu().numpy())
        self._hidden = m.hidden_size
        self._kv = m.num_kv_heads * m.head_dim
        self._positions = _positions(m)
        threads = threads or len(os.sched_getaffinity(0))
        with torch.no_grad():
            self._step = _session(build_step_graph(head, precision), threads)
            self._fc = _session(build_fc_graph(head, precision), threads)
        self._outputs = [o.name for o in self._step.get_outputs()]
        # the session's own run, without InferenceSession.run's per-call checks of the feeds
        # (tens of microseconds, a few percent of a draft step; these feeds are built here)
        self._run, self._run_fc = _raw_run(self._step), _raw_run(self._fc)
        self._cache = None

    def fork(self) -> "OrtHeadRunner":
        clone = copy.copy(self)  # shares the sessions (their run is thread-safe) and the embedding table
        clone._cache = None
        return clone

    def begin(self, capacity: int) -> None:
        rows = capacity + MAX_DRAFT_TOKENS + 1
        if self._cache is None or self._cache.shape[1] < rows:
            self._cache = np.zeros((2, rows, self._kv), dtype=np.float32)

    def run(self, tokens: list[int], start: int, first: int, features: np.ndarray | None = None,
            hidden: np.ndarray | None = None):
        n, cache = len(tokens), self._cache
        if cache is None:
            raise RuntimeError("OrtHeadRunner.begin must be called before run")
        if not 0 <= first <= start or start + n > cache.shape[1]:
            raise ValueError(f"head: rows {start}..{start + n - 1} (attending from {first}) do not fit a cache "
                             f"of {cache.shape[1]} positions")
        if start + n > self._positions:
            raise ValueError(f"head: position {start + n - 1} is past the model's {self._positions} (RoPE table)")
        if features is not None:
            hidden = self._run_fc(["hidden"], {"features": np.ascontiguousarray(features, dtype=np.float32)})[0]
        hidden = np.ascontiguousarray(hidden, dtype=np.float32).reshape(1, -1, self._hidden)
        if hidden.shape[1] != n:
            raise ValueError(f"head: {n} tokens but {hidden.shape[1]} hidden rows")
        out, logits, new_kv = self._run(self._outputs, {
            "emb": self._embed[tokens][None], "hidden": hidden, "start": np.array([start], dtype=np.int64),
            "past_k": cache[0, first:start][None], "past_v": cache[1, first:start][None]})
        cache[:, start:start + n] = new_kv
        return out, logits[0, 0]
