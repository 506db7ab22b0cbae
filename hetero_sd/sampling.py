"""Acceptance: which drafts the target keeps, greedy or sampled.

Greedy (`accept_greedy`): keep drafts while they equal the target's own argmax,
then commit the target's token after them. Sampled (`Sampler.accept`):
modified rejection sampling. Both return (accepted, committed tokens), and a
cascade stage uses the same rule as the engine.

Glossary (as in ir/work.py): drafts are proposed, a prefix is *accepted*, and
one more token is committed after it: the *recovered* token when draft i was
rejected (drawn from the residual norm(max(0, p_i - q_i))), or the *bonus*
token drawn from p_k when every draft was accepted. This is the modified
rejection sampling of Leviathan et al. / Chen et al.: the committed tokens are
distributed exactly as if the target had sampled them one by one.

The same warp (temperature, then top-k, then top-p, as Hugging Face orders
them) is applied to draft and target logits, so q and p are the distributions
each model would really sample from. The n-gram drafter proposes
deterministically: its q is one-hot, so a draft x is accepted with
probability p(x) and the residual is p with x removed.

Randomness: one seed per request. Deterministic drafts (q one-hot: n-gram,
suffix decoding) are coupled to the target's own sampling: the token committed
at output position t is the inverse CDF of p_t at u_t, a uniform fixed by the
seed and t alone (`Sampler.uniform`); a draft x there is accepted exactly when
that token is x, which happens with probability p_t(x), and a rejected one is
replaced by that token, distributed as the residual. So with such drafts the
output is token for token what target-only sampling with the same seed gives,
whatever was drafted, however far, from whatever earlier requests left. Drafts
with a distribution q (draft models, heads) are drawn from the drafting stream
and accepted by the rejection rule above on the acceptance stream (both spawned
from the seed): reproducible with the same seed and the same draft lengths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hetero_sd.errors import GenerationError


# Temperatures below this decode greedily, as 0 does (vLLM's _SAMPLING_EPS): logits divided by a
# tinier one overflow (1e-310, a subnormal, makes every logit inf and the probabilities NaN), and
# any one this small puts all the mass on the argmax anyway.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or under GREEDY_BELOW) = greedy (argmax, no randomness)
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    seed: int | None = None  # None = a fresh random seed per request
    # Penalties change the target's distribution by the tokens committed so far (OpenAI's and
    # vLLM's definitions): presence and frequency count the output, repetition the prompt and
    # the output; logit_bias adds a constant per token id. Verify applies to each draft row the
    # penalty as of the tokens before it, so they hold under speculation as in target-only runs.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages repeats: positive logits divided, negative multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise GenerationError(f"{name} must be a number, got {value!r}")
        if self.temperature < 0:
            raise GenerationError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if math.isinf(self.temperature):
            raise GenerationError(f"temperature must be finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise GenerationError(f"seed must be a non-negative integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise GenerationError(f"{name} must be a number in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0 < rp <= 10:
            raise GenerationError(f"repetition_penalty must be a number in (0, 10], got {rp!r}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or \
                    isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise GenerationError(f"logit_bias maps token ids >= 0 to numbers in [-100, 100], got "
                                      f"{token!r}: {bias!r}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one under GREEDY_BELOW (every reader of the
        temperature goes by this, and `warp` gives such params the argmax one-hot)."""
        return self.temperature < GREEDY_BELOW

    def describe(self) -> str:
        text = "greedy" if self.greedy else \
            f"T={self.temperature:g} top_k={self.top_k} top_p={self.top_p:g} seed={self.seed}"
        if self.penalized:
            text += (f" presence={self.presence_penalty:g} frequency={self.frequency_penalty:g} "
                     f"repetition={self.repetition_penalty:g} bias={len(self.logit_bias)}")
        return text


def penalize(logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int],
             drafts: list[int]) -> np.ndarray:
    """The rows of a step with the penalties applied: row i follows the output plus the
    first i drafts (what target-only decoding would have committed before it), so each
    row is penalized as that one-token step would be. float32 in, float32 out."""
    out = np.array(logits, dtype=np.float32, copy=True)
    vocab = out.shape[-1]
    bias = np.zeros(vocab, dtype=np.float32)
    for token, value in params.logit_bias:
        if token < vocab:
            bias[token] += value
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=vocab)[:vocab].astype(np.float32)
    seen = np.zeros(vocab, dtype=bool)
    if params.repetition_penalty != 1:
        seen[np.asarray(prompt, dtype=np.int64)] = True
        seen[np.asarray(output, dtype=np.int64)] = True
    for i in range(out.shape[0]):
        if i:
            counts[drafts[i - 1]] += 1
            seen[drafts[i - 1]] = params.repetition_penalty != 1
        row = out[i]
        if params.repetition_penalty != 1:
            row[seen] = np.where(row[seen] > 0, row[seen] / params.repetition_penalty,
                                 row[seen] * params.repetition_penalty)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        row += bias
    return out


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float64 probabilities [n, V] from logits [n, V] (or [V]); greedy params (`SamplingParams.greedy`)
    give the argmax one-hot, never a division by a temperature under GREEDY_BELOW."""
    if params.greedy:
        x = np.atleast_2d(np.asarray(logits, dtype=np.float64))
        probs = np.zeros_like(x)
        np.put_along_axis(probs, x.argmax(axis=-1)[:, None], 1.0, axis=-1)
        return probs
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    x = np.atleast_2d(x).copy()
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k, axis=-1)[:, vocab - params.top_k][:, None]
        x[x < kth] = -np.inf  # ties with the k-th value are kept, as in transformers
    x -= x.max(axis=-1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the crossing token included).
        drop_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p >= params.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs[drop] = 0.0
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def accept_greedy(drafts: list[int], target_ids: list[int]) -> tuple[int, list[int]]:
    """target_ids[i] is the target's choice after the i-th verified token (the
    last committed one, then each draft). Returns (accepted, accepted drafts +
    the target's token after them: a correction, or the bonus when all agree)."""
    a = 0
    while a < len(drafts) and drafts[a] == target_ids[a]:
        a += 1
    return a, list(drafts[:a]) + [target_ids[a]]


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a [V] distribution by inverse CDF (one uniform per draw)."""
    return inverse_cdf(probs, rng.random())


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The token whose CDF interval (ids in order, probs normalised) holds u in [0, 1)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(probs) - 1))


UNIFORM_BLOCK = 256  # per-position uniforms are drawn this many at a time


class Sampler:
    """The per-request sampling state: params, the per-position uniforms and the two
    random streams (module docstring)."""

    def __init__(self, params: SamplingParams, mode=None):
        if params.greedy:
            raise ValueError("a Sampler is for temperature > 0; greedy decoding needs none")
        from hetero_sd.scheduler.mode import RequestMode

        self.params = params
        # how the request stands to others (scheduler/mode.py), for the drafters that read it;
        # by default as a seeded request's alone, with drafts that carry distributions
        self.mode = mode or RequestMode.of(False, params.seed, one_hot=False, concurrent=False)
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        draft_seq, accept_seq, position_seq = np.random.SeedSequence(seed).spawn(3)
        self.draft_rng = np.random.default_rng(draft_seq)
        self.accept_rng = np.random.default_rng(accept_seq)
        self._position_rng = np.random.default_rng(position_seq)
        self._uniforms = np.empty(0)

    def uniform(self, position: int) -> float:
        """u_t for output position t: the stream's t-th draw, whatever was drawn before."""
        while position >= len(self._uniforms):
            self._uniforms = np.concatenate([self._uniforms, self._position_rng.random(UNIFORM_BLOCK)])
        return float(self._uniforms[position])

    def probs(self, logits: np.ndarray) -> np.ndarray:
        return warp(logits, self.params)

    def sample_draft(self, logits: np.ndarray) -> tuple[int, np.ndarray]:
        """A draft model's token and the distribution q it came from."""
        q = self.probs(logits)[-1]
        return draw(q, self.draft_rng), q

    def draw_target(self, p: np.ndarray, position: int) -> int:
        """The target's token at output position `position` from its distribution row p."""
        return inverse_cdf(p, self.uniform(position))

    def accept(self, drafts: list[int], p: np.ndarray, q: np.ndarray | None,
               position: int) -> tuple[int, list[int]]:
        """Modified rejection sampling. p: [len(drafts)+1, V] target distributions
        (row i follows the i-th verified token); q: [len(drafts), V] draft
        distributions, or None for a deterministic drafter (q one-hot: coupled, see
        the module docstring); position: the output position of the round's first
        committed token. Returns (accepted, committed tokens = accepted drafts +
        recovered/bonus)."""
        if q is None:  # the target's own token at each position; a draft is kept where it equals it
            for i, x in enumerate(drafts):
                token = self.draw_target(p[i], position + i)
                if token != x:
                    return i, drafts[:i] + [token]
            return len(drafts), list(drafts) + [self.draw_target(p[len(drafts)], position + len(drafts))]
        rng = self.accept_rng
        for i, x in enumerate(drafts):
            q_x = 1.0 if q is None else q[i, x]
            if q_x <= 0:
                raise GenerationError(f"draft token {x} has probability 0 under its own draft distribution")
            if rng.random() * q_x < p[i, x]:  # accept with probability min(1, p/q)
                continue
            residual = p[i] - (_one_hot(x, p.shape[1]) if q is None else q[i])
            residual = np.maximum(residual, 0.0)
            if residual.sum() <= 0:  # p == q here, and then rejection has probability 0
                residual = p[i]
            return i, drafts[:i] + [draw(residual, rng)]
        return len(drafts), list(drafts) + [draw(p[len(drafts)], rng)]


def _one_hot(index: int, size: int) -> np.ndarray:
    out = np.zeros(size)
    out[index] = 1.0
    return out
