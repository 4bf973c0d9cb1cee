"""The step timeline: services' marks (``specdec.tracing``) merged into segments
(``benchmarks.timeline``), on made-up marks and through a real local stack."""

from __future__ import annotations

import json

from benchmarks.timeline import Mark, critical_path, read_marks, steps_of
from specdec import tracing

from .benchrun import run_benchmark


def _step(t0: float, relayed: bool, first_forward: float = 1.0) -> list[Mark]:
    """One made-up sequential step of gamma 2 (times in ms from t0; it ends at
    ``t0 + 9.4 + first_forward`` ms, where the next one starts)."""
    names = [
        (0.0, "orchestrator", "step"),
        (0.1, "orchestrator", "propose"),
        (0.6, "draft", "propose"),
        (0.7, "draft", "forward"),
        (0.7 + first_forward, "draft", "forward_end"),
        (1.8 + first_forward, "draft", "forward"),
        (2.3 + first_forward, "draft", "forward_end"),
        (2.5 + first_forward, "draft", "drafted"),
    ]
    at = 2.5 + first_forward
    if relayed:
        names += [
            (at + 0.4, "draft", "relayed"),
            (at + 0.41, "draft", "reply"),
            (at + 0.5, "target", "relay"),
            (at + 0.6, "target", "verify"),
            (at + 0.8, "orchestrator", "proposed"),  # off the path: the target has it
        ]
    else:
        names += [
            (at + 0.01, "draft", "reply"),
            (at + 0.5, "orchestrator", "proposed"),
            (at + 0.6, "target", "verify"),
        ]
    names += [
        (at + 0.7, "target", "unpacked"),
        (at + 0.9, "target", "forward"),
        (at + 5.9, "target", "forward_end"),
        (at + 6.1, "target", "judged"),
        (at + 6.2, "target", "reply"),
        (at + 6.7, "orchestrator", "verified"),
        (at + 6.9, "orchestrator", "settled"),
    ]
    return [Mark(t0 + ms / 1e3, role, label) for ms, role, label in names]


def _chain(steps: list[tuple[bool, float]]) -> list[Mark]:
    """Made-up steps back to back: (relayed, first forward ms) each."""
    marks, t = [], 0.0
    for relayed, first in steps:
        marks += _step(t, relayed, first)
        t = marks[-1].t
    return marks


def test_steps_tile_their_wall_time_and_the_usual_shape_wins():
    # Six relayed steps, then a direct one: six steps from verify to verify.
    marks = _chain([(True, 1.0 + 0.1 * i) for i in range(6)] + [(False, 1.0)])
    steps = steps_of(marks)
    assert len(steps) == 6
    assert all(s[0].name == "target:verify" and s[-1].name == "target:verify" for s in steps)
    # A relayed step loses the orchestrator's off-path "proposed" mark.
    assert all("orchestrator:proposed" not in [m.name for m in s] for s in steps[:5])
    assert "orchestrator:proposed" in [m.name for m in steps[5]]  # the direct one
    r = critical_path(steps)
    assert r["shape_steps"] == 5 and r["steps"] == 6
    total = sum(s["ms"] for s in r["segments"])
    assert abs(total - r["shape_step_ms"]) < 1e-6  # identical shapes: medians tile
    kinds = [(s["from"], s["to"], s["kind"]) for s in r["segments"]]
    assert ("target:forward", "target:forward_end", "forward") in kinds
    assert ("draft:reply", "target:relay", "hop") in kinds
    assert ("target:verify", "target:unpacked", "work") in kinds
    assert ("target:reply", "orchestrator:verified", "hop") in kinds
    assert abs(r["by_kind"]["forward"] - (1.3 + 0.5 + 5.0)) < 1e-6  # median first: 1.3
    assert abs(sum(r["work_by_role"].values()) - r["by_kind"]["work"]) < 1e-6
    assert abs(r["work_by_role"]["target"] - (0.1 + 0.1 + 0.2 + 0.2 + 0.1)) < 1e-6
    assert [round(x, 6) for x in r["draft_forward_ms"]] == [1.3, 0.5]


def test_a_drafted_on_step_runs_target_to_draft_without_the_orchestrator():
    """With drafting on, the draft drafts from the target's echo while the orchestrator
    settles and confirms: its marks are off the step's path."""
    names = [
        (0.0, "target", "verify"),
        (5.0, "target", "reply"),
        (5.5, "draft", "echo"),
        (5.6, "orchestrator", "verified"),
        (5.7, "draft", "forward"),
        (5.8, "orchestrator", "settled"),
        (5.9, "orchestrator", "step"),
        (6.0, "orchestrator", "propose"),
        (6.7, "draft", "forward_end"),
        (6.8, "draft", "propose"),
        (6.9, "draft", "forward"),
        (7.4, "draft", "forward_end"),
        (7.5, "draft", "drafted"),
        (7.9, "draft", "relayed"),
        (7.91, "draft", "reply"),
        (8.0, "orchestrator", "proposed"),
        (8.1, "target", "relay"),
        (8.2, "target", "verify"),
    ]
    marks = [Mark(ms / 1e3, role, label) for ms, role, label in names]
    (step,) = steps_of(marks)
    assert all(m.role != "orchestrator" for m in step)
    r = critical_path([step])
    assert abs(sum(s["ms"] for s in r["segments"]) - 8.2) < 1e-6
    assert "orchestrator" not in r["work_by_role"]
    assert ("target:reply", "draft:echo", "hop") in [
        (s["from"], s["to"], s["kind"]) for s in r["segments"]
    ]
    assert [round(x, 6) for x in r["draft_forward_ms"]] == [1.0, 0.5]


def test_no_steps_no_segments():
    assert critical_path([])["segments"] == []
    # marks without a second verify are not a step
    assert steps_of([Mark(0.0, "target", "verify"), Mark(0.1, "target", "unpacked")]) == []


def test_tracing_writes_marks_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(tracing.ENV, raising=False)
    tracing.start("draft")
    tracing.mark("nothing")
    tracing.close()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(tracing.ENV, str(tmp_path))
    tracing.start("draft")
    tracing.mark("propose")
    tracing.mark("drafted")
    tracing.close()
    marks = read_marks(tmp_path)
    assert [m.name for m in marks] == ["draft:propose", "draft:drafted"]
    assert marks[0].t <= marks[1].t


def test_timeline_through_a_real_stack(tmp_path, llama_pair):
    """``python -m benchmarks.timeline`` on the tiny pair: every service wrote
    marks, and the speculative steps have forwards, hops and work."""
    draft, target = llama_pair
    run_benchmark(
        "benchmarks.timeline", "--draft", str(draft), "--target", str(target),
        "--configs", "seq2@1", "plain@0", "--repeats", "1", "--max-new-tokens", "8",
        "--out", str(tmp_path),
    )  # fmt: skip
    roles = {p.name.split("-")[0] for p in (tmp_path / "trace").glob("*.trace")}
    assert roles == {"orchestrator", "draft", "target"}
    result = json.loads((tmp_path / "results.json").read_text())
    seq = result["configs"]["seq2@1"]
    assert seq["shape_steps"] > 0
    assert {"forward", "hop", "work"} <= set(seq["by_kind"])
    assert len(seq["draft_forward_ms"]) == 2
    assert result["configs"]["plain@0"]["steps"] > 0
    assert "## seq2@1" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "timeline.png").stat().st_size > 0
