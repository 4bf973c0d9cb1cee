"""Where a pipelined request's time goes (``benchmarks.pipeline_timeline``): the
analysis on made-up marks, and one run through real services."""

from __future__ import annotations

import json

import pytest

from benchmarks.pipeline_timeline import (
    FRESH_PATH,
    analyse,
    busy_share,
    echo_delays,
    fresh_segments,
    target_passes,
)
from benchmarks.timeline import Mark

from .benchrun import run_benchmark


def _marks(*rows: tuple[float, str]) -> list[Mark]:
    """Marks from (ms, "role:label") rows."""
    return [Mark(ms / 1000, *name.split(":")) for ms, name in rows]


# A follower chained at once, then a rejection whose fresh block came from the draft.
TIMELINE = _marks(
    (0.0, "target:forward"),
    (9.0, "target:forward_end"),
    (10.0, "target:reply"),  # verdict 1: every draft accepted
    (10.2, "target:chain-follower"),
    (10.5, "target:forward"),  # the follower, 1.5 ms after the last pass
    (16.0, "draft:pipeline-echo"),  # verdict 1 reaches the draft
    (19.5, "target:forward_end"),
    (20.0, "target:reply"),  # verdict 2: a rejection nothing covers
    (26.0, "draft:pipeline-echo"),
    (26.1, "draft:pipeline-settle"),
    (30.0, "draft:pipeline-drafted"),
    (30.4, "draft:pipeline-relayed"),
    (35.4, "target:relay"),
    (35.5, "target:chain-fresh"),
    (35.6, "target:forward"),
    (45.6, "target:forward_end"),
)


def test_passes_carry_their_gap_and_the_kind_of_block_they_ran():
    passes = target_passes(TIMELINE)
    assert [k for _, _, k in passes] == ["follower", "fresh"]
    assert [round(1000 * g, 1) for _, g, _ in passes] == [1.5, 16.1]


def test_busy_share_counts_forward_passes_only():
    assert busy_share(TIMELINE, 0.0456) == pytest.approx((9.0 + 9.0 + 10.0) / 45.6)


def test_a_fresh_blocks_gap_splits_into_its_path():
    segments = fresh_segments(TIMELINE)
    assert list(segments) == [
        f"{a} -> {b}" for a, b in zip(FRESH_PATH, FRESH_PATH[1:], strict=False)
    ]
    ms = {k: round(1000 * v[0], 1) for k, v in segments.items()}
    assert ms["target:reply -> draft:pipeline-echo"] == 6.0
    assert ms["draft:pipeline-settle -> draft:pipeline-drafted"] == 3.9
    assert ms["draft:pipeline-drafted -> target:relay"] == 5.4
    # the segments tile the verdict-to-pass time
    assert sum(v[0] for v in segments.values()) == pytest.approx(0.0356 - 0.020)


def test_a_relay_the_target_holds_before_the_draft_marks_it_sent_keeps_its_path():
    """The draft marks ``pipeline-relayed`` when its write completes, which may be
    after the target read the block: the path does not go through that mark (it
    once did, and paired such a block with the step before it)."""
    late = [m if m.label != "pipeline-relayed" else Mark(0.0360, m.role, m.label) for m in TIMELINE]
    late.sort(key=lambda m: m.t)
    assert fresh_segments(late) == fresh_segments(TIMELINE)


def test_a_fresh_block_whose_marks_interleave_with_another_step_is_left_out():
    shuffled = [
        m if m.label != "pipeline-drafted" else Mark(0.0401, m.role, m.label) for m in TIMELINE
    ]
    shuffled.sort(key=lambda m: m.t)
    assert not fresh_segments(shuffled)


def test_echoes_split_by_whether_the_target_went_straight_on():
    delays = echo_delays(TIMELINE)
    assert [round(1000 * d, 1) for d in delays["next pass at once"]] == [6.0]
    assert [round(1000 * d, 1) for d in delays["target idle"]] == [6.0]


def test_analyse_keeps_to_the_measured_windows():
    result = analyse(TIMELINE, [(0.005, 0.050)])  # the first pass started before it
    assert result["passes"] == 2 and set(result["gaps"]) == {"follower", "fresh"}
    assert result["gaps"]["fresh"]["median"] == pytest.approx(16.1)


def test_pipeline_timeline_through_real_services(tmp_path):
    """``python -m benchmarks.pipeline_timeline`` on the demo pair, one short round,
    with the target's lookahead on: the target's passes ran pipelined blocks, and the
    report says how long it idled and how much of its own continuation it used."""
    run_benchmark(
        "benchmarks.pipeline_timeline", "--rtt-ms", "5", "--rounds", "1", "--prompts", "1",
        "--max-new-tokens", "24", "--out", str(tmp_path), "--set", "target.lookahead_tokens=2",
    )  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert 0 < result["target_busy_share"] < 1 and result["tok_s"] > 0
    assert set(result["gaps"]) - {"other"}, result["gaps"]  # some pipelined block ran
    assert result["counts"]["lookahead decoded"] > 0 and result["counts"]["lookahead used"] > 0
    assert "| idle gap before a pass that ran |" in (tmp_path / "results.md").read_text()
