"""The reference forward of every family (ir/families/decoder.py names what
they share; ModelConfig says how they differ). Tested against transformers;
the torch backend runs it, and the graph lowerings compute the same."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.families.decoder import activation, apply_rope, down_name, gate_up_names, qkv_names, rope_cos_sin


class Forward(torch.nn.Module):
    """Tokens at positions [start, start+T) against a KV cache holding [0, start).

    The caller owns the cache: `k_cache`/`v_cache` are [layers, kv_heads,
    capacity, head_dim] views into its pool; this writes the new positions and
    reads the prefix, so rollback is the caller's length, never a copy.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 exact_linear=None):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.w = weights
        self.lm_head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        # A backend may pass a matmul whose per-row results do not depend on
        # how many rows run together; forward(exact=True) then uses it with a
        # row-wise attention (batch invariance). Otherwise: the fastest ops.
        self._exact_mm = exact_linear
        self._act = activation(cfg.hidden_act)

    def _linear(self, mm, x, name, bias=False):
        return mm(x, self.w[name + ".weight"], self.w.get(name + ".bias") if bias else None)

    def _stacked(self, mm, x, names: list[str], bias_names=()):
        """x times the weights `names` stacked by rows (a fused checkpoint stores them as one)."""
        parts = [mm(x, self.w[n], self.w.get(b)) for n, b in zip(names, list(bias_names) + [None] * len(names))]
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def _norm(self, x, weight):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * h.to(x.dtype)

    def _rope(self, start: int, n: int, local: bool):
        cos, sin = rope_cos_sin(self.cfg, torch.arange(start, start + n), local)
        return cos.to(self.dtype), sin.to(self.dtype)

    def _mask(self, start: int, n: int, window: int | None) -> torch.Tensor:
        q = torch.arange(start, start + n)[:, None]
        k = torch.arange(start + n)[None, :]
        allowed = k <= q
        if window is not None:
            allowed &= (q - k) < window
        return allowed

    def _sdpa(self, q, k, v, mask=None):
        cfg = self.cfg
        gqa = cfg.num_heads != cfg.num_kv_heads
        if cfg.attn_softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=cfg.attention_scale)
        groups = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        scores = (q @ k.transpose(-1, -2)) * cfg.attention_scale
        scores = torch.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), -1).to(q.dtype) @ v

    def _attend(self, q, k, v, start, masks, window):
        if masks is not None:
            end = start + q.shape[1]
            return self._sdpa(q, k[:, :end], v[:, :end], masks[window])
        # One query row at a time over exactly its visible keys: the same shapes
        # a one-token decode at that position uses, hence the same rounding.
        rows = []
        for t in range(q.shape[1]):
            pos = start + t
            lo = max(0, pos + 1 - window) if window else 0
            rows.append(self._sdpa(q[:, t:t + 1], k[:, lo:pos + 1], v[:, lo:pos + 1]))
        return torch.cat(rows, dim=1)

    def forward(self, tokens: torch.Tensor, start: int, k_cache: torch.Tensor,
                v_cache: torch.Tensor, num_logits: int = 1, exact: bool = False,
                features: list | None = None) -> torch.Tensor:
        return self.forward_batch([(tokens, start, k_cache, v_cache, num_logits)], exact, features)[0]

    def forward_batch(self, seqs: list[tuple], exact: bool = False,
                      features: list | None = None) -> list[torch.Tensor]:
        """Several sequences in one pass: `seqs` holds forward's (tokens, start,
        k_cache, v_cache, num_logits) per sequence. The linear layers run on all
        rows at once (weights read once); attention runs per sequence over its
        own cache. With exact=True every row rounds as in a call of its own.
        With `features` (a list) and cfg.feature_layers set, one float32 tensor
        per sequence is appended to it: the outputs of those decoder layers for
        every one of its rows, [n, len(feature_layers) * hidden], concatenated in
        the layers' order (the residual stream after the layer, before the final
        norm). Capturing them changes no other result."""
        cfg = self.cfg
        exact = exact and self._exact_mm is not None
        mm = self._exact_mm if exact else F.linear
        x = F.embedding(torch.cat([s[0] for s in seqs]) if len(seqs) > 1 else seqs[0][0],
                        self.w["model.embed_tokens.weight"])
        if cfg.embed_scale is not None:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        segs, off = [], 0
        for tokens, start, k_cache, v_cache, num_logits in seqs:
            n = tokens.shape[0]
            masks = None if exact else {w: self._mask(start, n, w) for w in cfg.windows}  # exact: row by row
            segs.append(_Segment(off, n, start, k_cache, v_cache, num_logits, masks))
            off += n
        ropes = {}
        for local in {cfg.local_rope(i) for i in range(cfg.num_layers)}:
            parts = [self._rope(s.start, s.n, local) for s in segs]
            ropes[local] = tuple(torch.cat(p) if len(p) > 1 else p[0] for p in zip(*parts))
        wanted = cfg.feature_layers if features is not None else ()
        captured = {}
        for i in range(cfg.num_layers):
            x = self._layer(i, x, segs, ropes[cfg.local_rope(i)], mm)
            if i in wanted:
                captured[i] = x
        if wanted:
            feats = torch.cat([captured[i] for i in wanted], dim=-1).float()
            features.extend(feats.split([s.n for s in segs]))
        rows = [x[s.off + s.n - s.num_logits:s.off + s.n] for s in segs]
        h = self._norm(torch.cat(rows) if len(rows) > 1 else rows[0], self.w["model.norm.weight"])
        logits = mm(h, self.lm_head).float()
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return list(logits.split([s.num_logits for s in segs]))

    def _layer(self, i, x, segs, rope, mm):
        cfg, p, (cos, sin) = self.cfg, f"model.layers.{i}.", rope
        n, D = x.shape[0], cfg.head_dim
        h = self._norm(x, self.w[p + "input_layernorm.weight"])
        biases = [p + f"self_attn.{c}_proj.bias" for c in "qkv"] if cfg.attention_bias else ()
        qkv = self._stacked(mm, h, qkv_names(cfg, p), biases)
        q, k, v = qkv.split([cfg.num_heads * D, cfg.num_kv_heads * D, cfg.num_kv_heads * D], dim=-1)
        q = q.reshape(n, cfg.num_heads, D).transpose(0, 1)
        k = k.reshape(n, cfg.num_kv_heads, D).transpose(0, 1)
        v = v.reshape(n, cfg.num_kv_heads, D).transpose(0, 1)
        if cfg.qk_norm:
            q = self._norm(q, self.w[p + "self_attn.q_norm.weight"])
            k = self._norm(k, self.w[p + "self_attn.k_norm.weight"])
        if cfg.uses_rope(i):
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        atts = []
        for s in segs:
            rows = slice(s.off, s.off + s.n)
            k_cache, v_cache = s.k_cache[i], s.v_cache[i]
            k_cache[:, s.start:s.start + s.n] = k[:, rows]
            v_cache[:, s.start:s.start + s.n] = v[:, rows]
            atts.append(self._attend(q[:, rows], k_cache, v_cache, s.start, s.masks, cfg.window(i)))
        att = torch.cat(atts, dim=1) if len(atts) > 1 else atts[0]
        out = self._linear(mm, att.transpose(0, 1).reshape(n, -1), p + "self_attn.o_proj")
        if cfg.sandwich_norms:
            x = x + self._norm(out, self.w[p + "post_attention_layernorm.weight"])
            h = self._norm(x, self.w[p + "pre_feedforward_layernorm.weight"])
        else:
            x = x + out
            h = self._norm(x, self.w[p + "post_attention_layernorm.weight"])
        out = self._moe(mm, h, p) if cfg.sparse(i) else self._mlp(mm, h, p)
        if cfg.sandwich_norms:
            out = self._norm(out, self.w[p + "post_feedforward_layernorm.weight"])
        return x + out

    def _mlp(self, mm, h, p, expert: int | None = None):
        gate, up = self._stacked(mm, h, gate_up_names(p, self.cfg, expert)).chunk(2, dim=-1)
        return mm(self._act(gate) * up, self.w[down_name(p, expert)], None)

    def _moe(self, mm, h, p):
        """Each row's chosen experts, summed in expert-index order from zero
        (as transformers does): a row's sum never depends on the other rows,
        and each expert runs only on the rows that chose it."""
        moe = self.cfg.moe
        probs = torch.softmax(mm(h, self.w[p + "mlp.gate.weight"], None).float(), dim=-1)
        top, chosen = torch.topk(probs, moe.experts_per_token, dim=-1)
        if moe.normalize_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        top = top.to(h.dtype)
        out = torch.zeros_like(h)
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == e)
            out.index_add_(0, rows, self._mlp(mm, h[rows], p, e) * top[rows, slot, None])
        return out


@dataclass
class _Segment:
    """One sequence's rows [off, off+n) of a batched pass, at positions [start, start+n)."""
    off: int
    n: int
    start: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_logits: int
    masks: dict | None  # window -> [n, start+n] mask; None: attention row by row
