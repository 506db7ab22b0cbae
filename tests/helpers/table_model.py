"""A tiny-vocabulary model whose next-token logits are a fixed function of the
context, behind the real Runner contract, so sampling tests can enumerate the
target's exact distribution over whole continuations.

    target = TableRunner(vocab=4, seed=0)
    draft = TableRunner(vocab=4, seed=0, noise=0.7, noise_seed=5)   # close to the target, not equal
    logits = target.logits_for([1, 2, 3])                            # next-token logits after a context

The logits after a context depend on its last two tokens and its length, so a
runner that rolled its cache back wrongly, or fed a token twice, would emit
from a different distribution and the chi-square tests would see it.

With `features=W` the runner also returns "hidden states" (an EAGLE head's
input, backends.base.Runner): feature_layers == (0,), and take_features(seq)
gives float32 [T, W] rows for the T input rows of its latest forward / greedy
call on that sequence, each a fixed function of the context up to that row
(like the logits), then forgets them.
"""
from __future__ import annotations

import hashlib

import numpy as np

from hetero_sd.backends.base import DeviceInfo, PrecisionInfo, Runner

_PREC = PrecisionInfo("fp64", True, "table lookup")


class TableRunner(Runner):
    def __init__(self, vocab: int, seed: int, noise: float = 0.0, noise_seed: int = 1,
                 scale: float = 1.5, features: int = 0):
        self.vocab_size, self.max_context = vocab, 1 << 20
        self.device = DeviceInfo("table", "cpu", "context-hash logits", (_PREC,), "fp64")
        self.precision = _PREC
        self.seed, self.noise, self.noise_seed, self.scale = seed, noise, noise_seed, scale
        self._seqs: dict[int, list[int]] = {}
        self._next_id = 0
        self.calls = 0
        self.features = features  # the width of a feature row (0: no features)
        self.feature_layers = (0,) if features else ()
        self._taken: dict[int, np.ndarray] = {}  # seq -> the features of its latest call
        self._rows: dict[tuple, np.ndarray] = {}  # memo: the same rows recur in every draw

    def _row(self, key: tuple, seed, size: int | None = None) -> np.ndarray:
        size = self.vocab_size if size is None else size
        row = self._rows.get((seed, key, size))
        if row is None:
            digest = hashlib.sha256(repr((seed,) + key).encode()).digest()
            row = np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal(size)
            row.flags.writeable = False
            self._rows[(seed, key, size)] = row
        return row

    def features_for(self, context: list[int]) -> np.ndarray:
        """The feature row of the context's last position (float32 [features])."""
        return self._row((tuple(context[-2:]), len(context)), ("features", self.seed), self.features
                         ).astype(np.float32)

    def logits_for(self, context: list[int]) -> np.ndarray:
        key = (tuple(context[-2:]), len(context))
        row = self.scale * self._row(key, self.seed)
        if self.noise:
            row = row + self.noise * self._row(key, self.noise_seed)
        return row.astype(np.float32)

    # -- the Runner contract --------------------------------------------------------------
    def allocate(self, capacity: int) -> int:
        self._next_id += 1
        self._seqs[self._next_id] = []
        return self._next_id

    def forward(self, seq_id, tokens, start, num_logits):
        cache = self._seqs[seq_id]
        if start > len(cache):
            raise ValueError(f"start {start} beyond cached length {len(cache)}")
        del cache[start:]
        rows, feats = [], []
        for t in tokens:
            cache.append(int(t))
            rows.append(self.logits_for(cache))
            if self.features:
                feats.append(self.features_for(cache))
        self.calls += 1
        if self.features:
            self._taken[seq_id] = np.stack(feats)
        return np.stack(rows[len(rows) - num_logits:])

    def greedy(self, seq_id, tokens, start, num_logits):
        return [int(i) for i in self.forward(seq_id, tokens, start, num_logits).argmax(-1)]

    def take_features(self, seq_id):
        """The feature rows of the sequence's latest call (None: none since the last take)."""
        return self._taken.pop(seq_id, None)

    def truncate(self, seq_id, length):
        del self._seqs[seq_id][length:]

    def length(self, seq_id):
        return len(self._seqs[seq_id])

    def release(self, seq_id):
        self._seqs.pop(seq_id, None)
        self._taken.pop(seq_id, None)

    def usage(self):
        raise NotImplementedError("not needed by the engine")


def exact_joint(target: TableRunner, params, prompt: list[int], new: int) -> dict[tuple, float]:
    """P(continuation) under `params` for every continuation of `new` tokens, by enumeration
    (penalties, where params has them, by the output so far at each position)."""
    import itertools

    from hetero_sd.sampling import penalize, warp

    out = {}
    for cont in itertools.product(range(target.vocab_size), repeat=new):
        prob, ctx = 1.0, list(prompt)
        for t in cont:
            logits = target.logits_for(ctx)
            if params.penalized:
                logits = penalize(logits[None].astype(np.float32), params, list(prompt), ctx[len(prompt):], [])[0]
            prob *= warp(logits, params)[0, t]
            ctx.append(t)
        if prob > 0:
            out[cont] = prob
    return out


def chi_square_p(counts: dict[tuple, int], expected_p: dict[tuple, float], n: int) -> float:
    """p-value of emitted counts against exact probabilities; cells expected below 5 are pooled."""
    from scipy.stats import chisquare

    assert set(counts) <= set(expected_p), "emitted a continuation the target gives probability 0"
    obs, exp, rest_obs, rest_exp = [], [], 0, 0.0
    for cont, prob in expected_p.items():
        if prob * n >= 5:
            obs.append(counts.get(cont, 0))
            exp.append(prob * n)
        else:  # pool rare cells so the chi-square approximation holds
            rest_obs, rest_exp = rest_obs + counts.get(cont, 0), rest_exp + prob * n
    if rest_exp > 0:
        obs.append(rest_obs)
        exp.append(rest_exp)
    return float(chisquare(obs, exp).pvalue)


class TableTokenizer:
    """Text for the table model's ids, so a grammar can constrain it: ids 0..2 are the
    characters of `letters`, the last id is EOS. It has the fields llguidance's
    TokenizerWrapper reads (tokens as bytes, eos/bos ids, special ids, __call__) and
    the decode the engine uses for result text."""

    def __init__(self, letters: str = "abc"):
        self.letters = letters
        self.eos_token_id, self.bos_token_id = len(letters), None
        self.tokens = [c.encode() for c in letters] + [b"</s>"]
        self.special_token_ids = [self.eos_token_id]

    def __call__(self, text) -> list[int]:
        text = text.decode() if isinstance(text, bytes) else text
        return [self.letters.index(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.letters[i] if i < len(self.letters) else ("" if skip_special_tokens else "</s>")
                       for i in ids)


def exact_constrained_joint(target: TableRunner, params, prompt: list[int], new: int, pattern: str,
                            tok: TableTokenizer) -> dict[tuple, float]:
    """P(output) under `params` with the target masked by `pattern` (a regex over the
    letters), by enumeration; an independent oracle: the allowed set comes from the
    `regex` module's partial matching, not from the grammar library under test. EOS is
    allowed exactly when the text so far matches; it ends the output (not included)."""
    import regex

    from hetero_sd.sampling import warp

    def allowed(text: str) -> np.ndarray:
        ok = [regex.fullmatch(pattern, text + c, partial=True) is not None for c in tok.letters]
        return np.array(ok + [regex.fullmatch(pattern, text) is not None])

    out: dict[tuple, float] = {}

    def walk(ids: list[int], prob: float) -> None:
        if len(ids) == new:
            out[tuple(ids)] = out.get(tuple(ids), 0.0) + prob
            return
        logits = np.where(allowed(tok.decode(ids)), target.logits_for(prompt + ids), -np.inf)
        p = warp(logits, params)[0]
        for t in np.nonzero(p)[0]:
            if t == tok.eos_token_id:
                out[tuple(ids)] = out.get(tuple(ids), 0.0) + prob * p[t]
            else:
                walk(ids + [int(t)], prob * p[t])

    walk([], 1.0)
    return out


class LetterCodec:
    """One letter per id, the last id EOS; text it cannot spell goes to `unknown`."""

    def __init__(self, letters: str, unknown: int | None = None):
        self.letters, self.unknown = letters, unknown
        self.pieces = [c.encode() for c in letters] + [b"</s>"]

    def encode(self, text: str, start: bool = False) -> list[int]:
        text = text.replace("</s>", "\0")
        return [len(self.letters) if c == "\0" else self.letters.index(c) if c in self.letters else self.unknown
                for c in text]

    def decode(self, ids) -> str:
        return "".join(self.letters[i] if i < len(self.letters) else "</s>" for i in ids)


def letter_bridge():
    """Two letter vocabularies over one text, for a draft of another tokenizer."""
    from hetero_sd.drafting.cross_vocab import VocabBridge

    # target: a b c </s>; draft: b a d </s> (each spells the letter it lacks as its third)
    return VocabBridge(LetterCodec("abc", unknown=2), LetterCodec("bad", unknown=2), 4, 4)
