"""Choosing gamma, and whether to draft ahead, at every step: the seed's cost
model fed with what the orchestrator measures.

A step drafting g tokens emits on average E(a, g) = (1 - a^(g+1)) / (1 - a)
tokens (a = the acceptance rate of a judged draft) and costs, in seconds:

* sequential: R_d + D(g) + R_t + V(g)
* overlapped (the draft drafts the next block while the target verifies this
  one, as if every draft will be accepted; that block is used with
  probability a^g): R_t + V(g) + (1 - a^g)(R_d + D(g)) + a^g max(0, R_d + D(g) - R_t - V(g)),
  emitting a^g fewer tokens than E(a, g): a step that chains emits no bonus
  token (the next block's first draft is tested at that position). A greedy
  request keeps the bonus instead: it drafts the next block one token longer
  (D(g + 1)) and uses it when that token is the bonus (chance a^(g+1)), so its
  steps emit E(a, g)
* plain decoding (g = 0): a run of k tokens (``plain_run_tokens``, or
  ``plain_run_tokens_busy`` while other requests generate; fewer at a request's
  start) costs R_t + k P and emits k tokens (P: a run's pass, timed on its own),

where R_d, R_t are the round trips to each service beyond its compute
(network, gRPC), D(g) = D_0 + g d the draft's time to draft g tokens (a part
per call and one per drafted token) and V(g) the target's time to verify g
drafts. A block the draft drafts on from the target's echo (``draft_on``)
started a lead L before its propose arrived, so only max(0, D(g) - L) of it is
on the step's path: with a share s of the steps' blocks drafted on (both
measured: every proposal says how much of its compute came before its
propose), the step is charged D(g) - s min(D(g), L) wherever D(g) stands
above for a block drafted in the step. (Charging the whole D(g) priced every
drafted token at its full compute although the lead hides the first
milliseconds of each block (6.8 ms measured on the demo pair, on loopback),
so longer blocks looked dearer than they are: adaptive greedy chose gamma 3
where 4-6 were faster. Side by side the change measured 0.99-1.11x, median
1.01: docs/benchmarks.md, "Adaptive gamma against the best fixed gamma".)
Nobody configures any of these: every reply carries the service's compute
time, its forward pass's time and the tokens that pass carried for all
sessions together; the orchestrator times the call.

**Under load, less speculation.** A forward pass costs about a + b * tokens
(the fixed cost of reading the weights, plus the per-token work), fitted
online. When N sessions share the target's passes (measured from the passes'
token counts), every one of them verifying g + 1 tokens makes a pass cost
a + b N (g + 1): each extra drafted token costs every session b. Choosing g
with that cost makes the chosen gamma fall as batches grow, down to plain
decoding when rejected tokens would cost more batch compute than accepted
ones save; with one session it is the single-request model. Drafting ahead is
left out while more than ``overlap_max_requests`` requests generate (one by
default): the draft is then shared, and a block drafted ahead and discarded
(most are, under load) delays the other sessions' drafts, a cost that no
step's own time shows to the calibration below. Side by side on one
orchestrator, adaptive requests without drafting ahead measured 1.00-1.055x
the throughput at 2-16 clients (paired medians of two runs; docs/benchmarks.md,
"Drafting ahead under load").

**Calibrated by the steps themselves.** The terms above are measured one by
one; what they leave out (the draft drafting ahead competing with the
orchestrator or the target for a core, event-loop hand-offs, a discarded block's
roll-back) shows up only in the steps' wall time. So for each kind of step
(plain, sequential, overlapped) the model also keeps the ratio of the measured
step time to the time it predicted, and scales its prediction by it: a kind of
step that is slower than modelled loses to the others.

Estimates are exponentially weighted; the pool's acceptance rate starts from a
prior that its first judged drafts only move. A request's acceptance rate is
shrunk toward the pool's (one pool rate for greedy requests, one for sampled:
their acceptance differs). While plain decoding wins, a step drafts anyway once
per 64 plain tokens of each request generating at once (``explore_tokens``), as
many tokens as the model would draft if drafting paid, so that the estimates
stay current. (Once per 64 plain tokens of the whole pool, as before 2026-12-02,
is one step in eight of every request at any load: under heavy load, where
plain decoding wins, an eighth of the steps drafted and each one's rejected
tokens cost every session in the shared pass.)

**Checked against plain decoding, as measured** (``PlainGuard``). A model can
be wrong in ways no calibration sees: one request's speculation slows every
other session's shared passes, and on shared cores the draft's compute is the
target's loss. So the adaptive requests of the pool run in epochs: mostly under
the model's choices, and now and then under plain decoding forced, each epoch
measuring what the requests got (tokens per second of request time). When plain
decoding measures faster, it leads, and the model's choices get the trial
epochs instead. It runs only from ``check_min_requests`` requests at once (8 by
default): at lower loads its trials and noise cost more than it finds.
Not for: running steps (``orchestrator.engine``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec import metrics
from specdec.sampling import expected_tokens_per_step

_SMOOTH = 0.1  # weight of a new observation
# Per step, in the pool's acceptance rate: a memory of ~30 steps (~100 judged drafts).
# With 0.1 a few unlucky steps moved it by 0.1, enough to make plain decoding look
# faster, and plain steps judge no drafts to correct it.
_ALPHA_SMOOTH = 0.03
_FORGET = 0.98  # per observation, in the line fits
_PRIOR_TOKENS = 16.0  # judged drafts' worth of the pool's acceptance rate in a request's
_PRIOR_SLOPE = 0.05  # a token costs this fraction of a pass's fixed cost until measured


class _Ewma:
    def __init__(self, value: float) -> None:
        self.value = value
        self.seen = False

    def add(self, x: float) -> None:
        self.value = x if not self.seen else self.value + _SMOOTH * (x - self.value)
        self.seen = True


class _Ratio:
    """A rate such as accepted / judged: numerator and denominator each weighted
    exponentially. (A weighted mean of per-step ratios would be biased: at gamma
    4 and a = 0.75 it gives 0.58, since a step that stops at its first draft
    counts as much as one that accepted all four.)"""

    def __init__(self, value: float, smooth: float = _SMOOTH, prior: bool = False) -> None:
        """``prior``: ``value`` is a prior that the first observations only move (an
        acceptance rate must not fall to 0 because the first draft was rejected);
        else the first observation replaces it."""
        self._num, self._den = value, 1.0
        self._smooth = smooth
        self.seen = prior

    @property
    def value(self) -> float:
        return self._num / self._den

    @value.setter
    def value(self, v: float) -> None:
        self._num, self._den = v, 1.0

    def add(self, num: float, den: float) -> None:
        if not self.seen:
            self._num, self._den, self.seen = num, den, True
        else:
            self._num += self._smooth * (num - self._num)
            self._den += self._smooth * (den - self._den)


class _Line:
    """y = a + b x, least squares with exponential forgetting (and a prior slope
    while x has not varied enough to tell)."""

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b = a, b
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        f = _FORGET
        self._w = f * self._w + 1
        self._x = f * self._x + x
        self._y = f * self._y + y
        self._xx = f * self._xx + x * x
        self._xy = f * self._xy + x * y
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x**2
        if var > 0.25:  # x has spread: fit the slope
            self.b = max(0.0, (self._xy / self._w - mean_x * mean_y) / var)
        else:
            self.b = _PRIOR_SLOPE * max(mean_y, 1e-6)
        self.a = max(1e-6, mean_y - self.b * mean_x)

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


# The measured check against plain decoding (PlainGuard).
_EPOCH_S = 0.5  # an epoch lasts this long of request time per request generating at once,
_EPOCH_STEPS = 6  # and at least this many steps per request generating at once
_WARMUP_EPOCHS = 2  # of each arm, alternating, before either leads
_TRIAL_EVERY = 6  # the trailing arm runs one epoch in this many,
_TRIAL_EVERY_FAR = 12  # or in this many while it trails by more than _FAR
_FAR = 0.08
_SWITCH = 0.03  # the trailing arm takes the lead once it measures this much faster
_EPOCH_SMOOTH = 0.3  # weight of an epoch in its arm's rate
_LOAD_WINDOW_S = 1.0  # the check's load: the most requests at once in this many seconds
ARMS = ("model", "plain")
_OTHER = {"model": "plain", "plain": "model"}


class PlainGuard:
    """Adaptive speculation checked against plain decoding by measurement.

    The adaptive requests of one sampling class (greedy, or sampled: their
    acceptance differs) run in epochs, each under one arm: ``model`` (the cost
    model's choices) or ``plain`` (every step plain). A step is charged to the
    arm it was chosen under, with the tokens it emitted and its request's time
    from its start to the next step's start (so the orchestrator's own work
    counts); a request's prefill is charged too, with no tokens (under load it
    waits behind the others' drafting, a cost of speculation). An epoch's
    tokens / seconds update its arm's rate, exponentially weighted, except in the
    warm-up (``_WARMUP_EPOCHS`` of each arm, alternating), where an arm's latest
    epoch replaces its earlier ones: an orchestrator's first epochs may meet cold
    services (first passes, empty caches), and a cold first epoch smoothed in
    weighs on its arm through several trial epochs. (Before 2026-12-02 the first
    epoch kept most of the weight; a lone client was once held in plain decoding
    for a whole 8 s run, at 0.60 of speculation's rate, after such a start.)
    The faster arm leads; the other runs one epoch in ``_TRIAL_EVERY``
    (``_TRIAL_EVERY_FAR`` while far behind) so that a change of load or network
    shows. Per request-second, the two rates compare what every concurrent
    request gets, so the cost of speculation to the others under load (rejected
    tokens in shared passes, a draft competing for cores) is in them.
    The price of the check is its trial epochs: a sixth of the time in the
    slower arm while the two are close, a twelfth when it is more than 8% slower.
    Epochs count the requests' time, not the clock's: an idle pool or one serving
    only fixed-gamma requests does not end them. An epoch needs ``_EPOCH_S`` of
    request time and ``_EPOCH_STEPS`` steps per request generating at once (the
    most seen in it): about half a second of the pool's time at any load, however
    short its requests. (It once needed that much of every request it saw, which a
    lone client's requests shorter than half a second never reached.)
    One guard per load (``CostModel.guard``): which arm is faster changes with the
    number of requests sharing the services, and a rate measured at one load says
    little about another. A load seen for the first time starts from the nearest
    one's rates and leader (no second warm-up), and its own epochs take over.
    """

    def __init__(self, prior: PlainGuard | None = None) -> None:
        self.rates = {arm: _Ratio(0.0, _EPOCH_SMOOTH) for arm in ARMS}
        self.epochs = dict.fromkeys(ARMS, 0)
        self._window = {arm: [0.0, 0.0] for arm in ARMS}  # tokens, seconds not yet folded
        self.arm = "model"  # the current epoch's
        self.leader = "model"
        if prior is not None:  # what a neighbouring load measured, until this one measures
            for arm in ARMS:
                if prior.rates[arm].seen:
                    self.rates[arm].add(prior.rates[arm].value, 1.0)
            self.epochs = dict(prior.epochs)
            self.arm = self.leader = prior.leader
        self._since_trial = 0
        self._seconds = 0.0  # charged to the current epoch
        self._steps = 0
        self._width = 0  # the most requests generating at once in the current epoch

    def record(self, arm: str, tokens: int, seconds: float, concurrent: int = 1) -> None:
        """A step chosen under ``arm`` emitted ``tokens`` in ``seconds`` of its request,
        with ``concurrent`` requests generating at the time."""
        window = self._window[arm]
        window[0] += tokens
        window[1] += seconds
        if arm != self.arm:  # chosen in an earlier epoch: counted at that arm's next close
            return
        self._steps += 1
        self._seconds += seconds
        self._width = n = max(self._width, concurrent, 1)
        if self._seconds >= _EPOCH_S * n and self._steps >= _EPOCH_STEPS * n:
            self._close()

    def _close(self) -> None:
        arm = self.arm
        tokens, seconds = self._window[arm]
        self._window[arm] = [0.0, 0.0]
        if seconds > 0:
            if self.epochs[arm] < _WARMUP_EPOCHS:  # warming up: the latest epoch only
                self.rates[arm] = _Ratio(0.0, _EPOCH_SMOOTH)
            self.rates[arm].add(tokens, seconds)
            metrics.MEASURED_RATE.labels(arm).set(self.rates[arm].value)
        self.epochs[arm] += 1
        metrics.ARM_EPOCHS.labels(arm).inc()
        self.arm = self._next(arm)
        self._seconds, self._steps = 0.0, 0
        self._width = 0

    def _next(self, closed: str) -> str:
        if min(self.epochs.values()) < _WARMUP_EPOCHS:
            return _OTHER[closed]
        rate = {arm: self.rates[arm].value for arm in ARMS}
        trailing = _OTHER[self.leader]
        if rate[trailing] > rate[self.leader] * (1 + _SWITCH):
            self.leader, trailing = trailing, self.leader
        if closed == trailing:
            return self.leader
        far = rate[trailing] * (1 + _FAR) < rate[self.leader]
        self._since_trial += 1
        if self._since_trial >= (_TRIAL_EVERY_FAR if far else _TRIAL_EVERY) - 1:
            self._since_trial = 0
            return trailing
        return self.leader


@dataclass
class CostModel:
    """The pool-wide estimates (one per orchestrator)."""

    max_gamma: int = 16
    # The pool's acceptance rate, per sampling class (greedy requests accept less)
    alpha: _Ratio = field(default_factory=lambda: _Ratio(0.7, _ALPHA_SMOOTH, prior=True))
    alpha_greedy: _Ratio = field(default_factory=lambda: _Ratio(0.7, _ALPHA_SMOOTH, prior=True))
    # A forward pass's seconds as a line in the tokens it carries.
    target_pass: _Line = field(default_factory=lambda: _Line(0.01, 0.0005))
    # ... for verifies that ran wide (the draft idle, the target on its cores too:
    # ``Verify.draft_idle``), apart; None until one is seen (a target on its own
    # machine never runs one).
    target_pass_wide: _Line | None = None
    # Of the verifies sent saying the draft is idle, the share that ran wide (the
    # target decides: not within 25 ms of another verify, nor where it has no
    # plain_torch_threads, as after a failover to such a replica).
    wide_share: _Ewma = field(default_factory=lambda: _Ewma(0.0))
    draft_pass: _Line = field(default_factory=lambda: _Line(0.001, 0.00005))
    # A pass of a plain run (its mean): runs are timed on their own, not fitted into
    # target_pass. Their passes follow one another, while a verify comes after the
    # draft's turn, and on a CPU a pass after an idle gap is slower (caches): mixed into
    # one line, that gap became a per-token cost (a slope 3x too steep, measured), so
    # long drafts looked dear and the model drifted to short ones and plain runs.
    plain_pass_s: _Ewma = field(default_factory=lambda: _Ewma(0.01))
    # Service time beyond the forward passes (sampling, packing, queueing).
    target_extra_s: _Ewma = field(default_factory=lambda: _Ewma(0.0002))
    # A propose call's time beyond its forward passes (its own work, sampling, the
    # forward loop's turns), as a line in gamma: a part per call and a part per drafted
    # token. (Averaged per token, the part per call would be charged gamma times.)
    draft_extra: _Line = field(default_factory=lambda: _Line(0.0002, 0.0001))
    rtt_draft_s: _Ewma = field(default_factory=lambda: _Ewma(0.0005))
    # Blocks drafted on from the target's echo: their share of the drafting steps,
    # and how long before its propose such a block started (its lead).
    drafted_on: _Ewma = field(default_factory=lambda: _Ewma(0.0))
    draft_lead_s: _Ewma = field(default_factory=lambda: _Ewma(0.0))
    rtt_target_s: _Ewma = field(default_factory=lambda: _Ewma(0.0005))
    # Greedy pipelined blocks (``orchestrator.pipeline``): of the rejections, the share
    # whose next block a guess the draft relayed ahead covered (the target went on at
    # once); over every position, and by the position rejected (1-based: index j),
    # since the draft guesses at its first few positions only (``draft.guesses``, and
    # fewer where its copies of the cache would pass ``guess_copy_mb``). Sampled
    # pipelines relay no guesses.
    guess_cover: _Ewma = field(default_factory=lambda: _Ewma(0.0))
    guess_cover_at: dict = field(default_factory=dict)  # {position: _Ewma}
    # Sessions sharing a pass (1: alone).
    target_sessions: _Ewma = field(default_factory=lambda: _Ewma(1.0))
    draft_sessions: _Ewma = field(default_factory=lambda: _Ewma(1.0))
    # Per kind of step ("plain", "sequential", "overlapped"): measured and predicted
    # seconds (their ratio calibrates step_cost).
    measured_s: dict = field(default_factory=dict)
    predicted_s: dict = field(default_factory=dict)
    # Plain tokens the pool decoded since its last drafting step (see explore).
    plain_tokens: int = 0
    # The measured check against plain decoding, per sampling class (greedy: True) and
    # load: {(greedy, load_bucket(requests)): PlainGuard}, made as loads are seen.
    guards: dict = field(default_factory=dict)
    # The check runs only while at least this many requests generate at once.
    check_min_requests: int = 1
    # Learn blocks' leads (``draft_path_cost``); False: a block's whole drafting time counts.
    count_lead: bool = True
    # While plain decoding wins, a step drafts anyway after this many plain tokens
    # (0: never), per request generating at once (False: of the whole pool).
    explore_tokens: int = 64
    explore_per_request: bool = True
    # Adaptive requests draft ahead only while at most this many requests generate.
    overlap_max_requests: int = 1
    # Adaptive requests draft at all only while at most this many requests generate
    # (0: at any load); above it they decode plain, unchecked and unexplored.
    speculate_max_requests: int = 0

    def speculates(self, requests: int) -> bool:
        """Whether adaptive requests may draft with ``requests`` requests generating
        at once (``speculate_max_requests``)."""
        return not self.speculate_max_requests or requests <= self.speculate_max_requests

    def guard(self, greedy: bool, requests: int) -> PlainGuard | None:
        """The check against plain decoding for this sampling class with ``requests``
        requests generating at once (None below ``check_min_requests``: the model
        decides alone)."""
        if requests < self.check_min_requests or not self.speculates(requests):
            return None
        key = (greedy, load_bucket(requests))
        if key not in self.guards:
            near = [k for k in self.guards if k[0] == greedy]
            prior = min(near, key=lambda k: abs(k[1] - key[1])) if near else None
            self.guards[key] = PlainGuard(self.guards[prior] if prior else None)
        return self.guards[key]

    # ---- observations ---------------------------------------------------------------
    def observe_draft(
        self,
        gamma: int,
        wall_s: float,
        compute_s: float,
        forward_s: float,
        batch_tokens: float,
        lead_s: float = 0.0,
    ) -> None:
        """A propose call of ``gamma`` tokens: its wall time here, and the service's
        compute (``lead_s`` of it before the call arrived: drafted on from an echo)."""
        if gamma <= 0 or compute_s <= 0:
            return
        if lead_s <= 0:
            # The draft's costs are learnt from blocks drafted within their call only.
            # One drafted before its propose (on an echo, or a guess) was drafted
            # beside the session's own guesses: its passes carried 4-5 rows (so the
            # draft looked shared by 4-5 sessions, its passes 1.0-1.3 ms per token
            # where a one-row pass takes 0.15-0.25) and its span waited behind them.
            # Fitted in, on an orchestrator that also served requests drafting
            # ahead, each drafted token read 0.7-3.5 ms (0.2 from calls alone) and
            # adaptive requests chose gamma 2.5-5 where 6 was the fastest
            # (docs/benchmarks.md, "Requests that draft ahead misled adaptive ones").
            if forward_s > 0 and batch_tokens > 0:
                self.draft_pass.add(batch_tokens, forward_s / gamma)
                self.draft_sessions.add(max(1.0, batch_tokens))
            self.draft_extra.add(gamma, max(0.0, compute_s - forward_s))
        lead_s = min(max(0.0, lead_s), compute_s) if self.count_lead else 0.0
        self.rtt_draft_s.add(max(0.0, wall_s - (compute_s - lead_s)))
        self.drafted_on.add(1.0 if lead_s > 0 else 0.0)
        if lead_s > 0:
            self.draft_lead_s.add(lead_s)
        metrics.ESTIMATE.labels("drafted_on_share").set(self.drafted_on.value)
        metrics.ESTIMATE.labels("draft_lead_seconds").set(self.draft_lead_s.value)
        metrics.ESTIMATE.labels("draft_token_seconds").set(self.draft_token_s())
        metrics.ESTIMATE.labels("draft_call_seconds").set(self.draft_extra.a)
        metrics.ESTIMATE.labels("rtt_draft_seconds").set(self.rtt_draft_s.value)

    def observe_verify(
        self,
        gamma: int,
        wall_s: float,
        compute_s: float,
        forward_s: float,
        batch_tokens: int,
        passes: int = 1,
        rtt: bool = True,
        wide: bool = False,
        idle: bool = False,
    ) -> None:
        """A verify (``passes`` > 1: a plain run of that many passes; forward_s and
        compute_s are the run's, batch_tokens the mean of its passes). ``rtt`` False:
        ``wall_s`` does not span the round trip (a relayed verify), so only the
        compute is learnt. ``wide``: its pass ran on more threads (``Verdict.wide``);
        ``idle``: it was sent saying the draft is idle (``Verify.draft_idle``)."""
        if compute_s <= 0:
            return
        own = gamma + 1
        if idle and gamma:
            self.wide_share.add(1.0 if wide else 0.0)
            metrics.ESTIMATE.labels("wide_verify_share").set(self.wide_share.value)
        if forward_s > 0 and batch_tokens > 0:
            if gamma and wide:
                if self.target_pass_wide is None:
                    self.target_pass_wide = _Line(self.target_pass.a, self.target_pass.b)
                self.target_pass_wide.add(batch_tokens, forward_s / passes)
            elif gamma:
                self.target_pass.add(batch_tokens, forward_s / passes)
            else:
                self.plain_pass_s.add(forward_s / passes)
            self.target_sessions.add(max(1.0, batch_tokens / own))
        self.target_extra_s.add(max(0.0, compute_s - forward_s) / passes)
        if rtt:
            self.rtt_target_s.add(max(0.0, wall_s - compute_s))
        metrics.ESTIMATE.labels("rtt_target_seconds").set(self.rtt_target_s.value)
        metrics.ESTIMATE.labels("verify_seconds_gamma0").set(self.verify_cost(0))
        metrics.ESTIMATE.labels("plain_pass_seconds").set(self.plain_pass_cost())
        metrics.ESTIMATE.labels("verify_seconds_per_position").set(self.target_pass.b)
        metrics.ESTIMATE.labels("target_sessions_per_pass").set(self.target_sessions.value)

    def observe_step(
        self,
        gamma: int,
        overlap: bool,
        alpha: float,
        seconds: float,
        run: int = 1,
        match: bool = False,
        drafted: bool | None = None,
        pipelined: bool = False,
        wide: bool = False,
    ) -> None:
        """A step of ``gamma`` drafts (drafting ahead or not; gamma 0: a plain run of
        ``run`` tokens; ``match``: a greedy one, see ``step_cost``; ``wide``: its
        verify ran wide, ``Verdict.wide``) took ``seconds``.
        ``drafted``: whether it drafted its block (False: drafted ahead during the last
        step's verify); None: unknown, compared with the average step (``step_cost``).
        ``pipelined``: a step of a pipeline (``drafted``: its block came after the
        verdict before it), timed from the verdict before it.

        The time it is compared with is this step's own: with a block to draft or
        without one, not the average over the two. (Compared with the average, a
        step that took a block drafted ahead and did not draft ahead itself counted
        as a cheap sequential step, and a step that drafted ahead after one that did
        not as a dear overlapped one; adaptive requests choose the two unevenly, so
        on the demo pair the calibration read 0.96 for sequential and 1.06 for
        overlapped steps and turned drafting ahead off where it was the fastest.)"""
        kind = _kind(gamma, overlap, pipelined)
        self.plain_tokens = self.plain_tokens + run if gamma == 0 else 0
        predicted = self.step_cost(
            gamma,
            alpha,
            overlap,
            calibrated=False,
            run=run,
            match=match,
            drafted=drafted,
            pipelined=pipelined,
            wide=1.0 if wide else 0.0,
        )
        if kind not in self.measured_s:
            self.measured_s[kind], self.predicted_s[kind] = _Ewma(seconds), _Ewma(predicted)
        self.measured_s[kind].add(seconds)
        self.predicted_s[kind].add(predicted)
        metrics.ESTIMATE.labels(f"step_time_ratio_{kind}").set(self.calibration(kind))

    def observe_guess_cover(self, covered: bool, position: int | None = None) -> None:
        """A greedy pipelined block was rejected (at draft ``position``, 1-based, if
        known); ``covered``: the block after it was a guess relayed ahead (else the
        draft drafted it after the verdict)."""
        x = 1.0 if covered else 0.0
        self.guess_cover.add(x)
        if position is not None:
            self.guess_cover_at.setdefault(position, _Ewma(0.0)).add(x)
        metrics.ESTIMATE.labels("pipeline_guess_cover").set(self.guess_cover.value)

    def covered_rejection(self, gamma: int, alpha: float) -> float:
        """The chance that a greedy pipelined block of ``gamma`` drafts is rejected and
        a guess covers the rejection: sum over positions j of a^(j-1) (1 - a) c_j,
        c_j the share of rejections at j covered. A position not yet seen takes the
        nearest seen one's below it (below the first seen, that one's; ``guess_cover``
        where none is): a draft that guesses further than it looks gets tried, and
        one rejection there is enough to correct it. (One share for every position
        overrated long blocks: the draft guesses at its first 4 positions by default,
        so a rejection past them always waits for a fresh block, and by the share
        measured at 4 drafts, 8 looked as fast as 4 on the demo pair.)"""
        c = self.guess_cover.value
        if self.guess_cover_at:
            first = min(self.guess_cover_at)
            c = self.guess_cover_at[first].value
        total, reach = 0.0, 1.0 - alpha  # reach: a^(j-1) (1 - a)
        for j in range(1, gamma + 1):
            seen = self.guess_cover_at.get(j)
            if seen is not None:
                c = seen.value
            total += reach * c
            reach *= alpha
        return total

    def explore(self, requests: int = 1) -> bool:
        """Whether a step the model would decode plain should draft instead,
        to keep alpha and the costs of drafting current: once the pool (every request,
        and the check's plain epochs) has decoded ``explore_tokens`` plain tokens per
        request generating at once (``requests``) since its last drafting step.
        Counted for the pool, not per request: with plain runs a short request takes
        few steps, and estimates that no request refreshes could keep every later one
        plain. Scaled by the load: each request explores about once per
        ``explore_tokens`` of its own plain tokens at any load."""
        every = self.explore_tokens * (max(1, requests) if self.explore_per_request else 1)
        if every <= 0 or self.plain_tokens < every:
            return False
        self.plain_tokens = 0
        return True

    def calibration(self, kind: str) -> float:
        """Measured / predicted step time for this kind of step (1 until measured)."""
        if kind not in self.measured_s:
            return 1.0
        return self.measured_s[kind].value / max(self.predicted_s[kind].value, 1e-9)

    def pool_alpha(self, greedy: bool) -> _Ratio:
        """The pool's acceptance rate for greedy or sampled requests."""
        return self.alpha_greedy if greedy else self.alpha

    def observe_acceptance(self, judged: int, accepted: int, greedy: bool = False) -> None:
        """A step's judged drafts (accepted ones plus the first rejected one)."""
        if judged:
            alpha = self.pool_alpha(greedy)
            alpha.add(accepted, judged)
            metrics.ESTIMATE.labels("alpha_greedy" if greedy else "alpha").set(alpha.value)

    # ---- the model ----------------------------------------------------------------------
    def draft_token_s(self) -> float:
        """d: seconds each drafted token adds to a propose call, with the draft's
        passes as shared as now."""
        return self.draft_pass(self.draft_sessions.value) + self.draft_extra.b

    def draft_cost(self, gamma: int) -> float:
        """The draft service's seconds for a propose call of ``gamma`` tokens."""
        return self.draft_extra.a + gamma * self.draft_token_s()

    def draft_path_cost(self, gamma: int) -> float:
        """The part of ``draft_cost(gamma)`` on a step's path: D(g) - s min(D(g), L)
        (a share s of the blocks drafted on, a lead L ahead of their propose)."""
        d = self.draft_cost(gamma)  # (s stays 0 without count_lead: no lead is learnt)
        return d - self.drafted_on.value * min(d, self.draft_lead_s.value)

    def plain_pass_cost(self) -> float:
        """The target's seconds per pass of a plain run (as measured once seen)."""
        if not self.plain_pass_s.seen:
            return self.verify_cost(0)
        return self.plain_pass_s.value + self.target_extra_s.value

    def verify_cost(self, gamma: int, wide: float = 0.0) -> float:
        """V(gamma): a pass in which every session sharing it verifies gamma drafts;
        ``wide`` of it (a share, 0 to 1) priced as the passes that ran wide measured."""
        tokens = self.target_sessions.value * (gamma + 1)
        seconds = self.target_pass(tokens)
        if wide and self.target_pass_wide is not None:
            seconds += wide * (self.target_pass_wide(tokens) - seconds)
        return seconds + self.target_extra_s.value

    def step_cost(
        self,
        gamma: int,
        alpha: float,
        overlap: bool,
        calibrated: bool = True,
        run: int = 1,
        match: bool = False,
        drafted: bool | None = None,
        pipelined: bool = False,
        wide: float = 0.0,
    ) -> float:
        """Expected seconds of one step (gamma 0: a plain run of ``run`` tokens),
        scaled by the measured/predicted ratio of its kind of step unless
        ``calibrated`` is False. ``match``: a greedy request's overlap, whose block
        drafted ahead is one token longer and chains when that token is the bonus.
        ``drafted``: whether the step drafts its block (False: it was drafted ahead);
        None: as it turns out on average (an overlapped step drafts when the one
        before did not chain, 1 - alpha^gamma of the time).

        ``pipelined`` (``orchestrator.pipeline``): the draft relays each block ahead,
        so the target goes from one verdict to the next block's verify at once when
        that block was relayed ahead: the one that follows a block accepted in full
        (chance alpha^(gamma + match)) or, greedy, the guess for a rejection
        (``covered_rejection``: by the position rejected). Otherwise the step also
        waits for the verdict's echo to the draft, its drafting and the relay back: a
        round trip between the two (the one to the draft stands for it) and the
        drafting. No round trip to this orchestrator: nobody asks for the steps.
        ``pipelined`` without ``overlap``: a paced step (``orchestrator.paced``), whose
        block is always drafted after the verdict's echo and whose verify may run wide.

        ``wide``: of a sequential step's verify, the share priced as a pass on the
        draft's cores too (``verify_cost``; ``Verify.draft_idle``)."""
        scale = self.calibration(_kind(gamma, overlap, pipelined)) if calibrated else 1.0
        if gamma == 0:
            return scale * (self.rtt_target_s.value + run * self.plain_pass_cost())
        if pipelined:
            wait = self.rtt_draft_s.value + self.draft_cost(gamma)
            if not overlap:  # paced
                return scale * (self.verify_cost(gamma, wide) + wait)
            if drafted is None:
                ready = alpha ** (gamma + match)
                if match:  # (a bonus the follower missed is no rejection: no guess)
                    ready += self.covered_rejection(gamma, alpha)
                wait *= 1 - ready
            elif not drafted:
                wait = 0.0
            return scale * (self.verify_cost(gamma) + wait)
        verify = self.rtt_target_s.value + self.verify_cost(gamma, 0.0 if overlap else wide)
        draft = self.rtt_draft_s.value + self.draft_path_cost(gamma)
        if drafted is not None:
            draft = draft if drafted else 0.0
        if not overlap:
            return scale * (draft + verify)
        chained = alpha ** (gamma + match)
        hidden = self.rtt_draft_s.value + self.draft_cost(gamma + match)
        drafts = (1 - chained) * draft if drafted is None else draft
        return scale * (verify + drafts + chained * max(0.0, hidden - verify))

    def rate(
        self,
        gamma: int,
        alpha: float,
        overlap: bool,
        run: int = 1,
        match: bool = False,
        pipelined: bool = False,
        wide: float = 0.0,
    ) -> float:
        """Expected tokens per second of one request (gamma 0: plain runs of ``run``).
        A step that chains (every draft accepted, the next block drafted ahead: chance
        alpha^gamma) emits no bonus token: the next block's first draft is tested at
        that position instead (``orchestrator.step.settle``); with ``match`` (greedy)
        it keeps the bonus. ``pipelined``: a step of a pipeline (``step_cost``), which
        chains the same way when it drafts ahead (a paced one, without ``overlap``,
        never chains)."""
        tokens = expected_tokens_per_step(alpha, gamma) if gamma else float(run)
        if gamma and overlap and not match:
            tokens -= alpha**gamma
        cost = self.step_cost(
            gamma, alpha, overlap, run=run, match=match, pipelined=pipelined, wide=wide
        )
        return tokens / cost

    def choose(
        self,
        alpha: float,
        limit: int,
        allow_overlap: bool,
        run: int = 1,
        match: bool = False,
        plain: bool = True,
        pipelined: bool = False,
        alone: bool = False,
        paced: bool = False,
    ) -> tuple[int, bool]:
        """The (gamma, overlap) with the highest expected rate, gamma <= limit; a plain
        step would be a run of ``run`` tokens (``plain`` False: the best drafting
        step); ``match``: a greedy request (``rate``); ``pipelined``: a step that drafts
        ahead would start a pipeline, and is priced as its steps; ``paced``: so would a
        sequential step, a paced one (``orchestrator.paced``); ``alone``: the
        orchestrator's only request, whose sequential steps' verifies say the draft is
        idle, and run wide as often as such verifies did (``wide_share``)."""
        best = (0, False)
        best_rate = self.rate(0, alpha, False, run) if plain else 0.0
        wide = self.wide_share.value if alone else 0.0
        for gamma in range(1, min(limit, self.max_gamma) + 1):
            for overlap in (False, True) if allow_overlap else (False,):
                r = self.rate(
                    gamma,
                    alpha,
                    overlap,
                    match=match,
                    pipelined=pipelined if overlap else paced,
                    wide=0.0 if overlap else wide,
                )
                if r > best_rate * 1.0001:
                    best, best_rate = (gamma, overlap), r
        return best


class PeakLoad:
    """The load the check against plain decoding is keyed by: the most requests
    generating at once in the last ``window_s`` seconds (about one), not the number
    generating right now.

    The number right now dips whenever a client is between two requests. At 16
    clients it read 15 for a share of the steps: below the check's minimum of 16
    requests, so those steps went to the model alone; at 32 clients the steps
    alternated between the checks of 16-31 and 32-63 requests, each running its
    own epochs, and a request moved between their arms from step to step. The
    peak holds steady under a steady load and follows a real fall within the
    window. Times are the caller's (``time.monotonic()``), so tests need no clock."""

    def __init__(self, window_s: float = _LOAD_WINDOW_S) -> None:
        self.window_s = window_s
        self._peak = 0
        self._since = 0.0  # when the peak was last reached (or last reset)

    def set(self, requests: int, now: float) -> None:
        """``requests`` generate at once from ``now`` on."""
        if requests >= self._peak or now - self._since > self.window_s:
            self._peak, self._since = requests, now

    def value(self, requests: int, now: float) -> int:
        """The peak, held for ``window_s`` after it was last reached; then
        ``requests``, the number generating now (a fall shows within a window, a dip
        between requests never). The caller owns that number; this keeps no copy."""
        if now - self._since > self.window_s:
            self._peak, self._since = requests, now
        return self._peak


def load_bucket(requests: int) -> int:
    """Loads the check tells apart: 1, 2-3, 4-7, 8-15, 16-31, 32-63 and 64 or more
    requests at once (bucket 1 to 7)."""
    return min(max(1, requests), 64).bit_length()


def _kind(gamma: int, overlap: bool, pipelined: bool = False) -> str:
    if gamma and pipelined:
        return "pipelined" if overlap else "paced"
    return "plain" if gamma == 0 else "overlapped" if overlap else "sequential"


@dataclass
class RequestPolicy:
    """One request's choices: fixed (the request set gamma) or adaptive."""

    model: CostModel
    gamma: int | None  # fixed gamma, or None for adaptive
    overlap: bool  # drafting ahead allowed (fixed mode: used whenever gamma > 0)
    greedy: bool = False  # its sampling class, for the check against plain decoding
    judged: int = 0  # drafts the target judged: accepted ones and first rejections
    accepted: int = 0
    arm: str = "model"  # the PlainGuard arm of the last choice (adaptive requests)
    guard: PlainGuard | None = None  # the check for this step's load (None: off)
    load: int = 1  # requests generating at once (the engine's ``load()``) at this step
    # A step that drafts ahead would start a pipeline (the engine's ``may_pipeline``),
    # and a sequential one a paced pipeline (``orchestrator.paced``).
    pipelined: bool = False
    paced: bool = False

    @property
    def alpha(self) -> float:
        """This request's acceptance rate (accepted / judged), shrunk toward the pool's."""
        prior = self.model.pool_alpha(self.greedy).value
        return (self.accepted + _PRIOR_TOKENS * prior) / (self.judged + _PRIOR_TOKENS)

    def _plain_epoch(self) -> bool:
        return self.guard is not None and self.guard.arm == "plain"

    def plain_now(self) -> bool:
        """Whether the next step is plain whatever the model says: an adaptive request
        in a plain epoch of the check, or above ``speculate_max_requests``."""
        if self.gamma is not None:
            return False
        return self._plain_epoch() or not self.model.speculates(self.load)

    def choose(self, limit: int, run: int = 1) -> tuple[int, bool]:
        """gamma (<= limit) and whether to draft ahead, for the next step; a plain
        step would be a run of ``run`` tokens."""
        if self.gamma is not None:
            g = min(self.gamma, limit)
            return g, self.overlap and g > 0
        self.arm = "plain" if self._plain_epoch() else "model"
        if self.plain_now():
            metrics.CHOSEN_GAMMA.observe(0)
            return 0, False
        alpha = self.alpha
        # Under load the draft is shared: a block drafted ahead and then discarded
        # delays the other sessions' drafts, which no step's own time shows.
        ahead = self.overlap and self.load <= self.model.overlap_max_requests
        piped = ahead and self.pipelined
        alone = self.load <= 1  # (its sequential steps' verifies run wide: the engine's)
        gamma, overlap = self.model.choose(
            alpha, limit, ahead, run, self.greedy, pipelined=piped, alone=alone, paced=self.paced
        )
        if gamma == 0 and limit > 0 and self.model.explore(self.load):
            # Keep alpha and the draft's costs current, with the draft that would be
            # chosen if drafting paid: the drafts it judges are the evidence.
            gamma, overlap = self.model.choose(
                alpha, limit, ahead, 1, self.greedy, False, piped, alone, self.paced
            )
        metrics.CHOSEN_GAMMA.observe(gamma)
        return gamma, overlap

    def observe(self, drafted: int, accepted: int) -> None:
        """A step drafted ``drafted`` tokens and the target accepted the first ``accepted``."""
        judged = accepted + (accepted < drafted)
        self.judged += judged
        self.accepted += accepted
        self.model.observe_acceptance(judged, accepted, self.greedy)
