"""A tokenizer read straight from a saved fast tokenizer (tokenizer.json,
tokenizer_config.json, the chat template), without importing transformers.

Importing transformers costs about 3 s on a 2-core host (it imports torch and
indexes every model it knows), more than the rest of a warm start. The
encode, decode and chat-template calls an engine makes are what transformers'
fast tokenizer does itself: the `tokenizers` library's encode and decode, and
the chat template rendered by jinja2 in the sandbox transformers uses, with
the same filters and globals. tests/ir/test_tokenizer.py proves them equal to
transformers' on the shipped models. Anything else is asked of the full
transformers tokenizer, loaded the first time it is needed; libraries that
need that object itself get it from `transformers_tokenizer()`.

Folders whose configuration asks for behaviour this does not reproduce
(space clean-up on decode, BOS/EOS added by the tokenizer class) are loaded
by transformers instead (`load` returns None).
"""
from __future__ import annotations

import functools
import json
import numbers
from datetime import datetime
from pathlib import Path

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Configuration keys that change what transformers computes beyond the tokenizer.json.
_NOT_REPRODUCED = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "do_lower_case")


def load(folder: Path) -> "FastTokenizer | None":
    """The light tokenizer of a saved folder, or None where transformers must load it."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").exists() or not (folder / "tokenizer_config.json").exists():
        return None
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if config.get("clean_up_tokenization_spaces") or any(config.get(k) for k in _NOT_REPRODUCED):
        return None
    return FastTokenizer(folder, config)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class FastTokenizer:
    def __init__(self, folder: Path, config: dict):
        from tokenizers import Tokenizer

        self.folder, self._config = folder, config
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._tok.no_padding()
        self._tok.no_truncation()
        template = folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.exists() else config.get("chat_template")
        self.special_tokens_map = {k: _token_text(config[k]) for k in _SPECIAL if config.get(k) is not None}
        self._full = None

    # ---------------------------------------------------------------- what an engine asks
    def __call__(self, text: str, add_special_tokens: bool = True) -> "_Encoding":
        return _Encoding(input_ids=self.encode(text, add_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """ids: a list, an array or tensor, or one id (as transformers takes them)."""
        ids = [int(ids)] if isinstance(ids, numbers.Integral) or getattr(ids, "ndim", 1) == 0 else [int(i) for i in ids]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self._tok.token_to_id(text)

    eos_token_id = property(lambda self: self._special_id("eos_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))
    eos_token = property(lambda self: self.special_tokens_map.get("eos_token"))
    bos_token = property(lambda self: self.special_tokens_map.get("bos_token"))

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    backend_tokenizer = property(lambda self: self._tok)  # the `tokenizers` object, as transformers names it

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids):
        return self._tok.id_to_token(ids) if isinstance(ids, int) else [self._tok.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            tools=None, documents=None, **kwargs):
        """transformers' rendering: the template over the messages, tools, documents and
        named special tokens; tokenized without adding special tokens (the template has them)."""
        if not self.chat_template:
            raise ValueError(f"{self.folder}: this tokenizer has no chat template")
        text = _compiled(self.chat_template).render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ---------------------------------------------------------------- everything else
    def transformers_tokenizer(self):
        """The same folder loaded by transformers (for libraries that need its object)."""
        if self._full is None:
            from transformers import AutoTokenizer

            self._full = AutoTokenizer.from_pretrained(str(self.folder))
        return self._full

    def __getattr__(self, name: str):
        if name.startswith("_"):  # never delegate private names (copy/pickle probe them)
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)


class _Encoding(dict):
    """What calling a transformers tokenizer returns, as far as callers read it: enc["input_ids"]
    or enc.input_ids."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def as_transformers(tokenizer):
    """A transformers tokenizer for libraries that take nothing else."""
    return tokenizer.transformers_tokenizer() if isinstance(tokenizer, FastTokenizer) else tokenizer


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template in transformers' sandbox: trim_blocks, lstrip_blocks, loop controls, its
    tojson / raise_exception / strftime_now / dict / namespace, and the {% generation %} tag
    (which marks assistant text; rendering keeps the text)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_keep"), [], [], body).set_lineno(lineno)

        def _keep(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    return env.from_string(template)
