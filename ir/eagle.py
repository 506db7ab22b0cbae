"""An EAGLE-3 draft head: one decoder layer that drafts from the target's own hidden states.

    head = EagleHead.load("heads/smollm2", target_ir)     # EAGLE-3's published layout
    keys, values = head.empty_cache(capacity)
    out = head.block(head.fuse(features), tokens, positions, keys, values, written=0)
    logits = head.logits(out)                              # over the draft vocabulary

The layout is EAGLE-3's as published for Llama targets (and read by vLLM and
SGLang): `model.safetensors` with `fc`, `midlayer.*` (one decoder layer whose
q/k/v read 2 x hidden: the normed token embedding, then the normed hidden
state), `norm`, `lm_head` over `draft_vocab_size` rows, `d2t` (target id =
draft id + d2t[draft id]) and `t2d` (bool over the target vocabulary);
`embed_tokens` is optional (absent: the target's, frozen). A matrix may be
stored as int8 rows with an fp32 scale per row (`NAME.scale`, our addition:
the form a head ships in), dequantized at load. `config.json` is an
HF Llama config plus `draft_vocab_size`, `target_hidden_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`: EAGLE-3 ids name the *input*
of target layer i, i.e. our feature layer i - 1 (ir.config.feature_layers).

The pairing, as vLLM's proposer: row j pairs the target's hidden state at
position j with the embedding of token j + 1, at RoPE position j, and predicts
token j + 2. A draft step feeds the previous row's pre-norm output back as the
hidden state (no fc: fc only fuses the target's layers).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.errors import ModelLoadError
from hetero_sd.ir.families.llama import config_from_hf, rope_inv_freq

CONFIG, WEIGHTS = "config.json", "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice (as vLLM's): a low, a middle and a high layer's input (kept within
    1..num_layers for a model of a few layers, where id num_layers is the last layer's output)."""
    return tuple(min(max(i, 1), num_layers) for i in (2, num_layers // 2, num_layers - 3))


@dataclass(frozen=True)
class HeadConfig:
    model: ModelConfig  # the head's own layer: hidden size, heads, RoPE (HF Llama keys)
    draft_vocab: int
    target_hidden: int
    aux_layers: tuple[int, ...]  # EAGLE-3 ids: the input of target layer i

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the head reads (ir.config.feature_layers)."""
        return tuple(i - 1 for i in self.aux_layers)

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab: int, aux_layers: tuple[int, ...] | None = None
                   ) -> "HeadConfig":
        """A head shaped like one of the target's layers (EAGLE-3's recipe)."""
        from dataclasses import replace

        model = replace(target, num_layers=1, output_vocab=None, feature_layers=(), tie_word_embeddings=False)
        return cls(model, min(draft_vocab, target.vocab_size), target.hidden_size,
                   tuple(aux_layers or default_aux_layers(target.num_layers)))

    @classmethod
    def read(cls, folder: Path) -> "HeadConfig":
        path = Path(folder) / CONFIG
        try:
            hf = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"draft head {folder}: cannot read {CONFIG}: {exc}") from None
        missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if k not in hf]
        if missing:
            raise ModelLoadError(f"draft head {path}: missing key(s) {missing}")
        eagle = hf.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids")
        model = config_from_hf({"num_hidden_layers": 1, **hf, "tie_word_embeddings": False})
        if layers is None:
            if "target_num_hidden_layers" not in hf:
                raise ModelLoadError(f"draft head {path}: no eagle_config.eagle_aux_hidden_state_layer_ids "
                                     "and no target_num_hidden_layers to derive them from")
            layers = default_aux_layers(int(hf["target_num_hidden_layers"]))
        if any(int(i) < 1 for i in layers):
            raise ModelLoadError(f"draft head {path}: aux layer ids {layers} must be >= 1 "
                                 "(id 0, the embeddings, is not a layer output)")
        return cls(model, int(hf.get("draft_vocab_size") or hf["vocab_size"]),
                   int(hf.get("target_hidden_size") or hf["hidden_size"]), tuple(int(i) for i in layers))

    def to_hf(self) -> dict:
        m = self.model
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": m.hidden_size,
                "intermediate_size": m.intermediate_size, "num_hidden_layers": 1,
                "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
                "head_dim": m.head_dim, "rms_norm_eps": m.rms_norm_eps, "rope_theta": m.rope_theta,
                "rope_scaling": m.rope_scaling, "max_position_embeddings": m.max_position_embeddings,
                "vocab_size": m.vocab_size, "draft_vocab_size": self.draft_vocab,
                "target_hidden_size": self.target_hidden, "hidden_act": "silu", "tie_word_embeddings": False,
                "torch_dtype": "float32",
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                                 "use_aux_hidden_state": True}}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _int8(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A float matrix as symmetric int8 rows and an fp32 scale per row; anything else as is."""
    if t.ndim != 2 or not t.is_floating_point():
        return {name: t}
    scale = t.abs().amax(1).clamp_min(1e-12) / 127.0
    return {name: torch.round(t / scale[:, None]).to(torch.int8), f"{name}.scale": scale.float()}


def _dequantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in state.items() if not k.endswith(".scale")}
    for name, t in out.items():
        if t.dtype == torch.int8:
            scale = state.get(f"{name}.scale")
            if scale is None or scale.shape != (t.shape[0],):
                raise ModelLoadError(f"draft head: {name} is int8 without a scale per row ({name}.scale)")
            out[name] = t.float() * scale.float()[:, None]
    return out


class EagleHead(nn.Module):
    """The head's weights and its three operations: fuse, block, logits."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor):
        super().__init__()
        m = cfg.model
        self.cfg, H, hd = cfg, m.hidden_size, m.head_dim
        if embed.shape != (m.vocab_size, H):
            raise ModelLoadError(f"draft head: token embedding {tuple(embed.shape)} is not "
                                 f"({m.vocab_size}, {H}): the head and target disagree on vocabulary or width")
        self.register_buffer("embed", embed.float(), persistent=False)  # the target's, frozen
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden, H, bias=False)
        self.hidden_norm, self.input_layernorm, self.post_attention_layernorm, self.norm = (
            nn.Parameter(torch.ones(H)) for _ in range(4))
        self.q_proj = nn.Linear(2 * H, m.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, m.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, m.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(m.num_heads * hd, H, bias=False)
        self.gate_proj, self.up_proj = (nn.Linear(H, m.intermediate_size, bias=False) for _ in range(2))
        self.down_proj = nn.Linear(m.intermediate_size, H, bias=False)
        self.lm_head = nn.Linear(H, cfg.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.register_buffer("inv_freq", rope_inv_freq(m), persistent=False)

    # -- the vocabulary map ------------------------------------------------------------------
    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft id i proposes target id target_ids[i] (ascending, as EAGLE-3 stores them)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids)))

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(self.cfg.draft_vocab, device=self.d2t.device) + self.d2t

    # -- the three operations ------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated layer outputs [.., 3 * target_hidden] -> [.., hidden]."""
        return self.fc(features)

    def qkv(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """q [B, heads, n, hd] and k, v [B, kv_heads, n, hd] of rows (hidden, token) at positions."""
        m = self.cfg.model
        eps, (B, n) = m.rms_norm_eps, tokens.shape
        x = torch.cat((_rms(self.embed[tokens], self.input_layernorm, eps),
                       _rms(hidden, self.hidden_norm, eps)), -1)
        angles = positions.to(torch.float32)[..., None] * self.inv_freq
        cos, sin = (f(torch.cat((angles, angles), -1)) for f in (torch.cos, torch.sin))  # [n, hd]
        q = self.q_proj(x).view(B, n, m.num_heads, m.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, n, m.num_kv_heads, m.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, n, m.num_kv_heads, m.head_dim).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, hidden: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of q over keys/values [B, kv_heads, S, hd] (mask [n, S] or [B, 1, n, S], True =
        attend; None = all), then the MLP: the layer's pre-norm output [B, n, hidden]."""
        m = self.cfg.model
        B, n = q.shape[0], q.shape[2]
        attn = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                          enable_gqa=m.num_heads != m.num_kv_heads)
        residual = hidden + self.o_proj(attn.transpose(1, 2).reshape(B, n, -1))
        x = _rms(residual, self.post_attention_layernorm, m.rms_norm_eps)
        return residual + self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of pre-norm outputs."""
        return self.lm_head(_rms(out, self.norm, self.cfg.model.rms_norm_eps))

    # -- the published layout ------------------------------------------------------------------
    def published(self) -> dict[str, torch.Tensor]:
        """EAGLE-3's tensor names -> this head's parameters (and d2t)."""
        names = {"fc.weight": self.fc.weight, "norm.weight": self.norm, "lm_head.weight": self.lm_head.weight,
                 "d2t": self.d2t}
        for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
            names[f"midlayer.{name}.weight"] = getattr(self, name)
        for name in "qkvo":
            names[f"midlayer.self_attn.{name}_proj.weight"] = getattr(self, f"{name}_proj").weight
        for name in ("gate", "up", "down"):
            names[f"midlayer.mlp.{name}_proj.weight"] = getattr(self, f"{name}_proj").weight
        return names

    def state_for_save(self) -> dict[str, torch.Tensor]:
        t2d = torch.zeros(self.cfg.model.vocab_size, dtype=torch.bool)
        t2d[self.target_ids] = True
        return {**{k: v.detach().cpu().clone().contiguous() for k, v in self.published().items()}, "t2d": t2d}

    def save(self, folder: str | Path, int8: bool = False) -> None:
        """EAGLE-3's layout; int8: every matrix as int8 rows with one scale per row (`NAME.scale`),
        a quarter of the fp32 size, what the package ships (load() reads both)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = self.state_for_save()
        if int8:
            state = {k: v for name, t in state.items() for k, v in _int8(name, t).items()}
        save_file(state, str(folder / WEIGHTS))
        (folder / CONFIG).write_text(json.dumps(self.cfg.to_hf(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path, embed: torch.Tensor | None) -> "EagleHead":
        """A head from EAGLE-3's layout; `embed` is the target's token embedding (used
        when the checkpoint has no embed_tokens of its own)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = HeadConfig.read(folder)
        try:
            state = load_file(str(folder / WEIGHTS))
        except Exception as exc:  # missing file, not safetensors
            raise ModelLoadError(f"draft head {folder}: cannot read {WEIGHTS}: {exc}") from None
        state = _dequantized(state)
        own = state.pop("embed_tokens.weight", None)
        if own is None and embed is None:
            raise ModelLoadError(f"draft head {folder} has no embed_tokens and no target embedding was given")
        head = cls(cfg, own if own is not None else embed)
        state.pop("t2d", None)  # implied by d2t
        mine = head.published()
        unknown, missing = sorted(set(state) - set(mine)), sorted(set(mine) - set(state) - {"d2t"})
        if unknown or missing:
            raise ModelLoadError(f"draft head {folder}: not an EAGLE-3 Llama head "
                                 f"(missing {missing[:3]}, unexpected {unknown[:3]})")
        with torch.no_grad():
            for name, tensor in state.items():
                if mine[name].shape != tensor.shape:
                    raise ModelLoadError(f"draft head {folder}: {name} has shape {tuple(tensor.shape)}, "
                                         f"the config says {tuple(mine[name].shape)}")
                mine[name].copy_(tensor)
        return head.eval()

