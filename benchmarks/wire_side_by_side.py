"""How many entries each q lists on the wire (``wire_top_k``), side by side at T=1.

One draft and one target service, pinned (the target on one core; the draft,
the orchestrators and this client on the other; ``--shared``: every process
on both cores), and one orchestrator per
``wire_top_k`` in front of them. Rounds interleave every configuration (the
order rotating); each round runs the prompts one after the other (64 new
tokens, T=1) at a fixed gamma and adaptive. Reported per configuration: median
tok/s, the median of the per-round ratios to the first ``--top-k`` (paired: a
slow spell of the machine moves both sides of a round alike), the acceptance
rate of judged drafts and the wire bytes per generated token.

    python -m benchmarks.wire_side_by_side [--top-k 256 1024 2048] [--repeats 5] [--shared]
        [--hidden] [--out DIR]

``--hidden`` adds the hidden-state wire (``specdec.hidden_q``): the services hold
the draft's quantized output layer, and one more orchestrator sends q as hidden
states ("hidden"); the others send lists.

Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from .common import DEFAULT_DRAFT, DEFAULT_TARGET, PROMPTS, Client, machine_info, start_services
from .plain_runs import MAX_NEW, interleaved, save_side_by_side, side_by_side_header
from .run import DRAFT_CORE, FRONT_NICE, _run_prompts, pin_stack

GAMMA = 5


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top-k", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shared", action="store_true", help="no pinning: all processes share")
    ap.add_argument("--hidden", action="store_true", help="also the hidden-state wire")
    ap.add_argument("--out", default=f"results/wire-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    totals: dict[str, dict[str, float]] = {}

    def one(address: str, name: str, fields: dict, r: int) -> float:
        c = Client(address)
        t = _run_prompts(c, PROMPTS[:8], MAX_NEW, fields, r)
        c.close()
        if r != 99:  # not the warm-up
            acc = totals.setdefault(name, {})
            for k in ("accepted", "judged", "wire_bytes", "tokens"):
                acc[k] = acc.get(k, 0.0) + t[k]
        return t["tokens"] / t["wall_s"]

    settings = None
    if args.hidden:
        settings = {"draft": {"hidden_q": True}, "target": {"draft_head": str(DEFAULT_DRAFT)}}
    stack = start_services(
        out, str(DEFAULT_DRAFT), str(DEFAULT_TARGET), threads=1, settings=settings
    )
    try:
        if not args.shared:
            pin_stack(stack)
        configs = {}
        wires = [(f"top-{k}", {"orchestrator.wire_top_k": k}) for k in args.top_k]
        if args.hidden:
            wires.append(("hidden", {"orchestrator.wire_hidden": True}))
        for wire, sets in wires:
            address, _ = stack.start_orchestrator(
                f"orchestrator-{wire}",
                stack.address("draft"),
                stack.address("target"),
                {"orchestrator.wire_hidden": False, **sets},
            )
            for label, gamma in ((f"gamma {GAMMA}", GAMMA), ("adaptive", None)):
                name = f"{wire}, {label}"
                fields = {"temperature": 1.0, "gamma": gamma, "overlap": False}
                configs[name] = lambda r, a=address, n=name, f=fields: one(a, n, f, r)
        if not args.shared:
            stack.pin_extra(DRAFT_CORE, FRONT_NICE)
        rates = interleaved(configs, args.repeats)
    finally:
        stack.stop()
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    info["load_average_end"] = list(os.getloadavg())
    med = {k: statistics.median(v) for k, v in rates.items()}
    base = args.top_k[0]
    lines = side_by_side_header(
        "wire_top_k side by side (T=1)",
        info,
        f"{args.repeats} interleaved rounds; 8 prompts x {MAX_NEW} new tokens; "
        f"{'shared cores' if args.shared else 'pinned'}; medians.",
    ) + [
        f"| | tok/s | paired ratio to top-{base} | alpha judged | wire bytes / token |",
        "|---|---|---|---|---|",
    ]
    for name in configs:
        ref = name.replace(name.split(",")[0], f"top-{base}")
        ratio = statistics.median(a / b for a, b in zip(rates[name], rates[ref], strict=True))
        t = totals[name]
        lines.append(
            f"| {name} | {med[name]:.1f} | {ratio:.3f} | {t['accepted'] / t['judged']:.3f} | "
            f"{t['wire_bytes'] / t['tokens']:.0f} |"
        )
    save_side_by_side(out, lines, info, rates, med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
