"""The peer the cuda backend's decode step is measured against: the same model and
weights as a plain torch decode step on cuBLAS (F.linear) and SDPA, gpt-fast style,
with a static KV cache so the step can also be captured as a CUDA graph. Not exact
(cuBLAS picks kernels by shape): it is the speed a user gets from torch alone."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero_sd.backends.cuda.ops import Dense
from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.families.decoder import rope_cos_sin


class TorchDecode:
    """One token a step at a position given as a tensor; weights: a CudaForward's dict
    (dense weights only: q|k|v and gate|up stacked as it stacks them)."""

    def __init__(self, cfg: ModelConfig, w: dict, context: int, device: torch.device, dtype: torch.dtype):
        self.cfg, self.w = cfg, w
        shape = (cfg.num_layers, cfg.num_kv_heads, context, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        cos, sin = rope_cos_sin(cfg, torch.arange(context))
        self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)
        self.slots = torch.arange(context, device=device)
        self.graph = None

    def _norm(self, x, weight):
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)).to(x.dtype)

    def _rope(self, x, pos):
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cfg, w, D = self.cfg, self.w, self.cfg.head_dim
        x = w["embed"][ids]
        mask = (self.slots <= pos)[None, None, None, :]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            q, k, v = F.linear(h, _dense(w[p + "qkv"]), w[p + "qkv"].bias).split(
                [cfg.num_heads * D, cfg.num_kv_heads * D, cfg.num_kv_heads * D], -1)
            q = self._rope(q.view(1, cfg.num_heads, D), pos)
            k = self._rope(k.view(1, cfg.num_kv_heads, D), pos)
            self.k[i].index_copy_(1, pos, k.transpose(0, 1))
            self.v[i].index_copy_(1, pos, v.view(1, cfg.num_kv_heads, D).transpose(0, 1))
            att = F.scaled_dot_product_attention(q.transpose(0, 1)[None], self.k[i][None], self.v[i][None],
                                                 attn_mask=mask, enable_gqa=True)
            x = x + F.linear(att.reshape(1, -1), _dense(w[p + "self_attn.o_proj.weight"]))
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gate, up = F.linear(h, _dense(w[p + "gate_up"])).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, _dense(w[p + "down"]))
        return F.linear(self._norm(x, w["norm"]), _dense(w["lm_head"])).argmax(-1)

    def capture(self, ids: torch.Tensor, pos: torch.Tensor) -> None:
        """Capture step(ids, pos) on these static tensors; replay() runs it."""
        self._ids, self._pos = ids, pos
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(ids, pos)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._out = self.step(ids, pos)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self._out


def _dense(weight) -> torch.Tensor:
    if not isinstance(weight, Dense):
        raise TypeError("the torch peer runs dense weights only (bf16 / fp16 / fp32 precisions)")
    return weight.w
