"""A live check of exactness: are the emitted tokens distributed as the target's?

On a sampled fraction of steps the target also reports, for every candidate
token, p's mass on tokens ranked above it (more probable first, ties by id)
and on it. For each token the step emits, the orchestrator forms the
randomized probability integral transform u = above + v * at with its own
v ~ U[0, 1): if the pipeline is exact, these u are independent and uniform
on [0, 1), whatever the model, the prompt or the draft. A draft that
misreports q, a wrong residual, a temperature or numerics skew between
service versions: anything that makes the output sharper or flatter than p
moves them towards 0 or 1.

The orchestrator keeps the last ``window`` values in 16 equal bins and
exports Pearson's chi-square statistic with the window's fill, so Prometheus
can alert (deploy/prometheus: SpecdecExactnessDrift) once the window holds
at least ``MIN_VALUES``. Under exactness the statistic is chi-square with 15
degrees of freedom: P(chi2 > 70) = 4.5e-9 per evaluation, so even evaluated
after every one of 100,000 tokens, a false alarm has probability below 5e-4.

Greedy requests are exempt: their p is one-hot, and a one-hot PIT is a
uniform draw whatever the token, so it says nothing.
Not for: deciding tokens (its randomness is its own; it never touches a
request's seed, so monitoring does not change any output).
"""

from __future__ import annotations

import collections

import numpy as np

from specdec import metrics

BINS = 16
ALERT_CHI2 = 70.0  # P(chi2_15 > 70) = 4.5e-9
MIN_VALUES = 1024  # enough for the chi-square approximation with 16 bins (64 per bin)


class ExactnessMonitor:
    """Sampled PIT values of emitted tokens, and their uniformity statistic."""

    def __init__(self, fraction: float, window: int, seed: int | None = None) -> None:
        self.fraction = fraction
        self.window = window
        self.rng = np.random.default_rng(seed)
        self._bins: collections.deque[int] = collections.deque(maxlen=window)
        self._counts = np.zeros(BINS, dtype=np.int64)
        self.total = 0
        self._export()

    def sample_step(self) -> bool:
        """Should this step carry the PIT terms? (Its own randomness, not the request's.)"""
        return self.fraction > 0 and self.rng.random() < self.fraction

    def observe(self, above: list[float], at: list[float]) -> None:
        """Add the emitted tokens' PIT terms (mass ranked above each token, and on it)."""
        if not above:
            return
        v = self.rng.random(len(above))
        u = np.clip(np.asarray(above) + v * np.asarray(at), 0.0, np.nextafter(1.0, 0.0))
        for b in (u * BINS).astype(np.int64).tolist():
            if len(self._bins) == self.window:
                self._counts[self._bins[0]] -= 1
            self._bins.append(b)
            self._counts[b] += 1
        self.total += len(above)
        metrics.PIT_TOKENS.inc(len(above))
        self._export()

    @property
    def size(self) -> int:
        return len(self._bins)

    def chi2(self) -> float:
        """Pearson's statistic of the window against the uniform (0 when empty)."""
        n = len(self._bins)
        if not n:
            return 0.0
        expected = n / BINS
        return float(((self._counts - expected) ** 2).sum() / expected)

    def alarming(self) -> bool:
        return self.size >= min(self.window, MIN_VALUES) and self.chi2() > ALERT_CHI2

    def _export(self) -> None:
        metrics.PIT_CHI2.set(self.chi2())
        metrics.PIT_WINDOW.set(self.size)


def emitted_terms(
    above: list[float], at: list[float], gamma: int, accepted: int, bonus: bool
) -> tuple[list[float], list[float]]:
    """The PIT terms of the tokens a step emitted, from the verdict's 2 gamma + 1 entries
    (x_1..x_gamma, the residual draws, the bonus): the accepted drafts, then the
    residual at the first rejection or the bonus (none when ``bonus`` is False: the
    next block took its position). A plain run's further draws follow the bonus,
    and are all emitted."""
    take = list(range(accepted))
    if accepted < gamma:
        take.append(gamma + accepted)
    elif bonus:
        take.append(2 * gamma)
    if not gamma:
        take += range(1, len(above))
    return [above[i] for i in take], [at[i] for i in take]
