"""What a forward pass costs after an idle gap: the first pass after a pause of
0-16 ms, sleeping or busy-waiting, against the same pass right after another.

    python -m benchmarks.idle_gap [--gaps-ms 0 1 2 4 8 16] [--passes 60]
        [--out results/idle-gap-<time>]

Each model of the pair in-process through the services' runner (``RaggedRunner``,
one thread, pinned to core 0 where the machine has one): a session with 64
cached tokens; then, for each gap and way of waiting in turn (rotating), wait,
time one pass (the draft: 1 token; the target: 5 tokens, a gamma-4 verify), run
a second pass at once and time it too, and roll both back. The second pass is
the warm reference of the same round. In a sequential step each service waits
through the other's work (the draft about one verify, 7-10 ms here; the target
about one drafting, 3-5 ms), so its first pass pays what this measures.
Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from specdec.runtime.loading import load_model
from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

from .common import DEFAULT_DRAFT, DEFAULT_TARGET, finish, machine_info, rotated_rounds
from .plain_runs import side_by_side_header

WAYS = ("sleep", "spin")
TOKENS = {"draft": 1, "target": 5}
CONTEXT = 64


def _wait(way: str, seconds: float) -> None:
    if way == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@torch.inference_mode()
def measure(path: str, tokens: int, gaps_ms: list[float], passes: int) -> dict:
    """{way: {gap: {"first": ms, "second": ms}}} medians over ``passes`` rounds."""
    runner = RaggedRunner(load_model(path))
    kv = SessionKV()
    runner.forward([Feed(kv, [(31 * i + 7) % runner.vocab_size for i in range(CONTEXT)], 1)])
    cells = [(way, g) for way in WAYS for g in gaps_ms]
    times: dict = {c: ([], []) for c in cells}
    for _, (way, g) in rotated_rounds(cells, passes):
        _wait(way, g / 1e3)
        for k in range(2):
            t0 = time.perf_counter()
            runner.forward([Feed(kv, [5 + k] * tokens, 1)])
            times[(way, g)][k].append(1e3 * (time.perf_counter() - t0))
        kv.truncate(CONTEXT)
    return {
        way: {
            f"{g:g}": {
                "first": statistics.median(times[(way, g)][0]),
                "second": statistics.median(times[(way, g)][1]),
            }
            for g in gaps_ms
        }
        for way in WAYS
    }


def report(result: dict) -> str:
    info = result["machine"] | {"load_average_end": result["load_average_end"]}
    lines = side_by_side_header(
        "The first pass after an idle gap",
        info,
        f"One thread, {result['passes']} rounds, medians (ms); second = the pass right "
        "after the first.",
    )
    for role, ways in result["models"].items():
        gaps = list(next(iter(ways.values())))
        lines += [
            f"## {role} ({TOKENS[role]} token{'s' if TOKENS[role] > 1 else ''} a pass)",
            "",
            "| gap (ms) | "
            + " | ".join(f"{w}: first | {w}: second | {w}: ratio" for w in ways)
            + " |",
            "|---" * (1 + 3 * len(ways)) + "|",
        ]
        for g in gaps:
            cells = []
            for cell in (ways[w][g] for w in ways):
                ratio = cell["first"] / cell["second"]
                cells.append(f"{cell['first']:.3f} | {cell['second']:.3f} | {ratio:.2f}")
            lines.append(f"| {g} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--gaps-ms", type=float, nargs="*", default=[0, 1, 2, 4, 8, 16])
    ap.add_argument("--passes", type=int, default=60)
    ap.add_argument("--out", default=f"results/idle-gap-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    result: dict = {"machine": machine_info("cpu"), "passes": args.passes, "models": {}}
    for role, path in (("draft", args.draft), ("target", args.target)):
        result["models"][role] = measure(path, TOKENS[role], args.gaps_ms, args.passes)
    return finish(out, result, report)


if __name__ == "__main__":
    raise SystemExit(main())
