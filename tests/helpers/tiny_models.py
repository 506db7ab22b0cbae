"""Tiny but real model files for tests, with Hugging Face transformers as the oracle.

    path = make_hf_model(tmp / "llama", "llama")          # HF folder: config.json, safetensors, tokenizer
    gguf = make_gguf(path, tmp / "llama.gguf", "Q8_0")   # llama.cpp-style GGUF of the same model
    logits = hf_logits(path, [5, 17, 42])                # [T, vocab] float32, the reference answer

Everything is deterministic for a given (variant, seed): weights come from a seeded
generator and the byte-level BPE tokenizer is trained once per process on a fixed corpus.

GGUF files are written the way llama.cpp's `convert_hf_to_gguf.py` writes them: arch "llama"
(Llama, Mistral) with the Q/K projection rows permuted for llama.cpp's RoPE layout, arch
"qwen2" (no permute, q/k/v biases), the same tensor names, metadata keys and tokenizer
metadata (via `gguf.SpecialVocab`, which is what the converter uses).
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# Shapes shared by every variant. Q8_0 quantizes blocks of 32 along each row, so every row
# length (hidden, intermediate) is a multiple of 32.
VOCAB_SIZE = 384
HIDDEN = 64
INTERMEDIATE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
MAX_POSITIONS = 256
RMS_EPS = 1e-5

SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VARIANTS = ("llama", "llama-tied", "llama-rope-linear", "llama3-rope", "mistral-swa", "qwen2")
# the same with rows of 256 values (the k-quant super-block) for GGUF block-type tests
WIDE_VARIANTS = ("llama-wide", "qwen2-wide")

# Which variants a llama.cpp converter would emit as which GGUF architecture.
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A heat pump moves heat from a cold place to a
warm place by doing work on a refrigerant, and it can heat or cool a house depending on the
direction in which the refrigerant flows. Speculative decoding lets a small draft model
propose several tokens that a larger target model then checks in a single forward pass; the
output is exactly the same as if the target model had produced every token by itself.

Once upon a time there was a little robot who lived in a quiet town by the sea. Every morning
the robot walked to the harbour, counted the boats, and wrote the numbers in a blue notebook.
One day the robot found that there were more boats than the day before, and it wondered where
the new boats had come from. It asked the fishermen, the baker, and the teacher, but nobody
knew. In the evening the robot went home, read its notebook again, and smiled.

Large language models are trained to predict the next token of a text. They read the tokens
that came before, mix them together with attention, and pass the result through many layers
of simple matrix multiplications and non-linear functions. What is the capital of France?
The capital of France is Paris. How many legs does a spider have? A spider has eight legs.
Please explain, in simple words, why the sky is blue during the day and red at sunset.
Numbers like 12, 345 and 6789 appear in text too, as do symbols such as (, ), [, ], {, } and #.
"""


# ---------------------------------------------------------------------------------------------
# Tokenizer


@functools.lru_cache(maxsize=None)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE with exactly `vocab_size` entries, trained once per process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer trained to {tok.get_vocab_size()} entries, wanted {vocab_size}")
    for tid, text in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(text) == tid, (text, tok.token_to_id(text))
    return tok.to_str()


def make_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A `PreTrainedTokenizerFast` with bos `<s>`, eos `</s>` and a ChatML chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


# ---------------------------------------------------------------------------------------------
# Hugging Face models


def _config_for(variant: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=RMS_EPS,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
        dtype="float32",
    )
    if variant.endswith("-wide"):
        # rows of 256 values: the k-quant super-block (gguf_mixes.py)
        common.update(hidden_size=256, intermediate_size=512, head_dim=64)
        variant = variant[:-len("-wide")]
    if variant == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    if variant == "llama-tied":
        return LlamaConfig(**{**common, "tie_word_embeddings": True},
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if variant == "llama-rope-linear":
        return LlamaConfig(**common, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    if variant == "llama3-rope":
        # theta 10000 with head_dim 16 puts one frequency in each llama3 band (kept, smoothed, scaled).
        return LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 10000.0,
        })
    if variant == "mistral-swa":
        return MistralConfig(**common, sliding_window=8,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if variant == "qwen2":
        # Qwen2 lists both <|im_end|> and </s> as end-of-sequence tokens (exercises a list eos).
        return Qwen2Config(**{**common, "eos_token_id": [IM_END_ID, EOS_ID]},
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    raise ValueError(f"unknown tiny-model variant {variant!r}; known: {', '.join(VARIANTS + WIDE_VARIANTS)}")


def _model_class(config):
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    return {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}[config.model_type]


@torch.no_grad()
def _init_weights(model, seed: int, tied: bool) -> None:
    """Deterministic weights with activations of order one and well separated logits.

    Linear weights ~ N(0, 1/fan_in) keep every residual update at unit scale; attention scores
    come out with a spread of about one (not uniform attention); norm weights are 1 +- 0.2 so
    a backend that ignores them fails; biases are clearly non-zero; the LM head gives logits with
    a standard deviation of about 3, so the top two logits are usually far apart.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("embed_tokens.weight"):
            std = 0.35 if tied else 1.0
            param.copy_(torch.randn(param.shape, generator=gen) * std)
        elif name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
        elif name.endswith(".bias"):
            param.copy_(0.5 * torch.randn(param.shape, generator=gen))
        elif name == "lm_head.weight":
            param.copy_(torch.randn(param.shape, generator=gen) * (3.0 / math.sqrt(param.shape[1])))
        elif param.dim() == 2:
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1]))
        else:
            raise AssertionError(f"unexpected parameter {name} {tuple(param.shape)}")


def make_hf_model(out_dir, variant: str, seed: int = 0, shards: int = 1) -> Path:
    """Build, initialise and save a tiny transformers model plus tokenizer into `out_dir`.

    `shards > 1` writes a sharded folder (model-0000k-of-0000n.safetensors plus
    model.safetensors.index.json) with at least two and roughly `shards` files.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _config_for(variant)
    torch.manual_seed(seed)
    model = _model_class(config)(config).to(torch.float32).eval()
    _init_weights(model, seed, tied=config.tie_word_embeddings)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    total_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    if shards > 1:
        # A shard is closed once it would pass the limit, so aim a bit under total/shards.
        max_shard = f"{max(1, total_bytes // shards // 1000 - 1)}KB"
    else:
        max_shard = f"{total_bytes * 2 // 1000 + 1000}KB"
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=max_shard)
    if shards > 1 and not (out_dir / "model.safetensors.index.json").exists():
        raise RuntimeError(f"asked for {shards} shards but save_pretrained wrote a single file")
    if shards == 1 and not (out_dir / "model.safetensors").exists():
        raise RuntimeError("expected a single model.safetensors")
    make_tokenizer(config.vocab_size).save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=16)
def _load_hf(hf_dir: str, mtime: float):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def load_hf_model(hf_dir):
    """The transformers model of a saved folder, float32 eager attention (cached per process)."""
    hf_dir = Path(hf_dir)
    stamp = max(p.stat().st_mtime for p in hf_dir.iterdir())
    return _load_hf(str(hf_dir), stamp)


@torch.no_grad()
def hf_logits(hf_dir, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [T, vocab] float32 of transformers' own forward pass over the whole sequence."""
    model = load_hf_model(hf_dir)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long).unsqueeze(0)
    out = model(input_ids=ids, use_cache=False)
    return out.logits[0].to(torch.float32)


def random_prompt(n: int, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> list[int]:
    """`n` token ids drawn uniformly, starting with BOS."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIAL_TOKENS), vocab_size, (n,), generator=gen).tolist()
    return [BOS_ID] + ids[1:]


# ---------------------------------------------------------------------------------------------
# GGUF conversion (mirrors llama.cpp convert_hf_to_gguf.py)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF rotate-half layout -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `_permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """The llama.cpp name of a Hugging Face tensor name."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        rest = ".".join(parts[3:])
        if rest in _LAYER_NAMES:
            return f"blk.{parts[2]}.{_LAYER_NAMES[rest]}"
    raise KeyError(f"no GGUF name for {hf_name}")


def _read_hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _rope_params(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from a config.json, old or new (transformers 5) style."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return float(theta), (None if rope_type == "default" else dict(rope, rope_type=rope_type))


def _llama3_rope_factors(cfg: dict, theta: float, scaling: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs.weight` for llama3 rope (LlamaModel.generate_extra_tensors)."""
    base = theta
    dim = head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = scaling.get("factor", 8.0)
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(rope_factors, dtype=np.float32)


def _add_vocab(writer, hf_dir: Path, vocab_size: int) -> None:
    """`_set_vocab_gpt2` of convert_hf_to_gguf: byte-level tokens, types, merges, special ids."""
    import gguf

    tok = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    for content, entry in added.items():
        vocab[content] = entry["id"]
    reverse = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    toktypes: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
            continue
        text = reverse[i]
        tokens.append(text)
        if text in added:
            toktypes.append(gguf.TokenType.CONTROL if added[text].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            toktypes.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # our pre-tokenizer is the GPT-2 regex + ByteLevel
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    special = gguf.SpecialVocab(hf_dir, load_merges=True)
    special.add_to_gguf(writer)


def make_gguf(hf_dir, out_path, qtype: str = "F32", *, drop: Sequence[str] = (),
              arch: str | None = None) -> Path:
    """Convert a saved HF folder (from `make_hf_model`) into a llama.cpp-style GGUF file.

    `drop` (GGUF tensor names to leave out) and `arch` (a different general.architecture)
    exist to build broken files for error-path tests.
    """
    import gguf

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    qtype = qtype.upper()
    ftypes = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
              "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
              "LEGACY": gguf.LlamaFileType.MOSTLY_Q4_1}
    if qtype not in ftypes:
        raise ValueError(f"qtype must be one of {sorted(ftypes)}, got {qtype!r}")
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    if model_type not in GGUF_ARCH:
        raise ValueError(f"cannot convert model_type {model_type!r} to GGUF")
    permute = GGUF_ARCH[model_type] == "llama"
    arch = arch or GGUF_ARCH[model_type]
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    theta, scaling = _rope_params(cfg)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_name(hf_dir.name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(ftypes[qtype])
    if qtype != "F32":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    extra: dict[str, np.ndarray] = {}
    if scaling is not None:
        rope_type = scaling["rope_type"]
        if rope_type == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(scaling["factor"]))
        elif rope_type == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(scaling["factor"]))
            writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        elif rope_type == "llama3":
            # llama.cpp writes no scaling keys for llama3; it stores per-frequency divisors instead.
            extra["rope_freqs.weight"] = _llama3_rope_factors(cfg, theta, scaling, head_dim)
        else:
            raise ValueError(f"rope type {rope_type!r} has no GGUF form here")
    # mistral sliding_window: llama.cpp's arch "llama" has no key for it, so it is dropped.

    _add_vocab(writer, hf_dir, cfg["vocab_size"])

    tensors = _read_hf_tensors(hf_dir)
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)

    def order(name: str):
        if name == "model.embed_tokens.weight":
            return (0, 0, name)
        if name.startswith("model.layers."):
            return (1, int(name.split(".")[2]), name)
        return (2, 0, name)

    for name in sorted(tensors, key=order):
        gname = gguf_tensor_name(name)
        if gname in drop:
            continue
        data = tensors[name].astype(np.float32)
        if permute and name.endswith("self_attn.q_proj.weight"):
            data = _permute(data, n_head)
        elif permute and name.endswith("self_attn.k_proj.weight"):
            data = _permute(data, n_kv)
        _add_tensor(writer, gname, data, qtype)
    for name, data in extra.items():
        writer.add_tensor(name, data)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _storage_type(gguf_name: str, shape: tuple[int, ...], qtype: str) -> str:
    """The type convert_hf_to_gguf stores a tensor as: 1-D and norms stay F32; Q8_0 needs rows of
    a multiple of 32 elements and falls back to F16 otherwise."""
    from helpers.gguf_mixes import MIXES

    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or qtype == "F32":
        return "F32"
    if qtype != "F16" and shape[-1] % 32 != 0:
        return "F16"
    return MIXES[qtype](gguf_name, shape) if qtype in MIXES else qtype


def _add_tensor(writer, name: str, data: np.ndarray, qtype: str) -> None:
    import gguf

    kind = _storage_type(name, data.shape, qtype)
    if kind == "F32":
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    elif kind == "F16":
        writer.add_tensor(name, data.astype(np.float16))
    else:  # a block type
        from helpers.gguf_mixes import encode

        q = encode(kind, data)
        # q is uint8 [rows, bytes per row]; with raw_dtype set the writer turns that byte
        # shape back into the element shape (and reverses it to ggml's order on disk).
        writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType[kind])


def roundtrip(array: np.ndarray, kind: str) -> np.ndarray:
    """What a GGUF file stored as `kind` ("F32", "F16", "Q8_0") gives back for `array`."""
    import gguf

    array = np.ascontiguousarray(array, dtype=np.float32)
    if kind == "F32":
        return array
    if kind == "F16":
        return array.astype(np.float16).astype(np.float32)
    from helpers.gguf_mixes import encode

    return gguf.quants.dequantize(encode(kind, array), gguf.GGMLQuantizationType[kind]).astype(np.float32)


def make_roundtrip_hf(hf_dir, out_dir, qtype: str) -> Path:
    """A copy of an HF folder whose weights went through `make_gguf(..., qtype)` storage and back.

    Its `hf_logits` are the exact oracle for a GGUF of that qtype: Q/K permutation commutes with
    Q8_0 (which quantizes blocks of 32 within a row, and the permutation only moves whole rows).
    """
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import save_file

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    qtype = qtype.upper()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(hf_dir, out_dir)
    for f in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as h:
            meta = h.metadata()
            arrays = {k: h.get_tensor(k) for k in h.keys()}
        for k, v in arrays.items():
            arrays[k] = roundtrip(v, _storage_type(gguf_tensor_name(k), v.shape, qtype)).astype(v.dtype)
        save_file(arrays, str(f), metadata=meta)
    return out_dir
