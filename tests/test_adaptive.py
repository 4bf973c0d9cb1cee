"""The adaptive policy's cost model: the choices the seed's formulas call for."""

from __future__ import annotations

import copy

import pytest

from orchestrator.adaptive import CostModel, PeakLoad, PlainGuard, RequestPolicy, load_bucket
from specdec.sampling import expected_tokens_per_step


def model(target_a=0.010, target_b=0.0006, draft=0.001, rtt=0.0005, sessions=1.0) -> CostModel:
    m = CostModel(max_gamma=16)
    m.target_pass.a, m.target_pass.b = target_a, target_b
    m.draft_pass.a, m.draft_pass.b = draft, 0.0
    m.draft_extra.a = m.draft_extra.b = m.target_extra_s.value = 0.0
    m.rtt_draft_s.value = m.rtt_target_s.value = rtt
    m.target_sessions.value = sessions
    return m


def test_rate_is_the_formula_over_the_step_cost():
    m = model()
    cost = 0.0005 + 4 * 0.001 + 0.0005 + 0.010 + 0.0006 * 5
    assert abs(m.rate(4, 0.8, False) - expected_tokens_per_step(0.8, 4) / cost) < 1e-9


def test_better_drafts_get_more_gamma_and_useless_ones_none():
    m = model()
    good, _ = m.choose(0.9, 16, allow_overlap=False)
    fair, _ = m.choose(0.6, 16, allow_overlap=False)
    assert good > fair >= 1
    assert m.choose(0.05, 16, allow_overlap=False)[0] == 0  # plain decoding wins


def test_an_expensive_draft_or_network_moves_the_choice():
    cheap = model(draft=0.0005).choose(0.8, 16, False)[0]
    dear = model(draft=0.006).choose(0.8, 16, False)[0]
    assert dear < cheap
    # Round trips are paid per step: more of them favour longer steps.
    assert model(rtt=0.010).choose(0.8, 16, False)[0] >= model(rtt=0.0).choose(0.8, 16, False)[0]


def test_a_block_drafted_on_ahead_of_its_propose_costs_the_step_only_the_rest():
    """With the draft drafting on from the target's echo, a lead L of every block is
    off the step's path: longer blocks get cheaper, and the round trip to the draft
    is the propose's wall time less the compute after it arrived."""
    m = model(draft=0.002, rtt=0.001)
    without = m.choose(0.72, 16, allow_overlap=False)[0]
    assert abs(m.draft_path_cost(4) - m.draft_cost(4)) < 1e-12  # nothing drafted on yet
    for _ in range(50):  # every block drafted on, 7.5 ms of its 8 before its propose
        m.observe_draft(4, wall_s=0.0015, compute_s=0.008, forward_s=0.008,
                        batch_tokens=1.0, lead_s=0.0075)  # fmt: skip
    assert abs(m.drafted_on.value - 1.0) < 1e-9 and abs(m.draft_lead_s.value - 0.0075) < 1e-9
    assert abs(m.rtt_draft_s.value - 0.001) < 1e-9  # 1.5 ms - (8 - 7.5) ms
    assert abs(m.draft_path_cost(5) - (m.draft_cost(5) - 0.0075)) < 1e-12
    assert m.draft_path_cost(3) < 1e-5  # a block no longer than the lead: all hidden
    assert m.choose(0.72, 16, allow_overlap=False)[0] > without
    for _ in range(200):  # then no block is drafted on: the whole block counts again
        m.observe_draft(4, 0.009, 0.008, 0.008, 1.0)
    assert m.drafted_on.value < 0.01
    assert m.choose(0.72, 16, allow_overlap=False)[0] == without


def test_blocks_drafted_before_their_propose_leave_the_drafts_costs_alone():
    """The draft's costs (its pass as a line in the rows it carries, the sessions
    sharing it, a call's cost beyond its passes) are learnt from blocks drafted
    within their call only. A block drafted before its propose (on an echo, or a
    guess) was drafted beside the session's own guesses: its passes carried 4-5
    rows and its span waited behind them. Fitted in, each drafted token read
    0.7-3.5 ms where calls measured 0.2, and adaptive requests chose shorter blocks."""
    m = model(draft=0.0002, rtt=0.001)
    for _ in range(100):  # calls: one-row passes of 0.2 ms, 0.3 ms a call + 0.1 a token
        for g in (3, 4, 5, 6):
            m.observe_draft(g, 0.004, 0.0003 + g * 0.0003, g * 0.0002, 1.0)
    costs = [m.draft_cost(g) for g in range(1, 9)]
    assert abs(m.draft_token_s() - 0.0003) < 2e-5 and abs(m.draft_extra.a - 0.0003) < 1e-6
    for _ in range(100):  # drafted on beside guesses: 5-row passes of 1.1 ms, 1 ms of lead
        for g in (3, 4, 5, 6):
            span = g * 0.0013
            m.observe_draft(g, span, span, g * 0.0011, 5.0, lead_s=0.001)
    assert [m.draft_cost(g) for g in range(1, 9)] == costs
    assert m.draft_sessions.value == 1.0
    assert m.drafted_on.value > 0.99 and abs(m.draft_lead_s.value - 0.001) < 1e-9
    assert abs(m.rtt_draft_s.value - 0.001) < 1e-9  # (their round trips still count)


def test_plain_runs_pay_the_round_trip_once():
    m = model(rtt=0.010)
    # A run of 8 costs one round trip and 8 passes; one token per step pays it each time.
    assert abs(m.rate(0, 0.7, False, run=8) - 8 / (0.010 + 8 * 0.0106)) < 1e-9
    assert m.rate(0, 0.7, False, run=8) > 1.5 * m.rate(0, 0.7, False, run=1)
    # At 10 ms per round trip, a fair draft beats one plain token per trip but not a run.
    assert m.choose(0.6, 16, False, run=1)[0] > 0
    assert m.choose(0.6, 16, False, run=8)[0] == 0


def test_overlap_when_the_draft_can_hide_behind_the_verify():
    gamma, overlap = model(rtt=0.005).choose(0.8, 16, allow_overlap=True)
    assert overlap and gamma >= 1
    m = model(rtt=0.005)
    assert m.rate(gamma, 0.8, True) > m.rate(gamma, 0.8, False)


def test_adaptive_requests_draft_ahead_only_while_alone_unless_configured():
    """Under load the draft is shared, and a block drafted ahead and discarded delays
    the other sessions' drafts: adaptive requests draft ahead only up to
    ``overlap_max_requests`` requests at once. A request that asks for a fixed gamma
    with drafting ahead keeps it."""
    m = model(rtt=0.005)
    alone = RequestPolicy(m, gamma=None, overlap=True, load=1)
    gamma, overlap = alone.choose(16)
    assert overlap and gamma >= 1
    busy = RequestPolicy(m, gamma=None, overlap=True, load=2)
    assert busy.choose(16) == m.choose(0.7, 16, allow_overlap=False)
    assert not busy.choose(16)[1]
    m.overlap_max_requests = 4
    assert busy.choose(16)[1]
    m.overlap_max_requests = 0  # never
    assert not alone.choose(16)[1]
    assert RequestPolicy(m, gamma=4, overlap=True, load=8).choose(16) == (4, True)


def test_verifies_that_ran_wide_are_timed_apart_and_price_a_lone_requests_sequential_steps():
    """A verify whose pass ran on the draft's cores too (``Verdict.wide``: the draft
    idle, a lone request's sequential step) is fitted on a line of its own: until one
    is seen, every step is priced with the usual passes; once wide ones measure
    faster, a lone request's sequential steps are priced with them, as often as the
    verifies sent saying the draft is idle ran wide (``wide_share``), and may win
    over drafting ahead. At a load of 2 (no verify says so) nothing changes; and
    when idle verifies stop running wide (a failover to a target without
    plain_torch_threads) the share falls and drafting ahead wins again."""
    m = model(rtt=0.005)
    assert m.target_pass_wide is None
    alone = RequestPolicy(m, gamma=None, overlap=True, load=1)
    busy = RequestPolicy(m, gamma=None, overlap=True, load=2)
    before_alone, before_busy = alone.choose(16), busy.choose(16)
    assert before_alone[1]  # drafting ahead hides the draft behind a 10 ms verify
    assert m.verify_cost(4, wide=1.0) == m.verify_cost(4)  # no wide pass seen yet
    narrow = m.verify_cost(4)
    for gamma in (2, 4, 6) * 10:  # wide passes measured at 60% of the usual
        forward = 0.6 * m.target_pass(gamma + 1)
        m.observe_verify(gamma, forward + 0.006, forward, forward, gamma + 1, wide=True, idle=True)
    assert m.target_pass(5) * 0.6 == pytest.approx(m.target_pass_wide(5), rel=1e-6)
    assert m.wide_share.value == 1.0
    assert m.verify_cost(4) == narrow  # the usual passes' line is untouched
    assert m.verify_cost(4, wide=1.0) < 0.7 * narrow
    assert m.verify_cost(4, wide=0.5) == pytest.approx(
        (m.verify_cost(4) + m.verify_cost(4, wide=1.0)) / 2
    )
    assert m.step_cost(4, 0.8, False, wide=1.0) < m.step_cost(4, 0.8, False)
    assert m.step_cost(4, 0.8, True, wide=1.0) == m.step_cost(4, 0.8, True)  # ahead: never
    assert alone.choose(16)[1] is False  # sequential wins alone now
    assert busy.choose(16) == before_busy
    for _ in range(80):  # idle verifies that ran narrow (usual passes' times)
        forward = m.target_pass(5)
        m.observe_verify(4, forward + 0.005, forward, forward, 5, wide=False, idle=True)
    assert m.wide_share.value < 0.001
    never_wide = copy.deepcopy(m)
    never_wide.target_pass_wide = None
    assert alone.choose(16) == RequestPolicy(never_wide, None, True, load=1).choose(16)


def test_above_speculate_max_requests_adaptive_requests_decode_plain_and_unchecked():
    """``speculate_max_requests`` 2: with up to 2 requests at once the model chooses;
    from 3 adaptive requests decode plain, do not explore, and get no check (its
    plain arm would measure plain against plain). Fixed gamma keeps what it asks."""
    m = model(rtt=0.005)
    m.check_min_requests = 1
    m.speculate_max_requests = 2
    m.plain_tokens = 10_000  # an exploring step is due
    assert m.speculates(1) and m.speculates(2) and not m.speculates(3)
    assert RequestPolicy(m, gamma=None, overlap=True, load=2).choose(16)[0] >= 1
    busy = RequestPolicy(m, gamma=None, overlap=True, load=3)
    assert busy.choose(16, run=8) == (0, False) and busy.arm == "model"
    assert m.plain_tokens == 10_000  # nothing explored
    assert m.guard(False, 2) is not None and m.guard(False, 3) is None
    assert RequestPolicy(m, gamma=4, overlap=False, load=32).choose(16) == (4, False)
    m.speculate_max_requests = 0  # any load
    assert m.speculates(10_000) and m.guard(False, 64) is not None
    assert RequestPolicy(m, gamma=None, overlap=False, load=64).choose(16)[0] >= 1


def test_a_chained_step_has_no_bonus_so_hiding_a_cheap_draft_does_not_pay():
    m = model(rtt=0.005)
    tokens = expected_tokens_per_step(0.8, 4) - 0.8**4  # chains with chance 0.8^4
    assert abs(m.rate(4, 0.8, True) - tokens / m.step_cost(4, 0.8, True)) < 1e-9
    # Measured on the demo pair, greedy, gamma 4: 2.80 tokens per sequential step and
    # 2.52 per overlapped one (29% of them chained). A draft this cheap saves less
    # time when hidden than the bonus tokens of the chained steps are worth.
    cheap = model(draft=0.0001)
    assert cheap.rate(4, 0.8, True) < cheap.rate(4, 0.8, False)
    assert not cheap.choose(0.8, 16, allow_overlap=True)[1]


def test_greedy_overlap_keeps_the_bonus_so_hiding_even_a_cheap_draft_pays():
    """A greedy request drafts the next block one token longer and chains when that
    token is the bonus (chance a^(g+1)): its steps emit E(a, g), as sequential ones do,
    so whatever draft time is hidden is a gain."""
    m = model(rtt=0.005)
    tokens = expected_tokens_per_step(0.8, 4)
    assert (
        abs(m.rate(4, 0.8, True, match=True) - tokens / m.step_cost(4, 0.8, True, match=True))
        < 1e-9
    )
    hidden = m.rtt_draft_s.value + m.draft_cost(5)
    verify = m.rtt_target_s.value + m.verify_cost(4)
    draft = m.rtt_draft_s.value + m.draft_cost(4)
    want = verify + (1 - 0.8**5) * draft + 0.8**5 * max(0.0, hidden - verify)
    assert abs(m.step_cost(4, 0.8, True, calibrated=False, match=True) - want) < 1e-12
    cheap = model(draft=0.0001)
    assert cheap.rate(4, 0.8, True, match=True) > cheap.rate(4, 0.8, False)
    assert cheap.choose(0.8, 16, allow_overlap=True, match=True)[1]


def test_plain_runs_are_timed_on_their_own_not_fitted_with_verify_passes():
    """A plain run's back-to-back passes (warm) do not steepen the verify line, whose
    passes each follow an idle gap (the draft's turn); plain steps cost what runs measure."""
    m = CostModel()
    for _ in range(200):
        for gamma in (2, 4, 6):  # cold verify passes: 14 ms + 0.4 ms per token
            m.observe_verify(gamma, 0.016, 0.015, 0.014 + 0.0004 * (gamma + 1), gamma + 1)
        m.observe_verify(0, 0.095, 0.094, 0.088, 1, passes=8)  # warm: 11 ms a pass
    assert abs(m.target_pass.b - 0.0004) < 1e-6 and abs(m.target_pass.a - 0.014) < 1e-6
    assert abs(m.plain_pass_cost() - (0.011 + m.target_extra_s.value)) < 1e-9
    rtt = m.rtt_target_s.value
    assert abs(m.step_cost(0, 0.7, False, run=8) - (rtt + 8 * m.plain_pass_cost())) < 1e-9


def test_under_load_less_speculation_down_to_plain():
    gammas = [model(sessions=n).choose(0.7, 16, False)[0] for n in (1, 4, 16, 64)]
    assert gammas == sorted(gammas, reverse=True) and gammas[0] > gammas[-1]
    assert gammas[-1] == 0, gammas


def test_a_request_starts_at_the_pool_alpha_and_moves_to_its_own():
    m = model()
    m.alpha.value = 0.8
    p = RequestPolicy(m, gamma=None, overlap=False)
    assert abs(p.alpha - 0.8) < 1e-9
    for _ in range(50):
        p.observe(drafted=4, accepted=0)  # this request's drafts are always rejected
    assert p.alpha < 0.2
    assert p.choose(limit=16)[0] <= 1


def test_fixed_gamma_is_kept_within_the_limit():
    p = RequestPolicy(model(), gamma=5, overlap=True)
    assert p.choose(limit=16) == (5, True)
    assert p.choose(limit=2) == (2, True)
    assert p.choose(limit=0) == (0, False)


def test_a_kind_of_step_slower_than_modelled_loses_to_the_others():
    """Drafting ahead that the model thinks free but that measures 1.5x slower (a
    draft competing for the orchestrator's core) is no longer chosen."""
    m = model(rtt=0.005)
    gamma, overlap = m.choose(0.8, 16, allow_overlap=True)
    assert overlap
    for _ in range(100):
        m.observe_step(gamma, True, 0.8, 1.5 * m.step_cost(gamma, 0.8, True, calibrated=False))
        m.observe_step(gamma, False, 0.8, m.step_cost(gamma, 0.8, False, calibrated=False))
    assert abs(m.calibration("overlapped") - 1.5) < 1e-6
    assert abs(m.calibration("sequential") - 1.0) < 1e-6
    assert m.choose(0.8, 16, allow_overlap=True)[1] is False


def test_a_step_is_calibrated_against_its_own_start_not_the_average_one():
    """Steps that took a block drafted ahead skip the draft; if the model compared
    them with the average step, choosing the kinds unevenly (a sequential step after
    each chained one, drafting ahead only after fresh drafts) would read sequential
    steps as cheap and overlapped ones as dear, though each took what it should."""
    m = model(draft=0.002, rtt=0.002)
    a, g = 0.84, 5
    assert m.choose(a, 16, allow_overlap=True) == (g, True)
    for _ in range(100):
        for overlap, drafted in ((True, True), (False, False)):
            took = m.step_cost(g, a, overlap, calibrated=False, drafted=drafted)
            m.observe_step(g, overlap, a, took, drafted=drafted)
    assert abs(m.calibration("overlapped") - 1.0) < 1e-9
    assert abs(m.calibration("sequential") - 1.0) < 1e-9
    assert m.choose(a, 16, allow_overlap=True) == (g, True)
    # Without the step's own start, the same times would tip the choice.
    biased = model(draft=0.002, rtt=0.002)
    for _ in range(100):
        for overlap, drafted in ((True, True), (False, False)):
            took = m.step_cost(g, a, overlap, calibrated=False, drafted=drafted)
            biased.observe_step(g, overlap, a, took, drafted=None)
    assert biased.calibration("overlapped") > 1.05 > 0.95 > biased.calibration("sequential")
    assert biased.choose(a, 16, allow_overlap=True)[1] is False


def test_the_pool_alpha_is_accepted_over_judged_not_a_mean_of_step_ratios():
    import random

    m = model()
    rng = random.Random(0)
    a, gamma = 0.75, 4
    ratios = []
    for _ in range(5000):  # steps whose drafts are accepted with probability a each
        accepted = 0
        while accepted < gamma and rng.random() < a:
            accepted += 1
        judged = accepted + (accepted < gamma)
        m.observe_acceptance(judged, accepted)
        ratios.append(accepted / judged)
    assert sum(ratios) / len(ratios) < 0.62  # what a mean of per-step ratios would say
    assert abs(m.alpha.value - a) < 0.06, m.alpha.value


# ---- the measured check against plain decoding (PlainGuard) ---------------------------------
def _run_epochs(guard: PlainGuard, rates: dict, epochs: int) -> list[str]:
    """Drive ``epochs`` epochs of 4 concurrent requests whose steps emit 4 tokens at
    ``rates[arm]`` tok/s; the arm of each epoch, in order."""
    arms = []
    for _ in range(epochs):
        arm, done = guard.arm, guard.epochs[guard.arm]
        arms.append(arm)
        while guard.epochs[arm] == done:
            for _ in range(4):  # 4 requests at once, one step each
                guard.record(arm, 4, 4 / rates[arm], concurrent=4)
    return arms


def test_plain_decoding_that_measures_faster_leads_and_the_model_gets_trials():
    guard = PlainGuard()
    arms = _run_epochs(guard, {"model": 95.0, "plain": 100.0}, 64)
    assert arms[:4] == ["model", "plain", "model", "plain"]  # warm-up: both measured
    assert guard.leader == "plain"
    assert abs(guard.rates["plain"].value - 100.0) < 1e-6
    later = arms[4:]
    assert later.count("model") == len(later) // 6  # one trial epoch in six, not more
    cost = model()
    cost.guards[True, load_bucket(4)] = guard
    policy = RequestPolicy(cost, gamma=None, overlap=True, greedy=True)
    policy.guard = cost.guard(True, 5)  # 4-7 requests at once: the same load
    assert policy.guard is guard
    if guard.arm == "plain":
        assert policy.choose(8, run=8) == (0, False) and policy.arm == "plain"
    # A request that set gamma is not part of the check, nor is the other class.
    assert RequestPolicy(cost, gamma=3, overlap=False, greedy=True).choose(8) == (3, False)
    assert cost.guard(False, 4).epochs == {"model": 0, "plain": 0}


def test_a_cold_first_epoch_does_not_decide_the_leader():
    """The first epochs meet cold services: speculation's first epoch measures a
    tenth of its rate. The warm-up's second epoch of each arm replaces its first, so
    the model leads from the warm-up on (smoothed in, the cold epoch kept plain
    decoding ahead through the trial epochs that followed)."""
    guard = PlainGuard()
    assert _run_epochs(guard, {"model": 13.0, "plain": 100.0}, 1) == ["model"]
    arms = _run_epochs(guard, {"model": 130.0, "plain": 100.0}, 24)
    assert arms[:3] == ["plain", "model", "plain"]  # the rest of the warm-up
    assert guard.leader == "model" and abs(guard.rates["model"].value - 130.0) < 1e-6
    assert arms[3:].count("plain") <= 2  # trials only
    # After the warm-up an epoch is smoothed in again: one slow epoch is not the rate.
    guard.arm = "model"
    _run_epochs(guard, {"model": 13.0, "plain": 100.0}, 1)
    assert 4 * 13.0 < guard.rates["model"].value < 130.0


def test_each_load_has_its_own_check_and_a_new_load_starts_from_the_nearest():
    """Plain decoding measured faster with 32 requests at once says nothing about one
    request: the two loads keep their own rates and leaders. A load seen for the
    first time starts from the nearest measured one, without a second warm-up."""
    cost = model()
    busy = cost.guard(False, 32)
    _run_epochs(busy, {"model": 90.0, "plain": 100.0}, 40)
    alone = cost.guard(False, 1)
    assert alone is not busy and cost.guard(False, 40) is busy  # 32-63: one load
    assert alone.leader == "plain" and alone.arm == "plain"  # from the nearest (32)
    assert alone.epochs == busy.epochs  # warmed up already
    _run_epochs(alone, {"model": 130.0, "plain": 100.0}, 30)
    assert alone.leader == "model"
    assert busy.leader == "plain" and abs(busy.rates["plain"].value - 100.0) < 1e-6
    between = cost.guard(False, 12)  # 8-15: nearer to 32 (bucket 6) than to 1 (bucket 1)
    assert between.leader == "plain"
    assert [load_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 31, 32, 63, 64, 500)] == [
        1, 1, 2, 2, 3, 3, 4, 5, 6, 6, 7, 7,
    ]  # fmt: skip
    assert cost.guard(True, 32).epochs == {"model": 0, "plain": 0}  # greedy: its own


def test_the_checks_load_is_the_peak_so_a_client_between_requests_moves_no_step():
    """16 clients, each sending its requests one after the other: for a moment after
    each request one client is between two, and 15 generate. The check's load stays
    16 (not below the minimum of 16, not another load's check); a real fall to 8
    shows once the window has passed."""
    cost = model()
    cost.check_min_requests = 16
    load = PeakLoad(window_s=1.0)
    t, seen = 0.0, []
    load.set(16, t)
    for _ in range(400):  # 4 s: every 10 ms a request ends and the next starts 2 ms later
        t += 0.008
        load.set(15, t)
        seen.append(load.value(15, t))
        t += 0.002
        load.set(16, t)
        seen.append(load.value(16, t))
    assert set(seen) == {16}
    assert {cost.guard(False, n) is cost.guard(False, 16) for n in seen} == {True}
    assert cost.guard(False, 15) is None  # what the number right now would have given
    for n in range(15, 7, -1):  # half the clients stop
        load.set(n, t)
    assert load.value(8, t + 0.5) == 16  # within the window: the peak
    assert load.value(8, t + 1.01) == 8  # after it: the load now
    load.set(9, t + 1.2)
    assert load.value(9, t + 1.3) == 9


def test_a_drafts_cost_per_call_is_not_charged_per_token():
    """A propose call that spends 3 ms beyond its forwards whatever its gamma (the
    call's own work) makes longer drafts cheaper per token. Fitted as a line in gamma,
    it is charged once: the draft's time at gamma 6, learned from calls of 2 and 4
    tokens, is 3 ms plus six tokens' passes (an average per token would charge the 3 ms
    about twice), and the longer drafts that this makes worth it are chosen."""
    m = model()
    for i in range(80):
        g = 2 + 2 * (i % 2)
        forward = g * 0.001
        m.observe_draft(g, forward + 0.0035, forward + 0.003, forward, batch_tokens=1.0)
    assert abs(m.draft_cost(6) - (0.003 + 6 * m.draft_pass(1.0))) < 2e-4
    assert abs(m.draft_token_s() - m.draft_pass(1.0)) < 1e-4
    per_token = model()  # the same times, charged per drafted token
    per_token.draft_pass = m.draft_pass
    per_token.draft_extra.b = 0.003 / 3
    assert m.choose(0.8, 16, False)[0] > per_token.choose(0.8, 16, False)[0]


def test_below_its_minimum_load_the_check_leaves_the_choice_to_the_model():
    """With check_min_requests 8, fewer requests at once get no guard (the model
    alone chooses, nothing is charged) and 8 or more get the guard of their load."""
    cost = model()
    cost.check_min_requests = 8
    assert cost.guard(False, 1) is None and cost.guard(True, 7) is None
    busy = cost.guard(False, 8)
    assert busy is not None and cost.guard(False, 15) is busy
    _run_epochs(busy, {"model": 90.0, "plain": 100.0}, 40)
    assert busy.leader == "plain"
    policy = RequestPolicy(cost, None, overlap=False)
    cost.alpha.value = 0.9
    policy.guard = cost.guard(False, 4)  # what the engine sets at 4 requests: none
    assert policy.choose(8)[0] > 0 and policy.arm == "model"
    policy.guard = cost.guard(False, 9)
    assert (policy.choose(8) == (0, False)) == (busy.arm == "plain")
    assert policy.arm == busy.arm


def test_a_model_far_ahead_of_plain_is_rarely_checked_and_a_change_is_seen():
    guard = PlainGuard()
    arms = _run_epochs(guard, {"model": 130.0, "plain": 100.0}, 64)
    assert guard.leader == "model"
    assert arms[4:].count("plain") == len(arms[4:]) // 12  # far behind: one in twelve
    # The network slows down: speculation now loses to plain decoding, and the
    # trial epochs find it.
    arms = _run_epochs(guard, {"model": 60.0, "plain": 100.0}, 40)
    assert guard.leader == "plain"
    assert arms[-12:].count("plain") >= 9


def test_an_epoch_is_its_requests_time_and_a_late_step_counts_for_its_own_arm():
    guard = PlainGuard()
    for _ in range(50):  # one request, 50 short steps: 0.05 s of its time, not an epoch
        guard.record("model", 1, 0.001)
    assert guard.epochs["model"] == 0
    _run_epochs(guard, {"model": 100.0, "plain": 100.0}, 1)
    assert guard.arm == "plain"
    guard.record("model", 1000, 1.0)  # chosen under the model, done now
    assert guard.epochs["plain"] == 0 and guard._steps == 0
    _run_epochs(guard, {"model": 100.0, "plain": 100.0}, 2)
    assert guard.rates["model"].value > 150.0  # the late step is in the model's epoch
    assert abs(guard.rates["plain"].value - 100.0) < 1e-6


def test_a_lone_clients_short_requests_still_end_epochs():
    """Requests shorter than an epoch, one after the other: the epoch is half a
    second of the pool's time, not half a second of each request it saw."""
    guard = PlainGuard()
    for _ in range(6):  # six requests of 0.1 s and 10 steps each
        for _ in range(10):
            guard.record("model", 2, 0.01, concurrent=1)
    assert guard.epochs["model"] == 1 and guard.arm == "plain"


def test_a_first_rejection_does_not_zero_the_pools_acceptance_rate():
    """The pool's alpha starts from its prior: one rejected first draft must not
    make every later request decode plain."""
    m = model()
    m.observe_acceptance(judged=1, accepted=0)
    assert 0.6 < m.alpha.value < 0.7, m.alpha.value
    assert RequestPolicy(m, gamma=None, overlap=False).choose(8, run=8)[0] > 0


def test_a_plain_pool_of_short_requests_still_drafts_now_and_then():
    """While the model prefers plain decoding, a step drafts once per 64 plain tokens
    of the pool, even when every request is too short to take many steps itself."""
    m = model(target_a=0.001, draft=0.05)  # drafting far too slow: the model goes plain
    drafted = 0
    for _ in range(16):  # 16 requests of 3 plain runs of 8 tokens: 384 plain tokens
        policy = RequestPolicy(m, gamma=None, overlap=False)
        for _ in range(3):
            gamma, _ = policy.choose(8, run=8)
            drafted += gamma > 0
            m.observe_step(gamma, False, policy.alpha, 0.01, run=1 if gamma else 8)
    assert 4 <= drafted <= 7, drafted  # about one in 64 plain tokens


def test_a_few_unlucky_steps_do_not_pull_the_pool_to_plain_decoding():
    """Measured on the demo pair, greedy: the pool's alpha, smoothed over ~10 steps,
    fell from 0.70 to 0.58 over one request's bad start. Near 0.55 plain runs look
    as fast as drafting, plain steps judge no drafts, and the pool drifted to 0.43
    on exploring steps alone, every request decoding plain (0.83x of fixed gamma 4).
    Over ~30 steps the same start moves it by 0.04."""
    m = model()
    for accepted, judged in [(1, 2), (0, 1), (1, 2), (2, 3)]:
        m.observe_acceptance(judged, accepted, greedy=True)
    assert 0.65 < m.pool_alpha(True).value < 0.7
    assert m.pool_alpha(False).value == 0.7  # sampled requests keep their own


@pytest.mark.parametrize("per_request, want", [(True, (1, 3)), (False, (10, 14))])
def test_under_load_each_request_explores_about_once_per_64_of_its_plain_tokens(per_request, want):
    """8 requests at once, each decoding 96 plain tokens in runs of 8. Once per 64
    plain tokens of the pool (the old rule) drafts one step in eight of every
    request, at any load: where plain decoding wins under load, an eighth of the
    steps speculate and their rejected tokens cost every session's shared pass.
    Per request generating at once, about once per 64 of each one's tokens."""
    m = model(target_a=0.001, draft=0.05)  # drafting far too slow: the model goes plain
    m.explore_per_request = per_request
    policies = [RequestPolicy(m, gamma=None, overlap=False, load=8) for _ in range(8)]
    drafted = 0
    for _ in range(12):  # steps
        for policy in policies:
            gamma, _ = policy.choose(8, run=8)
            drafted += gamma > 0
            m.observe_step(gamma, False, policy.alpha, 0.01, run=1 if gamma else 8)
    assert want[0] <= drafted <= want[1], drafted


def test_an_exploring_step_drafts_what_the_model_would_if_drafting_paid():
    m = model(target_a=0.001, draft=0.05)  # drafting far too slow: the model goes plain
    m.plain_tokens = 64
    policy = RequestPolicy(m, gamma=None, overlap=True)
    best = m.choose(policy.alpha, 8, True, plain=False)
    assert best[0] >= 1 and policy.choose(8, run=8) == best
    assert policy.choose(8, run=8) == (0, False)  # the next one decodes plain again


# ---- pipelined steps (orchestrator.pipeline) ---------------------------------------------


def test_a_pipelined_step_waits_for_the_draft_only_when_its_block_was_not_relayed_ahead():
    """A pipeline's step costs the verify; when the block before it was not accepted in
    full (and, greedy, no guess covered the rejection) also a round trip to the draft
    and the drafting, never a round trip to the orchestrator."""
    m = model(rtt=0.010)
    verify, wait = m.verify_cost(4), m.rtt_draft_s.value + m.draft_cost(4)
    assert m.step_cost(4, 0.8, True, pipelined=True, drafted=False) == pytest.approx(verify)
    assert m.step_cost(4, 0.8, True, pipelined=True, drafted=True) == pytest.approx(verify + wait)
    ready = 0.8**4
    want = verify + (1 - ready) * wait
    assert m.step_cost(4, 0.8, True, calibrated=False, pipelined=True) == pytest.approx(want)
    # Greedy: the follower chains with its bonus matched, and guesses cover rejections
    # (a bonus the follower missed is no rejection, and no guess covers it).
    m.guess_cover.value = 0.7
    ready = 0.8**5 + (1 - 0.8**4) * 0.7
    got = m.step_cost(4, 0.8, True, calibrated=False, match=True, pipelined=True)
    assert got == pytest.approx(verify + (1 - ready) * wait)
    assert m.rate(4, 0.8, True, pipelined=True) == pytest.approx(
        (expected_tokens_per_step(0.8, 4) - 0.8**4) / m.step_cost(4, 0.8, True, pipelined=True)
    )


def test_a_paced_step_pays_the_draft_round_trip_not_the_orchestrators():
    """A paced step (``orchestrator.paced``: a sequential step the draft paces) costs its
    verify, a round trip to the draft and the drafting, never the target's round trip
    to the orchestrator nor a lead of a block drafted on; it keeps its bonus (nothing
    chains), is calibrated as its own kind, and the policy prices sequential steps
    with it when a step would start one."""
    m = model(rtt=0.010)
    paced = m.verify_cost(4, 0.5) + m.rtt_draft_s.value + m.draft_cost(4)
    got = m.step_cost(4, 0.8, False, calibrated=False, pipelined=True, wide=0.5)
    assert got == pytest.approx(paced)
    assert got < m.step_cost(4, 0.8, False, calibrated=False, wide=0.5)  # an asked step's
    assert m.rate(4, 0.8, False, pipelined=True) == pytest.approx(
        expected_tokens_per_step(0.8, 4) / m.step_cost(4, 0.8, False, pipelined=True)
    )
    g, overlap = m.choose(0.8, 16, False, paced=True)
    assert not overlap and m.rate(g, 0.8, False, pipelined=True) > m.rate(g, 0.8, False)
    m.observe_step(4, False, 0.8, 2 * paced, pipelined=True, wide=True)
    assert m.calibration("paced") > 1.0 and m.calibration("sequential") == 1.0


def test_at_a_long_round_trip_a_pipeline_beats_the_plain_runs_that_steps_it_asks_for_lose_to():
    """At 10 ms a round trip, plain runs of 8 beat a fair draft's steps that pay the
    round trip each (``test_plain_runs_pay_the_round_trip_once``); priced as a
    pipeline's, the same draft wins, drafting ahead."""
    m = model(rtt=0.010)
    assert m.choose(0.7, 16, True, run=8) == (0, False)
    gamma, overlap = m.choose(0.7, 16, True, run=8, pipelined=True)
    assert gamma > 0 and overlap
    assert m.rate(gamma, 0.7, True, pipelined=True) > m.rate(0, 0.7, False, run=8)


def test_guesses_that_cover_greedy_rejections_make_greedy_pipelines_cheaper():
    m = model(rtt=0.010)
    m.observe_guess_cover(False)
    without = m.rate(4, 0.7, True, match=True, pipelined=True)
    for _ in range(100):
        m.observe_guess_cover(True)
    assert m.guess_cover.value > 0.95
    assert m.rate(4, 0.7, True, match=True, pipelined=True) > 1.3 * without
    assert m.rate(4, 0.7, True, pipelined=True) == pytest.approx(
        model(rtt=0.010).rate(4, 0.7, True, pipelined=True)
    )  # sampled pipelines relay no guesses


def test_guesses_are_priced_by_the_position_rejected():
    """The draft guesses at its first positions only: a rejection past them waits for a
    fresh block whatever the share covered before them, so a long greedy block's
    guesses are priced by where its rejections land (``covered_rejection``). Priced
    with one share for every position, 8 drafts looked about as fast as 4."""
    alpha = 0.7
    flat, positional = model(rtt=0.010), model(rtt=0.010)
    for _ in range(50):
        flat.observe_guess_cover(True)
        for j in (1, 2, 3, 4):
            positional.observe_guess_cover(True, j)
    # Nothing seen past position 4 yet: those positions take position 4's share.
    assert positional.covered_rejection(8, alpha) == pytest.approx(1 - alpha**8)
    for j in (5, 6):  # rejections there, never covered (the draft guesses at 4)
        positional.observe_guess_cover(False, j)
    assert positional.covered_rejection(4, alpha) == pytest.approx(1 - alpha**4)
    assert positional.covered_rejection(8, alpha) == pytest.approx(1 - alpha**4)

    def rate(m, g):
        return m.rate(g, alpha, True, match=True, pipelined=True)

    assert rate(positional, 4) == pytest.approx(rate(flat, 4))
    assert rate(positional, 8) < 0.9 * rate(flat, 8)
    g, overlap = positional.choose(alpha, 16, True, match=True, pipelined=True)
    assert overlap and g < flat.choose(alpha, 16, True, match=True, pipelined=True)[0]


def test_pipelined_steps_are_calibrated_as_their_own_kind():
    m = model(rtt=0.010)
    for _ in range(50):  # measured twice as long as modelled, waiting or not
        for drafted in (True, False):
            cost = m.step_cost(4, 0.8, True, calibrated=False, pipelined=True, drafted=drafted)
            m.observe_step(4, True, 0.8, 2 * cost, drafted=drafted, pipelined=True)
    assert m.calibration("pipelined") == pytest.approx(2.0, rel=0.01)
    assert m.calibration("overlapped") == 1.0
    assert m.step_cost(4, 0.8, True, pipelined=True) == pytest.approx(
        2 * m.step_cost(4, 0.8, True, calibrated=False, pipelined=True), rel=0.01
    )


def test_an_adaptive_request_prices_drafting_ahead_as_a_pipeline_only_where_one_would_start():
    m = model(rtt=0.010)
    policy = RequestPolicy(m, gamma=None, overlap=True)
    assert policy.choose(16, run=8) == (0, False)
    policy.pipelined = True
    gamma, overlap = policy.choose(16, run=8)
    assert gamma > 0 and overlap
