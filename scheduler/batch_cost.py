"""What one batched target call costs, learnt online: seconds = fixed + per_row * rows.

The fixed part (reading the weights once) is shared by every sequence in the
call; each row (a committed token or a draft) adds its own. A request's fair
share of a call is fixed / batch + per_row * its rows, which is what its
draft-length policy should weigh drafts against: alone, the fixed part
dominates and drafts are nearly free; in a large batch each draft row costs
about what the others gain per row, and speculation turns itself down
(the way vLLM and TensorRT-LLM turn it down by batch size, but measured).
"""
from __future__ import annotations

from hetero_sd.scheduler.cost_model import CostCurve, RoundCost


class BatchCost:
    def __init__(self, decay: float = 0.98, prior_fixed: float = 1.0, prior_per_row: float = 0.1):
        # Discounted least squares over (rows, seconds); the prior is a
        # relative shape (a call of one row ~ 1.1 units) until calls are seen.
        self.decay = decay
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._prior = (prior_fixed, prior_per_row)
        self.calls = 0
        self._fit: tuple[float, float] | None = None  # fit() until the next observe()

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._n, self._sx, self._sy = d * self._n + 1, d * self._sx + rows, d * self._sy + seconds
        self._sxx, self._sxy = d * self._sxx + rows * rows, d * self._sxy + rows * seconds
        self.calls += 1
        self._fit = None

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per row); the prior's shape scaled to the mean until rows vary."""
        if self._fit is None:  # asked once per request per step: solved once per observation
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
        n = self._n
        if n == 0:
            return self._prior
        var = self._sxx / n - (self._sx / n) ** 2
        mean_x, mean_y = self._sx / n, self._sy / n
        if var > 1e-6:
            slope = (self._sxy / n - mean_x * mean_y) / var
            fixed = mean_y - slope * mean_x
            if slope > 0 and fixed > 0:
                return fixed, slope
        f, r = self._prior
        scale = mean_y / (f + r * mean_x)
        return f * scale, r * scale

    def share(self, rows: int, batch: int) -> float:
        """Seconds of a call attributable to one sequence of `rows` rows among `batch`."""
        fixed, per_row = self.fit()
        return fixed / max(1, batch) + per_row * rows

    def round_cost(self, batch: int, draft_s_per_token: float = 0.0) -> RoundCost:
        """One request's round in a batch of `batch`, as a draft-length policy prices it."""
        fixed, per_row = self.fit()
        return RoundCost(verify=CostCurve.affine(fixed / max(1, batch), per_row),
                         draft=CostCurve.affine(0.0, max(0.0, draft_s_per_token)))
