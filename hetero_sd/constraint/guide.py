"""A constraint enforced token by token: the `Guide`, backed by llguidance.

Why llguidance rather than xgrammar: its wheel is 3 MB with no dependencies,
while xgrammar's pulls torch and triton (the engine never touches a tensor
library); it also has the two calls speculation needs, `validate_tokens` (how
many drafts the grammar allows) and `rollback`, and computes a mask in a few
hundred microseconds on the CPU with the GIL released. Another library fits
behind the same small interface:

    allowed() -> bool[V]       tokens allowed after everything accepted so far
    accept(token) -> bool      advance (False: the grammar refuses it)
    valid_prefix(tokens) -> n  how many of tokens the grammar allows, in order
    rollback(n)                undo the last n accepts
    finished                   the language ended: nothing but EOS may follow
    forced(after) -> tokens    what the grammar forces next (optional: [] is always right)

Constraints are hetero_sd.constraint.spec.Constraint (not imported here:
spec.py calls check_grammar). Compiled grammars are cached by (tokenizer, vocabulary, EOS ids, constraint):
a request copies the cached matcher instead of compiling again.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np

from hetero_sd.ir.errors import ConstraintError, GenerationError

_CACHE_SIZE = 64  # compiled matchers kept per tokenizer
# Whitespace between JSON tokens, as llama.cpp's schema grammars allow it: one space,
# or a newline and up to 20 spaces or tabs of indent. Unbounded whitespace (llguidance's
# own default) lets a model loop on blank lines until the token budget runs out. A
# schema's own "x-guidance" options take precedence.
JSON_DEFAULTS = {"whitespace_pattern": r"( |\n[ \t]{0,20})?"}


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # it is a base dependency; a broken install says so
        raise ConstraintError(f"constrained decoding needs the llguidance package ({exc}); "
                              "pip install llguidance") from exc
    return llguidance


def _grammar(constraint) -> str:
    """llguidance's grammar text for a constraint (no validation yet)."""
    llg = _llguidance()
    try:
        if constraint.kind in ("json_schema", "json"):
            return llg.LLMatcher.grammar_from_json_schema(constraint.schema(), defaults=JSON_DEFAULTS)
        if constraint.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(constraint.source)
        return llg.grammar_from("grammar", constraint.source)  # GBNF or Lark, told apart by syntax
    except ValueError as exc:
        raise ConstraintError(f"{constraint.where}: invalid {constraint.kind}: {_first_lines(str(exc))}") from None


def _first_lines(message: str, n: int = 4) -> str:
    """llguidance's messages carry the grammar it generated: keep the part that names the problem."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if "regex parse error:" in message:  # the regex crate's report: the problem, then where
        at = next(i for i, line in enumerate(lines) if "regex parse error:" in line)
        problem = next((line.strip()[len("error:"):].strip() for line in lines[at:]
                        if line.strip().startswith("error:")), "")
        where = [line.rstrip() for line in lines[at + 1:at + 3] if not line.strip().startswith("error:")]
        return "\n  ".join([problem] + where)
    return "\n  ".join(lines[:n])


def check_grammar(constraint, tokenizer=None) -> str:
    """The validated grammar text; a ConstraintError naming the problem otherwise."""
    grammar = _grammar(constraint)
    error = _llguidance().LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        what = {"json_schema": "JSON Schema", "json": "JSON", "regex": "regex", "grammar": "grammar"}[constraint.kind]
        raise ConstraintError(f"{constraint.where}: invalid {what}: {_first_lines(error)}")
    return grammar


class GuideCompiler:
    """Builds Guides for one tokenizer and vocabulary. `tokenizer`: a Hugging Face
    fast tokenizer, or any object with llguidance's TokenizerWrapper fields
    (tokens as bytes, eos_token_id, bos_token_id, special_token_ids, __call__)."""

    def __init__(self, tokenizer, vocab: int, eos_ids: tuple[int, ...] = ()):
        # The grammar sees every id the tokenizer has; a model whose output layer is
        # narrower (a tokenizer with added tokens past it) scores only the first
        # `vocab`, and masks are cut to the logits' width where they are applied.
        from hetero_sd.ir.tokenizer import as_transformers

        tokenizer = as_transformers(tokenizer)  # llguidance reads a transformers tokenizer's backend
        self.vocab = max(vocab, _tokenizer_size(tokenizer))
        self._tokenizer = _ll_tokenizer(tokenizer, self.vocab, tuple(sorted(eos_ids)))
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    def guide(self, constraint) -> "Guide":
        """A fresh Guide; safe from several threads (a compile runs outside the cache's lock)."""
        key = (constraint.kind, constraint.source)
        with self._lock:
            matcher = self._compiled.get(key)
        if matcher is None:
            constraint.check()  # the user's errors, worded as at load (jsonschema's, then llguidance's)
            grammar = check_grammar(constraint, self._tokenizer)
            matcher = _llguidance().LLMatcher(self._tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise ConstraintError(f"{constraint.where}: {_first_lines(matcher.get_error())}")
        with self._lock:
            self._compiled[key] = matcher
            self._compiled.move_to_end(key)
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
            return Guide(matcher.deep_copy(), self.vocab, constraint)


_TOKENIZERS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def _tokenizer_size(tokenizer) -> int:
    """Ids the tokenizer can produce: added tokens included (len() of a Hugging Face tokenizer)."""
    tokens = getattr(tokenizer, "tokens", None)
    return len(tokens) if tokens is not None else len(tokenizer)


def _ll_tokenizer(tokenizer, vocab: int, eos_ids: tuple[int, ...]):
    """llguidance's view of the tokenizer (about a second to build: cached per tokenizer)."""
    per = _TOKENIZERS.setdefault(tokenizer, {})
    key = (vocab, eos_ids)
    if key not in per:
        llg = _llguidance()
        eos = list(eos_ids) or None
        if hasattr(tokenizer, "backend_tokenizer"):
            import llguidance.hf

            per[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        else:
            per[key] = llg.LLTokenizer(llg.TokenizerWrapper(tokenizer), n_vocab=vocab, eos_token=eos)
    return per[key]


class Guide:
    """One request's grammar state. Not thread-safe: one caller at a time."""

    def __init__(self, matcher, vocab: int, constraint):
        self._m, self.vocab, self.constraint = matcher, vocab, constraint
        self._words = (vocab + 31) // 32

    def allowed(self) -> np.ndarray:
        return self.allowed_rows(1)[0]

    def allowed_rows(self, n: int, walk: list[int] = ()) -> np.ndarray:
        """bool [n, V]: row i is the mask after accepting walk[:i] (then undone)."""
        bits = np.empty((n, self._words), dtype=np.int32)
        with self.walking() as step:
            for i in range(n):
                self._m.unsafe_compute_mask_ptr(bits[i].ctypes.data, bits[i].nbytes)
                if i + 1 < n:
                    step(walk[i])
        return np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[:, :self.vocab].view(bool)

    @contextmanager
    def walking(self):
        """step(token) advances over tokens the caller knows are allowed; all undone on exit."""
        done = 0

        def step(token: int) -> None:
            nonlocal done
            if not self.accept(token):
                raise GenerationError(f"internal: the grammar refused token {token} it had allowed")
            done += 1
        try:
            yield step
        finally:
            self.rollback(done)

    def accept(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar refuses it.
        Checked first: llguidance's matcher never leaves the error state a refused
        token puts it in, and this guide is shared with the request's drafter."""
        token = int(token)
        return self._m.validate_tokens([token]) == 1 and bool(self._m.consume_token(token))

    def valid_prefix(self, tokens: list[int]) -> int:
        return int(self._m.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def forced(self, after: list[int] = ()) -> list[int]:
        """The tokens the grammar forces next (its only continuation, tokenized), maybe
        none; `after`: past these allowed tokens (the state is left as it was)."""
        with self.walking() as step:
            for token in after:
                step(token)
            return [] if self._m.is_stopped() else [int(t) for t in self._m.compute_ff_tokens()]

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(n):
            raise GenerationError(f"internal: the grammar could not roll back {n} tokens")

    @property
    def finished(self) -> bool:
        return bool(self._m.is_stopped())


def mask_logits(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Logits with every disallowed token at -inf (rows and widths must match, or
    `allowed` be wider: a restricted draft head scores only the first ids)."""
    allowed = allowed[..., :logits.shape[-1]]
    if not allowed.any(axis=-1).all():
        raise GenerationError("the constraint allows no token this model can produce here")
    return np.where(allowed, logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)
