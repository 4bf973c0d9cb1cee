"""Choosing gamma, and whether to draft ahead, at every step: the seed's cost
model fed with what the orchestrator measures.

A step drafting g tokens emits on average E(a, g) = (1 - a^(g+1)) / (1 - a)
tokens (a = acceptance rate) and costs, in seconds:

* sequential: R_d + g d + R_t + V(g)
* overlapped (the draft drafts the next block while the target verifies this
  one, as if every draft will be accepted; that block is used with
  probability a^g): R_t + V(g) + (1 - a^g) (R_d + g d) + a^g max(0, R_d + g d - R_t - V(g))
* plain decoding (g = 0): R_t + V(0) per token,

where d is the draft's time per drafted token, V(g) the target's time to
verify g drafts, and R_d, R_t the round trips to each service beyond their
compute (network, gRPC, queueing). Nobody configures any of these: every
reply carries the service's own compute time (``compute_s``), the orchestrator
times the call, and the difference is the round trip. The rate E / cost is
maximized over g in 0..max_gamma and both modes.

Estimates are exponentially weighted. The acceptance rate of a request is
shrunk toward the pool's (a request starts at the global estimate and moves
to its own as its evidence grows). While plain decoding wins, a step drafts
now and then anyway so that the estimates stay current.
Not for: running steps (``orchestrator.engine``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec import metrics
from specdec.sampling import expected_tokens_per_step

_SMOOTH = 0.1  # weight of a new observation
_PRIOR_TOKENS = 16.0  # drafted tokens' worth of the global acceptance rate in a request's
_EXPLORE_EVERY = 32  # plain steps between two drafting steps that refresh the estimates


class _Ewma:
    def __init__(self, value: float) -> None:
        self.value = value
        self.seen = False

    def add(self, x: float) -> None:
        self.value = x if not self.seen else self.value + _SMOOTH * (x - self.value)
        self.seen = True


@dataclass
class CostModel:
    """The pool-wide estimates (one per orchestrator)."""

    max_gamma: int = 16
    alpha: _Ewma = field(default_factory=lambda: _Ewma(0.7))
    draft_token_s: _Ewma = field(default_factory=lambda: _Ewma(0.001))
    rtt_draft_s: _Ewma = field(default_factory=lambda: _Ewma(0.0005))
    rtt_target_s: _Ewma = field(default_factory=lambda: _Ewma(0.0005))
    # V by (gamma, overlapped): a target sharing machines with the draft may be slower
    # while the draft drafts ahead, so the two modes are measured apart.
    verify_s: dict[tuple[int, bool], _Ewma] = field(default_factory=dict)

    # ---- observations ---------------------------------------------------------------
    def observe_draft(self, gamma: int, wall_s: float, compute_s: float) -> None:
        if gamma <= 0 or compute_s <= 0:
            return
        self.draft_token_s.add(compute_s / gamma)
        self.rtt_draft_s.add(max(0.0, wall_s - compute_s))
        metrics.ESTIMATE.labels("draft_token_seconds").set(self.draft_token_s.value)
        metrics.ESTIMATE.labels("rtt_draft_seconds").set(self.rtt_draft_s.value)

    def observe_verify(
        self, gamma: int, wall_s: float, compute_s: float, overlapped: bool = False
    ) -> None:
        if compute_s <= 0:
            return
        key = (gamma, overlapped)
        self.verify_s.setdefault(key, _Ewma(compute_s)).add(compute_s)
        self.rtt_target_s.add(max(0.0, wall_s - compute_s))
        metrics.ESTIMATE.labels("rtt_target_seconds").set(self.rtt_target_s.value)
        name = "verify_seconds_gamma0" if gamma == 0 else "verify_seconds_per_position"
        metrics.ESTIMATE.labels(name).set(self.verify_s[key].value / (gamma + 1))

    def observe_acceptance(self, judged: int, accepted: int) -> None:
        """A step's judged drafts (accepted ones plus the first rejected one)."""
        if judged:
            self.alpha.add(accepted / judged)
            metrics.ESTIMATE.labels("alpha").set(self.alpha.value)

    # ---- the model ----------------------------------------------------------------------
    def verify_cost(self, gamma: int, overlapped: bool = False) -> float:
        """V(gamma): measured, or a line through what was measured (in this mode
        if it was measured at all, else in the other)."""
        if (gamma, overlapped) in self.verify_s:
            return self.verify_s[(gamma, overlapped)].value
        mode = overlapped if any(k[1] == overlapped for k in self.verify_s) else not overlapped
        seen = sorted((g, e.value) for (g, o), e in self.verify_s.items() if o == mode)
        if not seen:
            return 0.01 * (1 + 0.1 * gamma)  # anything: the first steps measure it
        if len(seen) == 1:
            g0, v0 = seen[0]
            return v0 * (1 + 0.1 * (gamma - g0))  # 10% per token until known better
        n = len(seen)
        mg = sum(g for g, _ in seen) / n
        mv = sum(v for _, v in seen) / n
        var = sum((g - mg) ** 2 for g, _ in seen)
        slope = sum((g - mg) * (v - mv) for g, v in seen) / var if var else 0.0
        return max(1e-6, mv + max(0.0, slope) * (gamma - mg))

    def step_cost(self, gamma: int, alpha: float, overlap: bool) -> float:
        """Expected seconds of one step."""
        rt, rd = self.rtt_target_s.value, self.rtt_draft_s.value
        verify = rt + self.verify_cost(gamma, overlap and gamma > 0)
        if gamma == 0:
            return verify
        draft = rd + gamma * self.draft_token_s.value
        if not overlap:
            return draft + verify
        chained = alpha**gamma
        return verify + (1 - chained) * draft + chained * max(0.0, draft - verify)

    def rate(self, gamma: int, alpha: float, overlap: bool) -> float:
        """Expected tokens per second."""
        tokens = expected_tokens_per_step(alpha, gamma) if gamma else 1.0
        return tokens / self.step_cost(gamma, alpha, overlap)

    def choose(self, alpha: float, limit: int, allow_overlap: bool) -> tuple[int, bool]:
        """The (gamma, overlap) with the highest expected rate, gamma <= limit."""
        best = (0, False)
        best_rate = self.rate(0, alpha, False)
        for gamma in range(1, min(limit, self.max_gamma) + 1):
            for overlap in (False, True) if allow_overlap else (False,):
                r = self.rate(gamma, alpha, overlap)
                if r > best_rate * 1.0001:
                    best, best_rate = (gamma, overlap), r
        return best


@dataclass
class RequestPolicy:
    """One request's choices: fixed (the request set gamma) or adaptive."""

    model: CostModel
    gamma: int | None  # fixed gamma, or None for adaptive
    overlap: bool  # drafting ahead allowed (fixed mode: used whenever gamma > 0)
    judged: int = 0  # drafts the target judged: accepted ones and first rejections
    accepted: int = 0
    plain_steps: int = 0

    @property
    def alpha(self) -> float:
        """This request's acceptance rate (accepted / judged), shrunk toward the pool's."""
        prior = self.model.alpha.value
        return (self.accepted + _PRIOR_TOKENS * prior) / (self.judged + _PRIOR_TOKENS)

    def choose(self, limit: int) -> tuple[int, bool]:
        """gamma (<= limit) and whether to draft ahead, for the next step."""
        if self.gamma is not None:
            g = min(self.gamma, limit)
            return g, self.overlap and g > 0
        gamma, overlap = self.model.choose(self.alpha, limit, self.overlap)
        if gamma == 0 and limit > 0:
            self.plain_steps += 1
            if self.plain_steps % _EXPLORE_EVERY == 0:
                gamma = 1  # keep alpha and the draft's costs current
        metrics.CHOSEN_GAMMA.observe(gamma)
        return gamma, overlap

    def observe(self, drafted: int, accepted: int) -> None:
        """A step drafted ``drafted`` tokens and the target accepted the first ``accepted``."""
        judged = accepted + (accepted < drafted)
        self.judged += judged
        self.accepted += accepted
        self.model.observe_acceptance(judged, accepted)
