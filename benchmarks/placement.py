"""Where the orchestrator (and the client) sit when the services stand for separate
machines: one stack, the draft pinned to core 0 and the target to core 1, and the
orchestrator with this client (the front) moved between rounds:

- ``draft``: on the draft's core at niceness ``FRONT_NICE`` (``make bench``'s pinned
  sections): the front takes the core's idle time, the draft runs first;
- ``draft-nice0``: on the draft's core at the draft's own priority (``make bench``
  before 2026-12-03, evening);
- ``target``, ``target-nice0``: the same on the target's core;
- ``free``: on both cores, where the scheduler puts them (niceness 0).

    python -m benchmarks.placement [--rounds 6] [--configs seq4@0 ovl4@0 seq4@1 ovl4@1]
        [--placements draft draft-nice0 target target-nice0] [--prompts 8]
        [--max-new-tokens 64] [--out results/placement-<time>]

Each round runs every configuration under every placement (the placements'
order rotating from round to round); the report gives each one's median tok/s
and its ratio to the first placement, paired round by round. The same
processes serve every placement, so only where the front runs, and at which
priority, changes. Moving the front back to niceness 0 needs CAP_SYS_NICE (root).
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
from .run import (
    DRAFT_CORE,
    FRONT_NICE,
    TARGET_CORE,
    _run_prompts,
    place_front,
    spec_configs,
    unpin_stack,
)

PLACEMENTS = {  # name: (the front's cores, its niceness)
    "draft": ({DRAFT_CORE}, FRONT_NICE),
    "draft-nice0": ({DRAFT_CORE}, 0),
    "target": ({TARGET_CORE}, FRONT_NICE),
    "target-nice0": ({TARGET_CORE}, 0),
    "free": ({DRAFT_CORE, TARGET_CORE}, 0),
}


def configs_named(names: list[str]) -> dict[str, dict]:
    every = {**spec_configs(0.0, list(range(1, 9))), **spec_configs(1.0, list(range(1, 9)))}
    return {name: every[name] for name in names}


def placements_table(
    configs: list[str], order: list[str], rates: dict[str, dict[str, list[float]]]
) -> tuple[list[str], dict[str, float]]:
    """A markdown table of each configuration's median tok/s under each placement
    (``rates[placement][config]``: a rate a round) and its ratio to the first
    placement, paired by round (median and range); and those medians by
    "config placement/first"."""
    first, rest = order[0], order[1:]
    lines = [
        "| config | " + " | ".join(order) + " | " + " | ".join(f"{p} / {first}" for p in rest)
        + " |",
        "|---" * (1 + len(order) + len(rest)) + "|",
    ]  # fmt: skip
    summary = {}
    for name in configs:
        med = {p: statistics.median(rates[p][name]) for p in order}
        cells = []
        for p in rest:
            each = ratios(rates[p][name], rates[first][name])
            cells.append(f"{statistics.median(each):.3f} ({min(each):.2f}-{max(each):.2f})")
            summary[f"{name} {p}/{first}"] = statistics.median(each)
        lines.append(f"| {name} | " + " | ".join(f"{med[p]:.1f}" for p in order) + " | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return lines, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--configs", nargs="*", default=["seq4@0", "ovl4@0", "seq4@1", "ovl4@1"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--prompts", type=int, default=8, help="how many of the prompts (as make bench)"
    )
    ap.add_argument(
        "--placements",
        nargs="*",
        choices=list(PLACEMENTS),
        default=["draft", "draft-nice0", "target", "target-nice0"],
        help="ratios are to the first",
    )
    ap.add_argument("--out", default=f"results/placement-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    configs = configs_named(args.configs)
    prompts = PROMPTS[: args.prompts]
    order = list(dict.fromkeys(args.placements))
    nices = [PLACEMENTS[p][1] for p in order]
    falls = any(b < a for a, b in zip(nices, nices[1:], strict=False)) or (
        args.rounds > 1 and len(set(nices)) > 1  # the order rotates between rounds
    )
    if falls and os.geteuid() != 0:
        ap.error(
            "these placements lower the front's niceness between runs, which needs root "
            "(CAP_SYS_NICE): run as root, or choose placements of one niceness"
        )
    stack = start_services(out, str(DEFAULT_DRAFT), str(DEFAULT_TARGET), threads=1)
    rates: dict[str, dict[str, list[float]]] = {p: {c: [] for c in configs} for p in order}
    try:
        stack.pin("draft", {DRAFT_CORE})
        stack.pin("target", {TARGET_CORE})
        client = Client(stack.orchestrator_address)
        for fields in configs.values():  # warm every kind of call
            _run_prompts(client, PROMPTS[:1], 8, fields, 0)
        for r in range(args.rounds):
            for place in order[r % len(order) :] + order[: r % len(order)]:
                place_front(stack, *PLACEMENTS[place])
                for name, fields in configs.items():
                    t = _run_prompts(client, prompts, args.max_new_tokens, fields, r + 1)
                    rates[place][name].append(t["tokens"] / t["wall_s"])
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        client.close()
    finally:
        unpin_stack(stack)
        stack.stop()
    info["load_average_end"] = list(os.getloadavg())
    first = order[0]
    cores_named = {
        frozenset({DRAFT_CORE}): "the draft's core",
        frozenset({TARGET_CORE}): "the target's",
    }
    where = {
        name: f"{cores_named.get(frozenset(cores), 'both cores')} at niceness {nice}"
        for name, (cores, nice) in PLACEMENTS.items()
        if name in order
    }
    lines = side_by_side_header(
        "Where the orchestrator sits, the services pinned",
        info,
        f"{args.rounds} rounds, each running every configuration under every placement "
        f"(order rotating); {len(prompts)} prompts x "
        f"{args.max_new_tokens} tokens; draft on core {DRAFT_CORE}, target on core "
        f"{TARGET_CORE}; the orchestrator and this client on "
        + "; ".join(f"`{n}`: {w}" for n, w in where.items())
        + f". tok/s medians; ratios to `{first}` paired by round (median, range).",
    )
    table, summary = placements_table(list(configs), order, rates)
    lines += table
    save_side_by_side(out, lines, info, rates, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
