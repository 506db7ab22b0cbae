"""The target in Hugging Face transformers, for making a head's training data at scale.

    ref = Reference.load("/path/to/model.gguf")          # or an HF folder
    responses = ref.generate(prompt_ids, max_new_tokens=200, eos_ids=(2,))
    features, final = ref.states(ids, feature_layers=(1, 14, 26))

Why transformers and not the configured backend: the data is a prefill of a
million tokens and more, and transformers' batched bf16 forward (oneDNN's AMX
kernels where the host has them) runs it 6x faster than the exact target's
one-sequence prefill (SmolLM2 on 2 Sapphire Rapids cores: ~1,700 against
~265 tok/s). The head needs the target's states, not its exact rounding:
it is measured, and verified, on the serving backend, where any difference
costs acceptance and never output (drafts are always verified).
Features are what ir.config.feature_layers names: layer i's own output
(before the final norm, so taken by a hook, not from hidden_states); `final` is the last
layer's output after the final norm, from which the labels (the target's
logits over the draft vocabulary) are one matmul with its output rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hetero_sd.errors import ConfigError


def fast_dtype(choice: str = "auto") -> torch.dtype:
    """bf16 where the CPU computes it natively (AMX or AVX-512 BF16), else fp32 (emulated bf16 is
    slower than fp32 on AVX2 hosts); `choice` bf16 or fp32 overrides."""
    if choice != "auto":
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[choice]
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.float32
    return torch.bfloat16 if ("amx_bf16" in flags or "avx512_bf16" in flags) else torch.float32


@dataclass
class Reference:
    model: torch.nn.Module  # a transformers causal LM
    dtype: torch.dtype

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype | None = None) -> "Reference":
        from transformers import AutoModelForCausalLM

        path, dtype = Path(path), dtype or fast_dtype()
        where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name} \
            if path.suffix == ".gguf" else {"pretrained_model_name_or_path": str(path)}
        try:
            model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"train-head reads the target with transformers, which cannot load {path}: "
                              f"{exc}") from None
        return cls(model.eval(), dtype)

    @torch.inference_mode()
    def states(self, ids: list[int], feature_layers: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(features [T, len(layers) * H], final [T, H]) fp16 for one sequence."""
        layers, seen = self.model.model.layers, {}

        def keep(i):  # a layer's own output, before any final norm (hidden_states[-1] is normed)
            return lambda _mod, _args, out: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out)

        hooks = [layers[i].register_forward_hook(keep(i)) for i in sorted(set(feature_layers))]
        try:
            final = self.model.model(torch.as_tensor([ids])).last_hidden_state[0]
        finally:
            for h in hooks:
                h.remove()
        feats = torch.cat([seen[i].reshape(len(ids), -1) for i in feature_layers], -1)
        return feats.to(torch.float16).numpy(), final.to(torch.float16).numpy()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: tuple[int, ...],
                 batch: int = 64, progress=None) -> list[list[int]]:
        """Greedy responses (cut after the first EOS), in left-padded batches of similar lengths."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        pad = eos_ids[0] if eos_ids else 0
        for start in range(0, len(order), batch):
            picks = order[start:start + batch]
            width = max(len(prompts[i]) for i in picks)
            ids = torch.full((len(picks), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(picks):
                ids[row, width - len(prompts[i]):] = torch.as_tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            gen = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=pad, eos_token_id=list(eos_ids) or None)
            for row, i in enumerate(picks):
                new = gen[row, width:].tolist()
                ends = [j for j, t in enumerate(new) if t in eos_ids]
                out[i] = new[:ends[0] + 1] if ends else new
            if progress is not None:
                progress(len(picks))
        return out
