"""Tiny but real model files for tests, with Hugging Face transformers as the oracle.

    path = make_hf_model(tmp / "llama", "llama")          # HF folder: config.json, safetensors, tokenizer
    gguf = make_gguf(path, tmp / "llama.gguf", "Q8_0")   # llama.cpp-style GGUF of the same model
    logits = hf_logits(path, [5, 17, 42])                # [T, vocab] float32, the reference answer

Everything is deterministic for a given (variant, seed): weights come from a seeded
generator and the byte-level BPE tokenizer is trained once per process on a fixed corpus.

GGUF conversion (make_gguf, make_roundtrip_hf, the way llama.cpp's `convert_hf_to_gguf.py`
writes them) lives in gguf_convert.py; its public names are re-exported here.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Sequence

import torch

from helpers.gguf_convert import (  # noqa: F401  (re-exported: GGUF conversion lives in gguf_convert.py)
    GGUF_ARCH,
    gguf_tensor_name,
    make_gguf,
    make_roundtrip_hf,
    roundtrip,
)

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
# One per family module beyond Llama's (ir/families), each exercising what the family adds.
FAMILY_VARIANTS = ("qwen3", "qwen3-moe", "mixtral", "gemma3", "phi3", "smollm3")
# HF-only variants (llama.cpp has no form for them): dense layers among sparse ones, unnormalised top-k.
HF_ONLY_VARIANTS = ("qwen3-moe-mixed",)
NUM_EXPERTS, EXPERTS_PER_TOKEN, EXPERT_WIDTH = 4, 2, 64
# the same with rows of 256 values (the k-quant super-block) for GGUF block-type tests
WIDE_VARIANTS = ("llama-wide", "qwen2-wide")


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
    family = _family_config(variant, common)
    if family is not None:
        return family
    raise ValueError(f"unknown tiny-model variant {variant!r}; known: {', '.join(VARIANTS + WIDE_VARIANTS)}")


def _family_config(variant: str, common: dict):
    """The tiny config of a family variant (FAMILY_VARIANTS), or None."""
    import transformers as tf

    theta = {"rope_type": "default", "rope_theta": 10000.0}
    moe = dict(num_experts_per_tok=EXPERTS_PER_TOKEN)
    if variant == "qwen3":
        return tf.Qwen3Config(**common, rope_parameters=theta)
    if variant in ("qwen3-moe", "qwen3-moe-mixed"):
        mixed = variant == "qwen3-moe-mixed"
        return tf.Qwen3MoeConfig(**common, **moe, num_experts=NUM_EXPERTS, moe_intermediate_size=EXPERT_WIDTH,
                                 norm_topk_prob=not mixed, mlp_only_layers=[0] if mixed else [],
                                 rope_parameters=theta)
    if variant == "mixtral":
        return tf.MixtralConfig(**{**common, "intermediate_size": EXPERT_WIDTH}, **moe, num_local_experts=NUM_EXPERTS,
                                rope_parameters=theta)
    if variant == "gemma3":
        # Gemma's own pattern: five windowed layers then a global one (what llama.cpp assumes
        # of a GGUF), each kind with its own RoPE (the global one scaled), the score scale
        # llama.cpp also uses (1/sqrt(head_dim)), logits soft-capped.
        return tf.Gemma3TextConfig(**{**common, "tie_word_embeddings": True, "num_hidden_layers": 6},
                                   sliding_window=8,
                                   query_pre_attn_scalar=HEAD_DIM, final_logit_softcapping=10.0, pad_token_id=None,
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1000000.0},
                                                    "sliding_attention": theta})
    if variant == "phi3":
        # RoPE on half of each head, longrope factors (transformers and we agree below 64 positions).
        half = HEAD_DIM // 4
        return tf.Phi3Config(**{k: v for k, v in common.items() if k != "head_dim"}, pad_token_id=EOS_ID,
                             original_max_position_embeddings=64,
                             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5,
                                              "short_factor": [1.0 + 0.25 * i for i in range(half)],
                                              "long_factor": [2.0 + i for i in range(half)]})
    if variant == "smollm3":
        # four layers: llama.cpp runs every fourth without RoPE, as the default no_rope_layers
        return tf.SmolLM3Config(**{**common, "num_hidden_layers": 4}, pad_token_id=None, rope_parameters=theta)
    return None


def _model_class(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config


@torch.no_grad()
def _init_weights(model, seed: int, tied: bool, gemma: bool = False) -> None:
    """Deterministic weights with activations of order one and well separated logits.

    Linear weights ~ N(0, 1/fan_in) keep every residual update at unit scale; attention scores
    come out with a spread of about one (not uniform attention); norm multipliers are 1 +- 0.2
    (Gemma stores the offset from one) so a backend that ignores them fails; biases are clearly non-zero; the LM head gives logits with
    a standard deviation of about 3, so the top two logits are usually far apart.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("embed_tokens.weight"):
            # Gemma scales its (tied) embedding by sqrt(hidden) = 8: rows of 0.35 / 8 keep the
            # residual stream at the scale of the layers' updates (else every step copies its input).
            std = 0.35 / math.sqrt(HIDDEN) ** (1 if gemma else 0) if tied else 1.0
            param.copy_(torch.randn(param.shape, generator=gen) * std)
        elif name.endswith("norm.weight"):
            # Gemma stores each multiplier's offset from one; its final norm multiplies by ~8
            # so that the small tied head still gives logits of spread ~3.
            center = (7.0 if name == "model.norm.weight" else 0.0) if gemma else 1.0
            param.copy_(center + 0.2 * torch.randn(param.shape, generator=gen))
        elif name.endswith(".bias"):
            param.copy_(0.5 * torch.randn(param.shape, generator=gen))
        elif name == "lm_head.weight":
            param.copy_(torch.randn(param.shape, generator=gen) * (3.0 / math.sqrt(param.shape[1])))
        elif param.dim() in (2, 3):  # 3: a layer's experts stacked [experts, rows, cols]
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
        else:
            raise AssertionError(f"unexpected parameter {name} {tuple(param.shape)}")


def make_hf_model(out_dir, variant: str, seed: int = 0, shards: int = 1, vocab_size: int | None = None) -> Path:
    """Build, initialise and save a tiny transformers model plus tokenizer into `out_dir`.

    `vocab_size`: a tokenizer trained to that many entries (and a model to match)
    instead of VOCAB_SIZE: another vocabulary over the same corpus.

    `shards > 1` writes a sharded folder (model-0000k-of-0000n.safetensors plus
    model.safetensors.index.json) with at least two and roughly `shards` files.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _config_for(variant)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    torch.manual_seed(seed)
    model = _model_class(config)(config, dtype=torch.float32).to(torch.float32).eval()
    _init_weights(model, seed, tied=config.tie_word_embeddings, gemma=config.model_type == "gemma3_text")
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


@torch.no_grad()
def hf_generate(hf_dir, prompt: Sequence[int], n: int) -> list[int]:
    """transformers' own greedy `generate`: n new tokens, fewer where it stops at the model's
    end token (the caller compares that many of its own)."""
    from transformers import GenerationConfig

    model = load_hf_model(hf_dir)
    # The mask is given: token 0 (BOS) may also be a config's pad id.
    config = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=None, bos_token_id=None)
    ids = torch.tensor([list(prompt)])
    return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt):].tolist()


def random_prompt(n: int, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> list[int]:
    """`n` token ids drawn uniformly, starting with BOS."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIAL_TOKENS), vocab_size, (n,), generator=gen).tolist()
    return [BOS_ID] + ids[1:]
