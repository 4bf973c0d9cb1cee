"""Where a pipelined request's time goes, from the services' own marks
(``specdec.tracing``): is the target kept fed?

    python -m benchmarks.pipeline_timeline [--rtt-ms 10] [--temperature 0]
        [--gamma 4] [--paced] [--shared] [--rounds 3] [--prompts 4]
        [--max-new-tokens 64] [--out DIR]

One draft and one target pinned as in ``make bench`` (one torch thread each),
every hop through the delay proxy, the draft's relays included, and an
orchestrator that pipelines from any round trip (``orchestrator.pipeline``,
``pipeline_min_rtt_ms: 0``; ``--gamma 0``: adaptive requests); ``--paced``:
sequential steps the draft paces instead (``orchestrator.paced``, every block
fresh); ``--shared``: nothing pinned and no proxies, as the head-to-head
section's services run. Requests run one at a time. In a pipeline nobody asks
for a step, so the target's own timeline tells how well it is fed:

* its share of the wall time in forward passes;
* the idle gap before each pass, by the kind of block the pass ran
  (``target:chain-follower``, ``chain-guess``, ``chain-fresh``; ``other``: a
  request's prefill and its first step, which the orchestrator asks for);
* for a fresh block (the block after a rejection nothing relayed ahead
  covered), that gap cut into segments: the verdict's echo to the draft, the
  draft's settling, its drafting, and the send with the hop back to the target
  (one segment: the draft marks a relay sent when its write completes, which
  may be after the target has read it);
* the echo's delay after every verdict, split by whether the target went
  straight on to the next block's pass (the pass blocks its event loop).

Writes results.json and results.md to the output folder.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from specdec import tracing

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    Client,
    finish,
    machine_info,
    service_settings,
    start_services,
)
from .plain_runs import side_by_side_header
from .run import DRAFT_CORE, FRONT_NICE, _run_prompts, pin_stack, proxied_services
from .timeline import Mark, fresh_trace_dir, read_marks

# The fresh block's path, mark by mark (the segments are the gaps between them).
FRESH_PATH = (
    "target:reply",
    "draft:pipeline-echo",
    "draft:pipeline-settle",
    "draft:pipeline-drafted",
    "target:relay",
    "target:chain-fresh",
    "target:forward",
)
# A verdict the next pass follows this closely ran its next block at once.
AT_ONCE_S = 0.001


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def summary_ms(values: list[float]) -> dict:
    """Count, median and quartiles of ``values`` (seconds), in ms."""
    if not values:
        return {"n": 0}
    ms = [1000 * v for v in values]
    return {
        "n": len(ms),
        "median": statistics.median(ms),
        "p25": _pct(ms, 0.25),
        "p75": _pct(ms, 0.75),
        "total_s": sum(values),
    }


def target_passes(marks: list[Mark]) -> list[tuple[float, float, str]]:
    """Each target pass as (start, idle gap before it, kind of block it ran)."""
    passes, last_end, kind = [], None, "other"
    for m in marks:
        if m.role != "target":
            continue
        if m.label.startswith("chain-"):
            kind = m.label.removeprefix("chain-")
        elif m.label == "forward_end":
            last_end = m.t
        elif m.label == "forward":
            if last_end is not None:
                passes.append((m.t, m.t - last_end, kind))
            last_end, kind = None, "other"
    return passes


def busy_share(marks: list[Mark], wall_s: float) -> float:
    """The share of ``wall_s`` the target spent in forward passes."""
    busy, start = 0.0, None
    for m in marks:
        if m.role == "target" and m.label == "forward":
            start = m.t
        elif m.role == "target" and m.label == "forward_end" and start is not None:
            busy, start = busy + m.t - start, None
    return busy / wall_s if wall_s > 0 else 0.0


def fresh_segments(marks: list[Mark]) -> dict[str, list[float]]:
    """Each fresh block's idle gap, segment by segment (``FRESH_PATH``): walking back
    from its pass to the verdict it follows."""
    names = [m.name for m in marks]
    segments: dict[str, list[float]] = collections.defaultdict(list)
    for i, name in enumerate(names):
        if name != "target:chain-fresh":
            continue
        at = {}
        j = i
        for wanted in reversed(FRESH_PATH[:-2]):  # back from the block's arrival
            while j >= 0 and names[j] != wanted:
                j -= 1
            if j < 0:
                break
            at[wanted] = marks[j].t
        k = i
        while k < len(names) and names[k] != "target:forward":
            k += 1
        if len(at) < len(FRESH_PATH) - 2 or k == len(names):
            continue
        at["target:chain-fresh"], at["target:forward"] = marks[i].t, marks[k].t
        times = [at[n] for n in FRESH_PATH]
        if any(b < a for a, b in zip(times, times[1:], strict=False)):
            continue  # marks of different steps interleaved: not this block's path
        for a, b in zip(FRESH_PATH, FRESH_PATH[1:], strict=False):
            segments[f"{a} -> {b}"].append(at[b] - at[a])
    return segments


def echo_delays(marks: list[Mark]) -> dict[str, list[float]]:
    """Each verdict's time to the draft (``target:reply`` to the next
    ``draft:pipeline-echo``), by whether the target's next pass started at once."""
    out: dict[str, list[float]] = {"next pass at once": [], "target idle": []}
    for i, m in enumerate(marks):
        if m.name != "target:reply":
            continue
        echo = next_pass = None
        for n in marks[i + 1 :]:
            if echo is None and n.name == "draft:pipeline-echo":
                echo = n.t
            if next_pass is None and n.name == "target:forward":
                next_pass = n.t
            if n.name == "target:reply" or (echo is not None and next_pass is not None):
                break
        if echo is None:
            continue
        at_once = next_pass is not None and next_pass - m.t <= AT_ONCE_S
        out["next pass at once" if at_once else "target idle"].append(echo - m.t)
    return out


def analyse(marks: list[Mark], spans: list[tuple[float, float]]) -> dict:
    inside = [m for m in marks if any(a <= m.t <= b for a, b in spans)]
    wall = sum(b - a for a, b in spans)
    passes = target_passes(inside)
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for _, gap, kind in passes:
        by_kind[kind].append(gap)
    return {
        "wall_s": wall,
        "target_busy_share": busy_share(inside, wall),
        "passes": len(passes),
        "gaps": {k: summary_ms(v) for k, v in sorted(by_kind.items())},
        "fresh_segments": {k: summary_ms(v) for k, v in fresh_segments(inside).items()},
        "echo": {k: summary_ms(v) for k, v in echo_delays(inside).items()},
    }


@contextlib.contextmanager
def _shared_services(out: Path, settings: dict[str, dict]) -> Iterator[tuple]:
    """As ``proxied_services`` yields them, with no proxies and nothing pinned: every
    process on both cores, every hop direct (as the head-to-head section's services)."""
    stack = start_services(
        out, str(DEFAULT_DRAFT), str(DEFAULT_TARGET), threads=1, draft_threads=1, settings=settings
    )
    try:
        yield stack, None, stack.address("draft"), stack.address("target")
    finally:
        stack.stop()


def run(args) -> dict:
    out = Path(args.out)
    trace_dir = fresh_trace_dir(out)
    info = machine_info("cpu")
    overlap = not args.paced
    fields: dict = {"gamma": args.gamma, "overlap": overlap} if args.gamma else {"gamma": None}
    fields["temperature"] = args.temperature
    prompts = PROMPTS[: args.prompts]
    spans, tokens = [], 0.0
    os.environ[tracing.ENV] = str(trace_dir)
    try:
        services = _shared_services if args.shared else proxied_services
        with services(out, service_settings(args.set)) as (stack, proxies, pd, pt):
            sets = {"orchestrator.pipeline": "true", "orchestrator.pipeline_min_rtt_ms": "0"}
            if args.paced:  # sequential steps the draft paces: pipelines of depth 0
                sets = {"orchestrator.pipeline": "false", "orchestrator.paced": "true"}
            address, _ = stack.start_orchestrator("orchestrator-piped", pd, pt, sets)
            del os.environ[tracing.ENV]
            if proxies is not None:
                pin_stack(stack)
                stack.pin_extra(DRAFT_CORE, FRONT_NICE)
                proxies.set_rtt_ms(args.rtt_ms)
            client = Client(address)
            try:
                _run_prompts(client, prompts[:1], 16, fields, 0)  # warm up
                for r in range(args.rounds):
                    t0 = time.perf_counter()
                    t = _run_prompts(client, prompts, args.max_new_tokens, fields, r + 1)
                    spans.append((t0, time.perf_counter()))
                    tokens += t["tokens"]
                counts = {
                    f"lookahead {o}": stack.metric(
                        "target", "specdec_model_lookahead_tokens_total", f'outcome="{o}"'
                    )
                    for o in ("decoded", "used")
                }
            finally:
                client.close()
    finally:
        os.environ.pop(tracing.ENV, None)
    info["load_average_end"] = list(os.getloadavg())
    result = analyse(read_marks(trace_dir), spans)
    result["tok_s"] = tokens / result["wall_s"]
    return {"machine": info, "args": vars(args), **result, "counts": counts}


def report(result: dict) -> str:
    a = result["args"]
    mode = f"gamma {a['gamma']}" if a["gamma"] else "adaptive"
    lines = side_by_side_header(
        "Pipelined requests: where the target's time goes",
        result["machine"],
        (
            "every process on both cores, every hop direct"
            if a.get("shared")
            else f"+{a['rtt_ms']:g} ms round trip on every hop, pinned as in `make bench`"
        )
        + f", T={a['temperature']:g}, {mode}{', paced' if a.get('paced') else ''}, "
        f"{a['rounds']} rounds of {a['prompts']} prompts x {a['max_new_tokens']} tokens."
        + (f" Settings: `{' '.join(a['set'])}`." if a.get("set") else ""),
    )
    lines += [
        f"{result['tok_s']:.1f} tok/s; the target in forward passes "
        f"{result['target_busy_share']:.0%} of the wall time ({result['passes']} passes).",
        "",
        "Counters: "
        + ", ".join(f"{k} {v:g}" for k, v in result.get("counts", {}).items())
        + " (`target.lookahead_tokens`: passes of the target's own continuation, and "
        "the tokens of it verifies used).",
        "",
        "| idle gap before a pass that ran | passes | median ms | p25 | p75 | total s |",
        "|---|---|---|---|---|---|",
    ]

    def row(name: str, s: dict) -> str:
        if not s["n"]:
            return f"| {name} | 0 | | | | |"
        return (
            f"| {name} | {s['n']} | {s['median']:.1f} | {s['p25']:.1f} | {s['p75']:.1f} "
            f"| {s['total_s']:.2f} |"
        )

    lines += [row(k, s) for k, s in result["gaps"].items()]
    lines += ["", "| a fresh block's path | n | median ms | p25 | p75 | total s |"]
    lines += ["|---|---|---|---|---|---|"]
    lines += [row(k, s) for k, s in result["fresh_segments"].items()]
    lines += ["", "| a verdict's echo to the draft | n | median ms | p25 | p75 | total s |"]
    lines += ["|---|---|---|---|---|---|"]
    lines += [row(k, s) for k, s in result["echo"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt-ms", type=float, default=10.0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--gamma", type=int, default=4, help="0: adaptive requests")
    ap.add_argument(
        "--paced",
        action="store_true",
        help="sequential steps the draft paces (orchestrator.paced) instead of pipelines "
        "that draft ahead",
    )
    ap.add_argument(
        "--shared",
        action="store_true",
        help="every process on both cores, every hop direct (no proxies: --rtt-ms is ignored)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="per round, one after the other")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--set", nargs="*", default=[], help="section.key=value for the services (target...)"
    )
    ap.add_argument("--out", default=f"results/pipeline-timeline-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    return finish(Path(args.out), run(args), report)


if __name__ == "__main__":
    raise SystemExit(main())
