"""Where a speculation step's wall time goes, segment by segment, from the
services' own marks (``specdec.tracing``).

    python -m benchmarks.timeline [--configs seq4@0 seq4@1] [--repeats 2]
        [--max-new-tokens 64] [--pin] [--out results/timeline-<time>]

Starts draft, target and orchestrator on this machine (one torch thread each,
as ``make bench`` does; ``--pin``: one core each) with ``SPECDEC_TRACE_DIR``
set, runs the benchmark prompts one request at a time for each configuration,
stops the services, and merges their marks into one timeline (one clock: the
machine's monotonic clock).

A step is every mark from one target ``verify`` to the next (``steps_of``:
the step as the target sees it, which tiles time whatever the route; marks
off the path dropped). Consecutive marks tile the step's wall time:
each gap is a *segment*, named by the marks at its ends, and is a forward pass
(``forward`` to ``forward_end``), a hop (marks of two different services) or
work inside one service. The report gives each segment's median over the
steps of the configuration's usual shape (the most common sequence of marks:
full-length drafts, relayed or not), so that the medians add up to a typical
step; and the draft's forward time by position in the step.

The stack runs with ``orchestrator.paced`` off (``ASKED``): the steps read here
are those the orchestrator asks for; paced steps (the default for a lone
request's sequential steps) are ``benchmarks.pipeline_timeline``'s.

Segment medians are steadier than tokens/s on a busy machine: a step is about
twenty segments, each measured hundreds of times.
Writes results.json, results.md and timeline.png to the output folder.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from specdec import tracing

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    Client,
    machine_info,
    service_settings,
    start_services,
)
from .plain_runs import side_by_side_header
from .run import pin_stack, spec_configs

# The steps this timeline reads are asked for by the orchestrator: a lone request's
# sequential steps are otherwise paced by the draft (``orchestrator.paced``), which
# ``benchmarks.pipeline_timeline`` reads. ``--set orchestrator.paced=true`` overrides.
ASKED = ["orchestrator.paced=false"]

# make bench's configurations by name (<mode><gamma>@<temperature>): plain and
# sequential. Adaptive is left out: each request here is seeded, which fixes gamma.
CONFIGS = {
    name: fields
    for t in (0.0, 1.0)
    for name, fields in spec_configs(t, [1, 2, 3, 4, 5, 6, 8], overlap=False).items()
    if not name.startswith("adaptive")
}


@dataclass(frozen=True)
class Mark:
    t: float  # seconds, the machine's monotonic clock
    role: str
    label: str

    @property
    def name(self) -> str:
        return f"{self.role}:{self.label}"


def read_marks(folder: Path) -> list[Mark]:
    """Every mark of every ``<role>-<pid>.trace`` file in ``folder``, in time order."""
    marks = []
    for path in folder.glob("*.trace"):
        role = path.name.split("-")[0]
        for line in path.read_text().splitlines():
            t, _, label = line.partition(" ")
            if label:
                marks.append(Mark(float(t), role, label))
    marks.sort(key=lambda m: m.t)
    return marks


def steps_of(marks: list[Mark]) -> list[list[Mark]]:
    """The marks of each step as the target sees it: from one ``target:verify`` to
    the next (both included), so that steps tile time whatever the route.

    Marks off the step's path are dropped. With a relay, the orchestrator learns
    of the proposal (``proposed``) while the target already works on it. With
    drafting on (the step has a ``draft:echo``), the draft drafts from the
    target's echoed verdict while the orchestrator settles and confirms: every
    orchestrator mark is off the path (a confirmation that comes late shows as
    the draft's wait for its ``propose``).
    """
    steps, current = [], None
    for m in marks:
        if m.name == "target:verify":
            if current is not None:
                current.append(m)
                steps.append(_on_path(current))
            current = [m]
        elif current is not None:
            current.append(m)
    return steps


def _on_path(step: list[Mark]) -> list[Mark]:
    names = {m.name for m in step}
    if "draft:echo" in names:
        return [m for m in step if m.role != "orchestrator"]
    if "draft:relayed" in names:
        return [m for m in step if m.name != "orchestrator:proposed"]
    return step


def kind_of(a: Mark, b: Mark) -> str:
    if a.role == b.role and a.label == "forward" and b.label == "forward_end":
        return "forward"
    return "hop" if a.role != b.role else "work"


def critical_path(steps: list[list[Mark]]) -> dict:
    """Median of every segment over the steps of the most common shape.

    Returns {"steps": n, "shape_steps": m, "step_ms": median step, "segments":
    [{"from", "to", "kind", "ms"}], "by_kind": {kind: ms}, "draft_forward_ms":
    [median by position]}; empty segments when there are no steps.
    """
    out: dict = {
        "steps": len(steps),
        "shape_steps": 0,
        "segments": [],
        "by_kind": {},
        "work_by_role": {},
    }
    if not steps:
        return out
    shape_of = [tuple(m.name for m in s) for s in steps]
    shape, count = collections.Counter(shape_of).most_common(1)[0]
    chosen = [s for s, sh in zip(steps, shape_of, strict=True) if sh == shape]
    out["shape_steps"] = count
    out["step_ms"] = statistics.median((s[-1].t - s[0].t) * 1e3 for s in steps)
    out["shape_step_ms"] = statistics.median((s[-1].t - s[0].t) * 1e3 for s in chosen)
    by_kind: dict[str, float] = collections.defaultdict(float)
    work_by_role: dict[str, float] = collections.defaultdict(float)
    for i in range(len(shape) - 1):
        a, b = chosen[0][i], chosen[0][i + 1]
        ms = statistics.median((s[i + 1].t - s[i].t) * 1e3 for s in chosen)
        kind = kind_of(a, b)
        out["segments"].append({"from": a.name, "to": b.name, "kind": kind, "ms": ms})
        by_kind[kind] += ms
        if kind == "work":
            work_by_role[a.role] += ms
    out["by_kind"] = dict(by_kind)
    out["work_by_role"] = dict(work_by_role)
    positions: dict[int, list[float]] = collections.defaultdict(list)
    for s in chosen:
        starts = [m.t for m in s if m.name == "draft:forward"]
        ends = [m.t for m in s if m.name == "draft:forward_end"]
        for i, (a, b) in enumerate(zip(starts, ends, strict=False)):
            positions[i].append((b - a) * 1e3)
    out["draft_forward_ms"] = [statistics.median(positions[i]) for i in sorted(positions)]
    return out


def fresh_trace_dir(out: Path) -> Path:
    """``out/trace``, made and emptied of an earlier run's marks."""
    trace_dir = out / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    for old in trace_dir.glob("*.trace"):
        old.unlink()
    return trace_dir


def run(args) -> dict:
    out = Path(args.out)
    trace_dir = fresh_trace_dir(out)
    info = machine_info("cpu")
    os.environ[tracing.ENV] = str(trace_dir)
    try:
        stack = start_services(
            out,
            args.draft,
            args.target,
            threads=1,
            draft_threads=1,
            # Steps the orchestrator asks for (``ASKED``): paced ones have no propose,
            # and their marks are ``benchmarks.pipeline_timeline``'s to read.
            settings=service_settings([*ASKED, *args.set]),
        )
    finally:
        del os.environ[tracing.ENV]
    windows: dict[str, list[tuple[float, float]]] = {c: [] for c in args.configs}
    try:
        if args.pin:
            pin_stack(stack)
        client = Client(stack.orchestrator_address)
        for c in args.configs:  # warm every kind of call
            client.generate(PROMPTS[0], 8, seed=1, **CONFIGS[c])
        for r in range(args.repeats):
            for c in args.configs if r % 2 == 0 else args.configs[::-1]:
                t0 = time.perf_counter()
                for j, prompt in enumerate(PROMPTS):
                    client.generate(prompt, args.max_new_tokens, seed=1000 * r + j, **CONFIGS[c])
                windows[c].append((t0, time.perf_counter()))
        client.close()
    finally:
        stack.stop()  # the services close their trace files as they stop
    info["load_average_end"] = list(os.getloadavg())
    marks = read_marks(trace_dir)
    result = {"machine": info, "args": vars(args), "configs": {}}
    for c, spans in windows.items():
        inside = [m for m in marks if any(a <= m.t <= b for a, b in spans)]
        result["configs"][c] = critical_path(steps_of(inside))
    return result


def report(result: dict) -> str:
    lines = side_by_side_header(
        "Step timeline: where a step's wall time goes",
        result["machine"],
        "One core per service (pinned)." if result["args"]["pin"] else "Shared cores.",
    )
    lines += [
        "Medians over the steps of each configuration's usual shape; they tile a "
        "typical step (hop: between two services; work: inside one, outside its forwards).",
        "",
    ]
    for c, r in result["configs"].items():
        if not r["segments"]:
            lines += [f"## {c}", "", "no complete steps", ""]
            continue
        k = r["by_kind"]
        lines += [
            f"## {c}",
            "",
            f"{r['shape_steps']} of {r['steps']} steps have this shape; step "
            f"{r['shape_step_ms']:.2f} ms (median), of which forwards "
            f"{k.get('forward', 0):.2f}, hops {k.get('hop', 0):.2f}, work "
            f"{k.get('work', 0):.2f} ("
            + ", ".join(f"{role} {ms:.2f}" for role, ms in r["work_by_role"].items())
            + "). Draft forward by position (ms): "
            + ", ".join(f"{x:.2f}" for x in r["draft_forward_ms"]),
            "",
            "| segment | kind | median ms |",
            "| --- | --- | --- |",
        ]
        lines += [
            f"| {s['from']} -> {s['to']} | {s['kind']} | {s['ms']:.3f} |" for s in r["segments"]
        ]
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"forward": "0.6", "hop": "tab:orange", "work": "tab:blue"}
    configs = [c for c, r in result["configs"].items() if r["segments"]]
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.6 * len(configs)))
    for y, c in enumerate(configs):
        left = 0.0
        for s in result["configs"][c]["segments"]:
            ax.barh(y, s["ms"], left=left, color=colors[s["kind"]], edgecolor="white", lw=0.5)
            left += s["ms"]
    for kind, color in colors.items():
        ax.barh(0, 0, color=color, label=kind)
    ax.set_yticks(range(len(configs)), configs)
    ax.set_xlabel("ms (segment medians, in step order)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("A typical step, segment by segment")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--configs", nargs="*", default=["seq4@0", "seq4@1"], choices=list(CONFIGS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--pin", action="store_true", help="one core per service")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config setting of the stack, e.g. orchestrator.draft_on=false (repeatable)",
    )
    ap.add_argument("--out", default=f"results/timeline-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    result = run(args)
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    text = report(result)
    (out / "results.md").write_text(text + "\n")
    plot(result, out / "timeline.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
