"""The cost model of speculative decoding: what a round costs and what it yields.

Glossary (the names below follow it):
  alpha     per-token acceptance: the chance the target agrees with a draft
            token, given it agreed with all earlier ones in the round.
  k         drafts proposed in a round; k = 0 is target-only (one decode).
  hit rate  fraction of rounds in which the drafter proposes anything (the
            n-gram drafter finds no match in the others; a draft model: 1).
  round     draft k tokens, verify them plus the last committed token in one
            target call of width k + 1, commit the accepted drafts + a bonus.

Standard model (Leviathan et al. 2023): a round with k drafts commits
E(k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha) tokens on
average (k + 1 when alpha = 1) and costs D(k) + V(k + 1), the drafter's time
for k tokens plus the target's verify of width k + 1. Tokens/s = E / time.

Pure Python: the scheduler reasons over numbers and never touches a tensor.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Literal

from hetero_sd.ir.work import DraftPrices
from hetero_sd.scheduler import overlap as _overlap


@dataclass(frozen=True, order=True)
class Placement:
    """Where a model runs: a backend, one of its devices, a precision."""

    backend: str
    device: str
    precision: str

    @property
    def device_key(self) -> str:
        """What fails together: one device of one backend ("onnxruntime:cpu")."""
        return f"{self.backend}:{self.device}"

    def __str__(self) -> str:
        return f"{self.backend}:{self.device}/{self.precision}"

    @classmethod
    def parse(cls, text: str) -> "Placement":
        """"backend:device/precision", the form str() writes."""
        head, slash, precision = text.partition("/")
        backend, colon, device = head.partition(":")
        if not (slash and colon and backend and device and precision):
            raise ValueError(f"expected a placement like 'torch:cpu/fp32', got {text!r}")
        return cls(backend, device, precision)


@dataclass(frozen=True)
class CostCurve:
    """Seconds as a function of a token count, from measured points.

    Linear between points; below the first point, the first point's cost (a
    call never gets cheaper than the smallest one measured); beyond the last,
    the last segment's slope (never negative: measurement noise must not make
    longer calls cheaper); a single point is a constant.
    """

    points: tuple[tuple[int, float], ...]  # (tokens >= 1, seconds >= 0), tokens strictly increasing
    _sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _suffix_min: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _at: dict = field(init=False, repr=False, compare=False)  # measured sizes: the hot path is a lookup

    def __post_init__(self):
        pts = tuple((int(n), float(s)) for n, s in self.points)
        if not pts:
            raise ValueError("a cost curve needs at least one measured point")
        for (n0, _), (n1, _) in zip(pts, pts[1:]):
            if n1 <= n0:
                raise ValueError(f"cost curve sizes must increase strictly, got {[n for n, _ in pts]}")
        if pts[0][0] < 1 or any(not math.isfinite(s) or s < 0 for _, s in pts):
            raise ValueError(f"cost curve points need tokens >= 1 and finite seconds >= 0, got {pts}")
        suffix = [s for _, s in pts]
        for i in range(len(suffix) - 2, -1, -1):
            suffix[i] = min(suffix[i], suffix[i + 1])
        object.__setattr__(self, "points", pts)
        object.__setattr__(self, "_sizes", tuple(n for n, _ in pts))
        object.__setattr__(self, "_suffix_min", tuple(suffix))
        object.__setattr__(self, "_at", dict(pts))

    @classmethod
    def affine(cls, fixed_s: float, per_token_s: float) -> "CostCurve":
        """fixed + per_token * n (two points; extrapolated linearly beyond)."""
        return cls(((1, fixed_s + per_token_s), (2, fixed_s + 2 * per_token_s)))

    def __call__(self, n: int) -> float:
        exact = self._at.get(n)
        if exact is not None:
            return exact
        pts = self.points
        if n <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        i = bisect.bisect_left(self._sizes, n)
        if i < len(pts):
            (n0, s0), (n1, s1) = pts[i - 1], pts[i]
            return s0 + (s1 - s0) * (n - n0) / (n1 - n0) if n != n1 else s1
        (n0, s0), (n1, s1) = pts[-2], pts[-1]
        return s1 + max(0.0, (s1 - s0) / (n1 - n0)) * (n - n1)

    def min_from(self, n: int) -> float:
        """A lower bound on the cost of every size >= n (exact up to the last
        point: a piecewise-linear curve is lowest at an end or a breakpoint;
        beyond the last point it never decreases)."""
        i = bisect.bisect_right(self._sizes, n)
        rest = self._suffix_min[i] if i < len(self._sizes) else math.inf
        return min(self(n), rest)


@dataclass(frozen=True)
class DeviceProfile:
    """One model measured on one placement (built by hetero_sd.profiler)."""

    model: str  # which model file, as the profiler names it
    placement: Placement
    prefill: CostCurve  # seconds to prefill n prompt tokens
    decode_s: float  # one one-token step at a short context (a draft step)
    verify: CostCurve  # seconds of one target call scoring w tokens (w = k + 1)
    exact: bool = True  # batch-invariant: speculative output equals target-only bit for bit
    # its runner's submit returns before the device is done (a CUDA stream): a drafter on
    # another device can draft the next round meanwhile (scheduler/overlap.py)
    asynchronous: bool = False

    def __post_init__(self):
        if not (math.isfinite(self.decode_s) and self.decode_s > 0) or self.verify(1) <= 0:
            raise ValueError(f"{self.placement}: decode and verify costs must be positive")


@dataclass(frozen=True)
class RoundCost:
    """What one round costs on a fixed placement: D(k), the drafter's time to
    propose k tokens (k >= 1), and V(w), the target's verify of w tokens."""

    verify: CostCurve
    draft: CostCurve = CostCurve(((1, 0.0),))
    # Seconds per round on the link to a drafter on another node (a request out, the draft
    # back: cluster/link.py); 0 in one process or host.
    link: float = 0.0
    # The drafter pre-drafts round r+1 during round r's verify (overlap.decide said so):
    # priced by overlap.round_seconds, which needs the acceptance (seconds' alpha).
    overlap: bool = False

    def seconds(self, k: int, hit: float = 1.0, alpha: float | None = None) -> float:
        """Expected time of a round asking for k drafts (k = 0: one target decode).
        A miss (no drafts) still pays the drafter's lookup, then verifies 1 token.
        With the overlap (and alpha given) the pre-draft of k + 1 tokens runs during
        the verify and is used when every draft and the bonus guess hold."""
        if k == 0:
            return self.verify(1)
        verify = self.link + hit * self.verify(k + 1) + (1.0 - hit) * self.verify(1)
        if self.overlap and alpha is not None:
            used = hit * _overlap.hit_rate(alpha, k)
            return _overlap.round_seconds(verify, self.draft(k), self.draft(k + 1), used)
        return self.draft(k) + verify

    def seconds_ahead(self, alpha: float, k: int, hit: float = 1.0) -> float:
        """The same with the drafter working ahead (mode: async): while the target
        verifies, it drafts on from its own guess, so a round whose k drafts were all
        kept finds the next ones ready (it pays only the link), and only a rejection
        makes it draft after the reply; drafting ahead longer than a verify shows."""
        if k == 0:
            return self.verify(1)
        d, v = self.draft(k), hit * self.verify(k + 1) + (1.0 - hit) * self.verify(1)
        kept = alpha ** k
        return self.link + v + (1.0 - kept) * d + kept * max(0.0, d - v)

    def prices(self, k_max: int) -> DraftPrices:
        """Each draft's verify row and a draft step, in decode steps (DraftPrices)."""
        step = self.verify(1)
        if step <= 0:
            return DraftPrices((0.0,) * k_max, 0.0)
        rows = tuple(max(0.0, self.verify(i + 2) - self.verify(i + 1)) / step for i in range(k_max))
        return DraftPrices(rows, self.draft(1) / step)

    def rate(self, alpha: float, k: int, hit: float = 1.0) -> float:
        """Expected committed tokens per second with k drafts per round."""
        return tokens_per_round(alpha, k, hit) / self.seconds(k, hit, alpha)

    def _bound(self, alpha: float, k: int, k_max: int, hit: float) -> float:
        """Upper bound on rate(k') for every k' in k..k_max: the numerator grows
        with k' up to its value at k_max; the denominator is at least the
        minima of D and V over the remaining sizes (both monotone in floats)."""
        # With the overlap a round lasts at least its verify (the draft may hide in it).
        drafting = 0.0 if self.overlap else self.draft.min_from(k)
        low = drafting + self.link + hit * self.verify.min_from(k + 1) + (1.0 - hit) * self.verify(1)
        # The margin covers a last-ulp wobble of pow(); it can only make the bound looser.
        return tokens_per_round(alpha, k_max, hit) / low * (1 + 1e-12) if low > 0 else math.inf

    def best_k(self, alpha: float, k_max: int, hit: float = 1.0, k_min: int = 0) -> tuple[int, float, int]:
        """argmax of rate over k in k_min..k_max, ties to the smaller k.

        Branch and bound, provably equal to trying every k: k is tried in
        increasing order and the search stops once the bound on every larger
        k is no better than the best so far (a later tie would lose to the
        smaller k anyway). Returns (k, rate, how many k were evaluated).
        """
        if not 0 <= k_min <= k_max:
            raise ValueError(f"need 0 <= k_min <= k_max, got {k_min}, {k_max}")
        best_k, best, evaluated = k_min, self.rate(alpha, k_min, hit), 1
        for k in range(k_min + 1, k_max + 1):
            if self._bound(alpha, k, k_max, hit) <= best:
                break
            value = self.rate(alpha, k, hit)
            evaluated += 1
            if value > best:
                best_k, best = k, value
        return best_k, best, evaluated


def expected_tokens(alpha, k: int) -> float:
    """Expected tokens a round with k drafts commits (accepted drafts + the bonus).

    alpha: one per-token acceptance for every position (the geometric model),
    or a sequence of per-position acceptances h_1, h_2, ... (draft i accepted
    given drafts 1..i-1 were; the last value repeats past its end):
    1 + sum over j <= k of h_1 * ... * h_j. Either way non-decreasing in k."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not isinstance(alpha, (int, float)):
        hs = tuple(alpha)
        if not hs or not all(0.0 <= h <= 1.0 for h in hs):
            raise ValueError(f"per-position acceptances must be in [0, 1], got {hs}")
        total, survive = 1.0, 1.0
        for j in range(k):
            survive *= hs[min(j, len(hs) - 1)]
            total += survive
        return total
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def tokens_per_round(alpha: float, k: int, hit: float = 1.0) -> float:
    """Rounds that find no drafts commit the bonus token only."""
    if k == 0:
        return 1.0
    return hit * expected_tokens(alpha, k) + (1.0 - hit)


DRAFT_KINDS = ("ngram", "suffix", "model", "head", "hybrid", "cascade")
MODEL_FREE = ("ngram", "suffix")  # no device of their own: a lookup on the host's CPU


@dataclass(frozen=True)
class DraftOption:
    """A candidate drafter with its acceptance estimate.

    ngram, suffix: a lookup per round (round_s) on the host's CPU, proposing on
    `hit_rate` of rounds. model: a draft model measured on a placement (one
    decode step per draft token). head: an EAGLE-3 head on the target's own
    placement (profile = the target's), a step estimated, not measured; it reads
    the verify's hidden states, so it cannot pre-draft. hybrid: suffix where the
    match is long, else its head or draft model (priced as the latter, plus the
    lookup). cascade: an intermediate model (profile) verifying an inner drafter
    (`via`) and drafting for the target, a draft token priced at the stage's own
    speculative decode time (step_s). process "worker": the drafter in its own
    process, one transport round trip (link_s) a round."""

    kind: Literal["ngram", "suffix", "model", "head", "hybrid", "cascade"]
    alpha: float
    profile: DeviceProfile | None = None  # where it computes (model-free kinds: none)
    round_s: float = 0.0  # per-round overhead (the lookup; a draft model's catch-up)
    hit_rate: float = 1.0
    step_s: float | None = None  # seconds per draft token; None: the profile's one-token step
    process: Literal["inproc", "worker"] = "inproc"
    link_s: float = 0.0  # per round: a worker's transport round trip
    predrafts: bool = True  # can draft round r+1 before round r's verify returns (a head cannot)
    via: str = ""  # hybrid: "head" or "model"; cascade: the inner drafter's label
    estimated: bool = False  # step_s is an estimate (explain says so)
    # cascade: the option one level in (a cascade of the next stage, or the innermost
    # drafter), so placement: auto can build every level the plan chose, not only the outermost
    inner: "DraftOption | None" = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"drafter kind must be one of {', '.join(DRAFT_KINDS)}, got {self.kind!r}")
        if (self.kind in MODEL_FREE) == (self.profile is not None):
            raise ValueError(f"a {self.kind} option {'takes no' if self.kind in MODEL_FREE else 'needs a'} profile")
        if self.kind == "head" and self.predrafts:
            raise ValueError("a head reads the verify's hidden states: it cannot pre-draft (predrafts=False)")
        if not 0.0 <= self.alpha <= 1.0 or not 0.0 <= self.hit_rate <= 1.0 or self.round_s < 0 \
                or self.link_s < 0 or (self.step_s is not None and self.step_s < 0):
            raise ValueError(f"alpha and hit_rate must be in [0, 1], costs >= 0, got {self}")

    @property
    def placement(self) -> Placement | None:
        return self.profile.placement if self.profile is not None else None

    @property
    def device(self) -> str:
        """Where its drafting computes, as overlap.decide compares devices. A worker on
        the CPU has cores of its own (drafter.cpus), so it never shares the engine's;
        a worker on an accelerator shares that device with anything else on it."""
        where = self.profile.placement.device if self.profile is not None else "cpu"
        return "worker:cpu" if self.process == "worker" and where.lower() == "cpu" else where

    def draft_curve(self) -> CostCurve:
        per_token = self.step_s if self.step_s is not None else \
            self.profile.decode_s if self.profile is not None else 0.0
        return CostCurve.affine(self.round_s, per_token)

    def prefill_s(self, prompt_tokens: int) -> float:
        """A draft model (or stage) reads the prompt too, in its first round; a head
        reads the target's hidden states and a lookup nothing: 0."""
        return self.profile.prefill(prompt_tokens) if self.kind in ("model", "cascade") or \
            (self.kind == "hybrid" and self.via == "model") else 0.0

    def __str__(self) -> str:
        at = f"@{self.placement}" if self.placement is not None else ""
        name = {"hybrid": f"hybrid(suffix+{self.via}){at}", "cascade": f"cascade({self.via}>stage{at})"}.get(
            self.kind, f"{self.kind}{at}")
        return f"{name}[worker]" if self.process == "worker" else name


def round_cost(draft: DraftOption | None, target: DeviceProfile, overlap: bool = False) -> RoundCost:
    if draft is None:
        return RoundCost(target.verify)
    return RoundCost(target.verify, draft.draft_curve(), link=draft.link_s, overlap=overlap)


@dataclass(frozen=True)
class Workload:
    """A request shape: end-to-end tokens/s includes both prefills."""

    prompt_tokens: int = 128
    new_tokens: int = 128

    def __post_init__(self):
        if self.prompt_tokens < 1 or self.new_tokens < 1:
            raise ValueError(f"a workload needs prompt_tokens >= 1 and new_tokens >= 1, got {self}")

    def tokens_per_s(self, decode_rate: float, prefill_s: float) -> float:
        return self.new_tokens / (prefill_s + self.new_tokens / decode_rate)
