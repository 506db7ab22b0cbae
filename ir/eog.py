"""End of generation (EOG): every token id at which decoding stops.

A chat model ends its turn with a token that is often not the file's EOS:
Llama 3's <|eot_id|>, Gemma's <end_of_turn>, Qwen's <|im_end|>. Stopping only at
EOS runs past the turn. The set here is llama.cpp's EOG set, built as
llama.cpp builds it (src/llama-vocab.cpp, `llama_vocab::impl::load`, the
"special tokens" block; ggml-org/llama.cpp at 00ad355e), plus what
transformers stops at and the chat template's end of turn:

1. GGUF metadata: tokenizer.ggml.eos_token_id, eot_token_id, eom_token_id and
   fim_pad/fim_rep/fim_sep_token_id. llama.cpp puts all six in its EOG set; an
   id outside the vocabulary is ignored, as there. (ir/families/llama.py puts
   them in ModelConfig.eos_token_ids.)
2. config.json's `eos_token_id` and generation_config.json's (an int or a
   list): transformers' `generate` stops at each.
3. The tokenizer's eos_token.
4. Vocabulary texts: every token whose text is in llama.cpp's list of
   end-of-generation texts (EOG_TEXTS), and for each FIM kind (pad, repo, file
   separator) the token llama.cpp detects by its text (FIM_TEXTS). llama.cpp
   also detects an EOT and an EOM token by text; every text it looks for there
   is in EOG_TEXTS too, so that adds nothing here.
5. The chat template's end of turn: the special token the template emits right
   after an assistant message's content (ChatML's <|im_end|>, Command-R's
   <|END_OF_TURN_TOKEN|>), whitespace between them allowed (Llama 2 writes
   ' ' + eos_token).
6. Then llama.cpp's two exclusions over the whole set: <|end|> goes where
   <|return|> and <|call|> (or <|calls|> and <|flush|>) are there (gpt-oss's
   harmony and Solar-Open, where <|end|> ends a message, not the reply), and
   </s> goes where <|tool_response> is there (Gemma 4, PaddleOCR).

Differences from llama.cpp's set beyond the additions above:
- llama.cpp looks for a FIM token's text only where the metadata names no such
  id; we always look (ModelConfig keeps ids, not which key named them). The two
  differ only where a file's FIM metadata names a token other than its own FIM
  text.
- where several texts of one FIM kind are in a vocabulary, llama.cpp takes
  whichever its hash map yields first; we take the lowest id.
- a GGUF without tokenizer.ggml.eos_token_id gets no default EOS here
  (llama.cpp assumes one per tokenizer type, e.g. 2 for SentencePiece).

Everything here is a function of metadata, vocabulary and template (no tensor
library). `eog_ids(model, tokenizer)` is the set an Engine stops at
(hetero_sd/build.py); `describe_eog(model, tokenizer)` explains it, one
(id, text, source) row per id.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Iterable, Mapping

# llama.cpp's end-of-generation texts (src/llama-vocab.cpp: "maintain a list of tokens that
# cause end-of-generation"), in its order, with its comments.
EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",  # o200k_harmony
    "<|call|>",  # o200k_harmony
    "<|flush|>",  # solar-open
    "<|calls|>",  # solar-open
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",  # paddleocr
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",  # Kimi-K2
    "[EOS]",  # Kimi-K2
    "<|end_of_text|>",
    "<end_of_utterance>",  # smoldocling
    "<eos>",  # gemma4
    "<turn|>",  # gemma4
    "<|tool_response>",  # gemma4
    "<｜end▁of▁sentence｜>",  # deepseek-ocr
    "[e~[",  # minimax-m2/m3
)

# The FIM tokens llama.cpp finds by text and adds to its EOG set (pad, repo, file separator).
FIM_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}

# The GGUF metadata keys whose ids llama.cpp puts in its EOG set.
GGUF_KEYS = tuple(f"tokenizer.ggml.{kind}_token_id" for kind in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep"))

# Sentinel message contents for finding the template's end of turn.
_USER, _ASSISTANT = "hsd-eog-probe-user", "hsd-eog-probe-reply"


# ---------------------------------------------------------------- the parts
def gguf_end_ids(fields: Mapping, vocab_size: int) -> dict[str, int]:
    """{GGUF key: id} of the end ids a GGUF's metadata names (GGUF_KEYS), in that
    order; ids outside 0..vocab_size-1 are left out, as llama.cpp ignores them."""
    out = {}
    for key in GGUF_KEYS:
        value = fields.get(key)
        if value is not None and 0 <= int(value) < vocab_size:
            out[key] = int(value)
    return out


def id_list(value) -> tuple[int, ...]:
    """A config's eos_token_id (None, an int, or a list of ints) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value if v is not None)
    return (int(value),)


def generation_config_ids(folder: str | Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id in a Hugging Face folder (() where there is none)."""
    path = Path(folder) / "generation_config.json"
    try:
        return id_list(json.loads(path.read_text()).get("eos_token_id"))
    except (OSError, ValueError, TypeError, AttributeError):  # absent, unreadable or not an object
        return ()


def gguf_end_keys(path: str | Path) -> dict[str, int]:
    """The GGUF_KEYS a GGUF file's metadata holds, {key: id}, read from its header alone (for
    labelling; ModelConfig keeps the ids, not the keys). Arrays are stepped over, not read."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar types
    ints = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
    out = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF" or struct.unpack_from("<I", m, 4)[0] < 2:  # GGUF v1 counted in u32
            return out
        (count,), off = struct.unpack_from("<Q", m, 16), 24

        def skip(kind: int, off: int) -> int:
            if kind == 8:  # a string: u64 length, bytes
                return off + 8 + struct.unpack_from("<Q", m, off)[0]
            if kind == 9:  # an array: u32 item type, u64 count, items
                item, n = struct.unpack_from("<IQ", m, off)
                off += 12
                if item in sizes:
                    return off + n * sizes[item]
                for _ in range(n):
                    off = skip(item, off)
                return off
            return off + sizes[kind]

        for _ in range(count):
            (n,) = struct.unpack_from("<Q", m, off)
            key = bytes(m[off + 8:off + 8 + n]).decode("utf-8", "replace")
            (kind,) = struct.unpack_from("<I", m, off + 8 + n)
            off += 12 + n
            if key in GGUF_KEYS and kind in ints:
                out[key] = struct.unpack_from(ints[kind], m, off)[0]
            off = skip(kind, off)
    return out


def vocab_end_ids(vocab: Mapping[str, int]) -> dict[int, str]:
    """{id: why} of the tokens llama.cpp finds by their text: every EOG_TEXTS entry in the
    vocabulary, and for each FIM kind the lowest id whose text is one of FIM_TEXTS[kind]."""
    out = {vocab[text]: "llama.cpp end-of-generation text" for text in EOG_TEXTS if text in vocab}
    for kind, texts in FIM_TEXTS.items():
        found = sorted(vocab[text] for text in texts if text in vocab)
        if found:
            out.setdefault(found[0], f"llama.cpp {kind} text")
    return out


def template_end_token(render, special: Mapping[str, int]) -> int | None:
    """The id of the special token a chat template emits right after an assistant
    message's content (None: none does, or the template cannot be rendered).
    render(messages) -> the template's text for them (without a generation prompt);
    special: {text: id} of the vocabulary's special tokens."""
    conversations = (
        [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": _USER},
         {"role": "assistant", "content": _ASSISTANT}],
    )
    for messages in conversations:
        try:
            text = render(messages)
        except Exception:  # templates raise on conversations they do not take (jinja2 errors, ValueError)
            continue
        if not isinstance(text, str) or _ASSISTANT not in text:
            continue
        rest = text[text.rindex(_ASSISTANT) + len(_ASSISTANT):].lstrip()
        matches = [t for t in special if t and rest.startswith(t)]
        return special[max(matches, key=len)] if matches else None
    return None


def llama_cpp_exclusions(texts: Mapping[int, str]) -> set[int]:
    """The ids llama.cpp takes out of an EOG set whose token texts are `texts` ({id: text})."""
    have = set(texts.values())
    out = set()
    has_call = "<|call|>" in have or "<|calls|>" in have
    if "<|end|>" in have and has_call and ("<|return|>" in have or "<|flush|>" in have):
        out |= {i for i, t in texts.items() if t == "<|end|>"}
    if "<|tool_response>" in have and "</s>" in have:
        out |= {i for i, t in texts.items() if t == "</s>"}
    return out


# ---------------------------------------------------------------- the tokenizer's side
def _known_texts(tokenizer) -> dict[str, int]:
    """{text: id} of the EOG_TEXTS and FIM_TEXTS entries the tokenizer's vocabulary holds (looked
    up one by one: a whole vocabulary costs ~20 ms to copy at start-up for 49k entries)."""
    texts = EOG_TEXTS + tuple(t for group in FIM_TEXTS.values() for t in group)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        found = {t: backend.token_to_id(t) for t in texts}
    else:
        vocab = tokenizer.get_vocab()
        found = {t: vocab.get(t) for t in texts}
    return {t: int(i) for t, i in found.items() if i is not None}


def _token_text(tokenizer, i: int) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.id_to_token(i) if backend is not None else tokenizer.convert_ids_to_tokens(i)
    return text or ""


def _special_tokens(tokenizer) -> dict[str, int]:
    """{text: id} of the tokenizer's special added tokens (as the `tokenizers` library marks them)."""
    added = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        added = backend.get_added_tokens_decoder()
    if added is None:
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {tok.content: int(i) for i, tok in added.items() if getattr(tok, "special", False)}


def _template_end(tokenizer) -> int | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    render = lambda messages: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return template_end_token(render, _special_tokens(tokenizer))


# ---------------------------------------------------------------- the set
def end_of_generation(config, tokenizer=None, config_source: str = "model config",
                      generation_ids: Iterable[int] = ()) -> list[tuple[int, str, str]]:
    """(id, text, source) of every end-of-generation token, by id. config: a
    ModelConfig (its eos_token_ids, labelled `config_source`); tokenizer: the model's
    (vocabulary, eos_token, chat template; None: config ids alone); generation_ids:
    generation_config.json's ids. Ids outside the model's vocabulary are left out."""
    limit = config.vocab_size
    sources: dict[int, list[str]] = {}

    def add(i, why):
        if i is not None and 0 <= int(i) < limit:
            sources.setdefault(int(i), [])
            if why not in sources[int(i)]:
                sources[int(i)].append(why)

    for i in config.eos_token_ids:
        add(i, config_source)
    for i in generation_ids:
        add(i, "generation_config.json eos_token_id")
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None), "tokenizer eos_token")
        for i, why in vocab_end_ids(_known_texts(tokenizer)).items():
            add(i, why)
        add(_template_end(tokenizer), "chat template end of turn")
    texts = {i: _token_text(tokenizer, i) if tokenizer is not None else "" for i in sources}
    for i in llama_cpp_exclusions(texts):
        del sources[i]
    return [(i, texts.get(i, ""), ", ".join(sources[i])) for i in sorted(sources)]


def _model_parts(model):
    """(ModelConfig, label of its eos ids, generation_config.json ids) of a ModelIR or a ModelConfig."""
    config = getattr(model, "config", model)
    fmt, source = getattr(model, "fmt", None), getattr(model, "source", None)
    if fmt == "hf" and source is not None:
        return config, "config.json eos_token_id", generation_config_ids(source)
    if fmt == "gguf":
        return config, "GGUF metadata", ()
    return config, "model config", ()


def _entries(model, tokenizer, gguf_keys: bool) -> list[tuple[int, str, str]]:
    config, label, generation = _model_parts(model)
    rows = end_of_generation(config, tokenizer, label, generation)
    if not gguf_keys or getattr(model, "fmt", None) != "gguf":
        return rows
    try:  # name the metadata key of each id (display only: the set is the same either way)
        keys = gguf_end_ids(gguf_end_keys(model.source), config.vocab_size)
    except (OSError, ValueError, KeyError, IndexError, RecursionError, struct.error):  # the generic label stays
        return rows
    named = {}
    for key, i in keys.items():
        named.setdefault(i, []).append(key)
    return [(i, text, source.replace(label, ", ".join(named[i]), 1) if i in named else source)
            for i, text, source in rows]


def describe_eog(model, tokenizer=None) -> list[tuple[int, str, str]]:
    """Why generation stops where it does: one (id, token text, sources) row per
    end-of-generation id, by id; sources are comma-separated. model: a ModelIR (a
    Hugging Face folder's generation_config.json is read too; a GGUF's header, to name
    the metadata key of each id) or a ModelConfig. tokenizer: the model's (None: the
    config's ids alone)."""
    return _entries(model, tokenizer, gguf_keys=True)


def eog_ids(model, tokenizer=None) -> tuple[int, ...]:
    """The ids an Engine stops at (Engine.eos_ids), sorted: describe_eog's, without
    re-reading a GGUF's header."""
    return tuple(i for i, _, _ in _entries(model, tokenizer, gguf_keys=False))
