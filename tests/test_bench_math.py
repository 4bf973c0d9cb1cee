"""The benchmark report's arithmetic (no models): the held-out best fixed gamma, paired rounds."""

from __future__ import annotations

import os
import random
import statistics

import pytest

from benchmarks.report import criteria, held_out_best, paired_ratios, rounds_cell


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


def test_paired_ratios_divide_round_by_round():
    assert paired_ratios([110.0, 90.0], [100.0, 100.0]) == pytest.approx([1.1, 0.9])
    assert paired_ratios([110.0, 90.0], [100.0, 50.0], 0.5) == pytest.approx([0.55, 0.9])
    # No spread to show: one round, rounds that do not pair, or no rounds.
    assert paired_ratios([110.0], [100.0]) is None
    assert paired_ratios([110.0, 90.0], [100.0, 100.0, 100.0]) is None
    assert paired_ratios(None, [100.0, 100.0]) is None


def test_a_criterion_carries_its_paired_rounds_and_says_how_many_meet():
    r = {
        "concurrency": {
            "2": {
                "plain": {"tok_s": 100.0, "runs": [100.0, 100.0, 80.0]},
                "adaptive": {"tok_s": 95.0, "runs": [90.0, 101.0, 84.0]},
            }
        }
    }
    (c,) = [c for c in criteria(r) if c["criterion"].startswith("14: 2 clients")]
    assert c["value"] == pytest.approx(0.95) and not c["met"]
    assert c["rounds"] == pytest.approx([0.9, 1.01, 1.05])
    assert rounds_cell(c) == "0.90-1.05, 2 of 3 meet"
    # A goal to stay below counts the rounds at or under it.
    low = {"goal": 1.0, "higher_is_better": False, "rounds": [0.9, 1.01, 1.0]}
    assert rounds_cell(low) == "0.90-1.01, 2 of 3 meet"
    assert rounds_cell({"rounds": None}) == "-"


def test_cpu_share_ceilings_follow_the_cpu_per_token():
    """benchmarks.cpu_share: medians over rounds, the target thread's ceiling from its
    own CPU per token, the stack's from every process's over all cores."""
    from benchmarks.cpu_share import cpu_seconds, report, summary

    def rnd(tok_s: float, target: float) -> dict:
        per = {"draft": 1.0, "target": target, "orchestrator": 0.5, "client": 0.5}
        return {"tok_s": tok_s, "cores_busy": 1.5, "cpu_ms_per_token": per}

    s = summary([rnd(100.0, 2.0), rnd(300.0, 4.0), rnd(200.0, 3.0)], cores=2)
    assert s["tok_s"] == 200.0
    assert s["cpu_ms_per_token"]["target"] == 3.0
    assert s["total_cpu_ms_per_token"] == pytest.approx(5.0)
    assert s["target_ceiling_tok_s"] == pytest.approx(1000 / 3)
    assert s["stack_ceiling_tok_s"] == pytest.approx(2 * 1000 / 5.0)
    result = {
        "machine": {
            "date": "d",
            "git_commit": "c",
            "cpu_model": "m",
            "cpu_cores": 2,
            "load_average": [0.1, 0, 0],
        },
        "load_average_end": [0.2, 0, 0],
        "temperature": 1.0,
        "rounds": 3,
        "runs": {"1": {"seq4": s}, "8": {"seq4": s | {"tok_s": 600.0}}},
    }
    # 8 clients at 600 tok/s: 3x one client's; 4x (800) is above the stack's ceiling (400)
    assert "- 8 clients, seq4: 3.00x; 4x = 800 tok/s, ceiling 400" in report(result)
    assert cpu_seconds(os.getpid()) > 0  # this process has run


def test_head_to_head_compares_within_each_round():
    """benchmarks.head_to_head: plain / generate() round by round; each side's best is
    the configuration fastest over the other rounds; overlapped / sequential at the
    gamma overlapped picked."""
    from benchmarks.head_to_head import (
        criteria,
        held_out_series,
        overhead_gamma,
        overhead_ms,
    )

    # seq3 is fastest in round 2 only: the other rounds pick seq4 there too
    fam = {"seq3@1": [100.0, 100.0, 130.0], "seq4@1": [120.0, 120.0, 115.0]}
    series, picks = held_out_series(fam)
    assert picks == ["seq4@1", "seq4@1", "seq4@1"] and series == [120.0, 120.0, 115.0]
    shared = {
        "generate@1": [100.0, 50.0, 100.0],  # the VM halved its speed in round 1 ...
        "plain@1": [98.0, 49.0, 97.0],  # ... for both sides of this ratio alike
        "assisted4@1": [110.0, 110.0, 110.0],
        "adaptive@1": [110.0, 55.0, 121.0],
        **fam,
    }
    rows = {r["criterion"]: r for r in criteria(shared, "shared", [1.0])}
    assert rows["15: plain / generate(), T=1"]["ratio"] == pytest.approx(0.98)
    best = rows["15: specdec best gamma / assisted best k, T=1"]
    assert best["ratios"] == [pytest.approx(120 / 110, abs=1e-3)] * 2 + [
        pytest.approx(115 / 110, abs=1e-3)
    ]
    pinned = {
        "assisted4@1": [100.0, 100.0, 100.0],
        "seq2@1": [100.0, 100.0, 100.0],
        "ovl2@1": [120.0, 130.0, 125.0],
        "seq3@1": [90.0, 90.0, 90.0],
        "ovl3@1": [110.0, 110.0, 110.0],
    }
    # issue 15's overhead: ms a step by round, at most 1.0 (lower is better)
    overheads = {"seq4@1": [2.0, 1.5, 3.0], "one_seq4@1": [0.9, 1.1, 0.8]}
    rows = {r["criterion"]: r for r in criteria(shared, "shared", [1.0], overheads)}
    services = rows["15: overhead at gamma 4, ms a step, T=1"]
    assert services["ratio"] == 2.0 and services["goal"] == 1.0
    assert not services["higher_is_better"]
    assert rows["15, one process: overhead at gamma 4, ms a step, T=1"]["ratio"] == 0.9
    assert overhead_ms(
        {"steps": 10, "steps_s": 0.2, "draft_forward_s": 0.05, "target_forward_s": 0.14}
    ) == pytest.approx(1.0)
    assert overhead_gamma([2, 3, 4, 5]) == 4 and overhead_gamma([3]) == 3
    rows = {r["criterion"]: r for r in criteria(pinned, "pinned", [1.0])}
    same = rows["10: overlapped / sequential at the same gamma, T=1"]
    assert same["picks"] == ["ovl2@1"] * 3  # against seq2, not the slower seq3
    assert same["ratio"] == pytest.approx(1.25)
    assert rows["10: overlapped best / assisted best k on the target's core, T=1"]["goal"] == 1.3


def test_requests_left_to_choose_gamma_are_sent_unseeded():
    """The orchestrator chooses gamma only for a request with neither gamma nor seed:
    a benchmark's "adaptive" row ({"gamma": None}) must go unseeded, or it measures
    the configured default gamma instead (as several did before 2026-12-06)."""
    from benchmarks.run import seeded

    assert seeded({"gamma": None, "temperature": 1.0}, 7) == {"gamma": None, "temperature": 1.0}
    assert seeded({"gamma": 4}, 7) == {"gamma": 4, "seed": 7}
    assert seeded({"temperature": 1.0}, 7) == {"temperature": 1.0, "seed": 7}
    assert seeded({"gamma": 4, "seed": None}, 7) == {"gamma": 4, "seed": None}
    assert seeded({"gamma": None, "seed": 3}, 7) == {"gamma": None, "seed": 3}
