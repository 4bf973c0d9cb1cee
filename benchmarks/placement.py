"""Where the orchestrator (and the client) sit when the services stand for separate
machines: one stack, the draft pinned to core 0 and the target to core 1, and the
orchestrator with this client moved between rounds:

- ``draft``: on the draft's core (``make bench``'s pinned sections);
- ``target``: on the target's core;
- ``free``: on both cores, where the scheduler puts them.

    python -m benchmarks.placement [--rounds 6] [--configs seq4@0 ovl4@0 seq4@1 ovl4@1]
        [--prompts 8] [--max-new-tokens 64] [--out results/placement-<time>]

Each round runs every configuration under every placement (the placements'
order rotating from round to round); the report gives each one's median tok/s
and, per placement, its ratio to ``draft`` paired round by round. The same
processes serve every placement, so only where the front runs changes.
Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    Client,
    machine_info,
    start_services,
)
from .plain_runs import ratios, save_side_by_side, side_by_side_header
from .run import DRAFT_CORE, TARGET_CORE, _run_prompts, spec_configs, unpin_self

PLACEMENTS = {"draft": {DRAFT_CORE}, "target": {TARGET_CORE}, "free": {DRAFT_CORE, TARGET_CORE}}


def configs_named(names: list[str]) -> dict[str, dict]:
    every = {**spec_configs(0.0, list(range(1, 9))), **spec_configs(1.0, list(range(1, 9)))}
    return {name: every[name] for name in names}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--configs", nargs="*", default=["seq4@0", "ovl4@0", "seq4@1", "ovl4@1"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--prompts", type=int, default=8, help="how many of the prompts (as make bench)"
    )
    ap.add_argument("--out", default=f"results/placement-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    configs = configs_named(args.configs)
    prompts = PROMPTS[: args.prompts]
    stack = start_services(out, str(DEFAULT_DRAFT), str(DEFAULT_TARGET), threads=1)
    rates: dict[str, dict[str, list[float]]] = {p: {c: [] for c in configs} for p in PLACEMENTS}
    try:
        stack.pin("draft", {DRAFT_CORE})
        stack.pin("target", {TARGET_CORE})
        client = Client(stack.orchestrator_address)
        for fields in configs.values():  # warm every kind of call
            _run_prompts(client, PROMPTS[:1], 8, fields, 0)
        order = list(PLACEMENTS)
        for r in range(args.rounds):
            for place in order[r % len(order) :] + order[: r % len(order)]:
                stack.pin("orchestrator", PLACEMENTS[place])
                os.sched_setaffinity(0, PLACEMENTS[place])
                for name, fields in configs.items():
                    t = _run_prompts(client, prompts, args.max_new_tokens, fields, r + 1)
                    rates[place][name].append(t["tokens"] / t["wall_s"])
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        client.close()
    finally:
        unpin_self()
        stack.stop()
    info["load_average_end"] = list(os.getloadavg())
    lines = side_by_side_header(
        "Where the orchestrator sits, the services pinned",
        info,
        f"{args.rounds} rounds, each running every configuration under every placement "
        f"(order rotating); {len(prompts)} prompts x "
        f"{args.max_new_tokens} tokens; draft on core {DRAFT_CORE}, target on core "
        f"{TARGET_CORE}; the orchestrator and this client on the draft's core (`draft`, as "
        "`make bench`'s pinned sections), the target's (`target`) or both (`free`). "
        "tok/s medians; ratios to `draft` paired by round (median, range).",
    )
    lines += [
        "| config | draft | target | free | target / draft | free / draft |",
        "|---|---|---|---|---|---|",
    ]
    summary = {}
    for name in configs:
        med = {p: statistics.median(rates[p][name]) for p in PLACEMENTS}
        cells = []
        for p in ("target", "free"):
            each = ratios(rates[p][name], rates["draft"][name])
            cells.append(f"{statistics.median(each):.2f} ({min(each):.2f}-{max(each):.2f})")
            summary[f"{name} {p}/draft"] = statistics.median(each)
        lines.append(
            f"| {name} | {med['draft']:.1f} | {med['target']:.1f} | {med['free']:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    save_side_by_side(out, lines, info, rates, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
