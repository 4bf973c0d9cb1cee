"""The benchmark report's arithmetic (no models): the held-out best fixed gamma."""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks.report import held_out_best


def test_each_round_is_compared_with_the_best_of_the_other_rounds():
    fixed = {
        "seq4": [100.0, 100.0, 130.0],  # best only because of round 2
        "seq5": [110.0, 110.0, 110.0],
    }
    r = held_out_best([110.0, 110.0, 110.0], fixed)
    # rounds 0 and 1: the others' medians are seq4 115, seq5 110; round 2: 100 and 110
    assert r["picks"] == ["seq4", "seq4", "seq5"]
    assert r["ratios"] == [1.1, 1.1, 1.0]
    assert r["ratio"] == pytest.approx(1.1)
    assert r["in_sample"] == pytest.approx(1.0)


def test_one_round_falls_back_to_the_in_sample_best():
    r = held_out_best([90.0], {"seq4": [100.0], "seq5": [80.0]})
    assert r["picks"] == ["seq4"] and r["ratio"] == pytest.approx(0.9)


def test_rounds_must_match():
    with pytest.raises(ValueError):
        held_out_best([1.0, 2.0], {"seq4": [1.0]})


def test_the_held_out_best_is_not_biased_like_the_largest_median():
    """Twelve fixed configurations and a candidate, all truly equal, 5% noise per
    round: the largest median sits well above the truth, so the in-sample ratio
    reads low; the held-out ratio centres on 1."""
    rng = random.Random(7)
    in_sample, held = [], []
    for _ in range(300):
        runs = {f"c{k}": [100 * rng.gauss(1, 0.05) for _ in range(5)] for k in range(12)}
        cand = [100 * rng.gauss(1, 0.05) for _ in range(5)]
        r = held_out_best(cand, runs)
        in_sample.append(r["in_sample"])
        held.append(r["ratio"])
    assert statistics.mean(in_sample) < 0.97
    assert abs(statistics.mean(held) - 1.0) < 0.015


def test_pass_cost_fit_tells_a_session_from_its_tokens():
    """``benchmarks.pass_cost.fit`` recovers a pass's parts from a grid made with them:
    what every pass pays, what a token adds, and what a session adds beyond its tokens;
    a line in tokens alone through the 5-token sessions' passes reads b + c / 5."""
    from benchmarks.pass_cost import fit

    a, b, c = 4.0, 0.2, 0.5
    rows = [
        {"context": 100, "tokens_per_session": n, "sessions": s,
         "ms": a + b * n * s + c * s, "one_session_ms": a + b * n * s + c}
        for n in (1, 5) for s in (1, 2, 4, 8)
    ]  # fmt: skip
    got = fit(rows)["100"]
    assert got["a_ms"] == pytest.approx(a)
    assert got["b_ms_per_token"] == pytest.approx(b)
    assert got["c_ms_per_session"] == pytest.approx(c)
    assert got["line_ms_per_token"] == pytest.approx(b + c / 5)
