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
