"""Guesses side by side: the draft drafting the next block for rejections while
the target verifies (``draft.guesses`` for greedy steps that draft ahead,
``draft.sampled_guesses`` for sampled ones) against the same services without
them (both 0).

    python -m benchmarks.guesses [--repeats 5] [--parts pinned shared]
        [--clients 4] [--off-first] [--modes ...] [--prompts 8] [--max-new-tokens 64]
        [--out results/guesses-<time>]

Two stacks of the demo pair, one thread per service, that differ only in
those two settings; only one serves at a time. ``pinned``: each stack as
``make bench`` pins it (draft, orchestrator and this client on one core, the
target on the other: separate machines); ``shared``: both cores shared. One
client, 8 prompts x 64 tokens; gamma 4 sequential and drafting ahead, and
adaptive; greedy and T=1 (a sampled step's guesses are draws coupled to the
target's residual draw; sequential steps draft nothing ahead, so they are the
control). ``--clients``: also that many clients at once (3 requests each,
greedy, gamma 4 drafting ahead, shared cores), where guesses run only in the
draft's idle time. Each configuration once to warm up, then interleaved
rounds, the order rotating; medians and the median of the paired per-round
ratios. Also each arm's drafting ahead / sequential (issue 10's overlap
criterion). Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from .common import DEFAULT_DRAFT, DEFAULT_TARGET, PROMPTS, machine_info, stacks_per_arm
from .plain_runs import (
    MAX_NEW,
    interleaved,
    one_client,
    paired,
    ratios,
    save_side_by_side,
    side_by_side_header,
)
from .run import clients_round, pin_stack, unpin_stack

MODES = {
    "gamma 4@0": {"gamma": 4, "overlap": False, "temperature": 0.0},
    "gamma 4 ahead@0": {"gamma": 4, "overlap": True, "temperature": 0.0},
    "adaptive@0": {"gamma": None, "temperature": 0.0},
    "gamma 4@1": {"gamma": 4, "overlap": False, "temperature": 1.0},
    "gamma 4 ahead@1": {"gamma": 4, "overlap": True, "temperature": 1.0},
    "adaptive@1": {"gamma": None, "temperature": 1.0},
}
ARMS = {  # draft.guesses, draft.sampled_guesses
    "on": {"guesses": 4, "sampled_guesses": 4},
    "off": {"guesses": 0, "sampled_guesses": 0},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8, help="per round, in turn")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW, help="per request")
    ap.add_argument("--parts", nargs="*", default=["pinned", "shared"])
    ap.add_argument(
        "--clients",
        type=int,
        nargs="*",
        default=[4],
        help="also this many clients at once, greedy gamma 4 drafting ahead, shared cores",
    )
    ap.add_argument(
        "--off-first", action="store_true", help="start the stack without guesses first"
    )
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--out", default=f"results/guesses-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    rates: dict[str, list[float]] = {}
    arms = dict(reversed(ARMS.items())) if args.off_first else ARMS
    info["stacks_started"] = list(arms)
    with stacks_per_arm(out, str(DEFAULT_DRAFT), str(DEFAULT_TARGET), "guesses", arms) as stacks:
        for part in args.parts:
            for stack in stacks.values():
                if part == "pinned":
                    pin_stack(stack)
                else:
                    unpin_stack(stack)
            configs = {
                f"{arm} {mode} {part}": (
                    lambda r, a=stack.orchestrator_address, f=fields: one_client(
                        a, f, r, args.prompts, args.max_new_tokens
                    )
                )
                for arm, stack in stacks.items()
                for mode, fields in MODES.items()
                if mode in args.modes
            }
            rates |= interleaved(configs, args.repeats)
            print(f"{part} done", flush=True)
        for stack in stacks.values():
            unpin_stack(stack)
        ahead = MODES["gamma 4 ahead@0"]
        for n in args.clients:
            configs = {
                f"{arm} x{n}": (
                    lambda r, a=stack.orchestrator_address, n=n: clients_round(
                        a, n, ahead, PROMPTS[: args.prompts], 3, args.max_new_tokens, r
                    )[0]
                )
                for arm, stack in stacks.items()
            }
            rates |= interleaved(configs, args.repeats)
            print(f"{n} clients done", flush=True)
        info["guesses"] = {
            arm: {
                o: stack.metric("draft", "specdec_model_draft_guesses_total", f'outcome="{o}"')
                for o in ("used", "unused")
            }
            for arm, stack in stacks.items()
        }
    info["load_average_end"] = list(os.getloadavg())
    med = {k: statistics.median(v) for k, v in rates.items()}
    lines = side_by_side_header(
        "Guesses: the next block drafted for rejections during the verify, side by side",
        info,
        f"{args.repeats} interleaved rounds after a warm-up run; medians, and the median of "
        "the paired per-round ratios. on = `draft.guesses: 4` (the default) and "
        f"`draft.sampled_guesses: 4`, off = both 0; one client, {args.prompts} prompts x "
        f"{args.max_new_tokens} tokens, one thread per service.",
    ) + [
        "| | on tok/s | off tok/s | on / off (paired) | ahead / sequential, on | off "
        "| the two, on / off (paired) |",
        "|---|---|---|---|---|---|---|",
    ]
    for part in args.parts:
        for mode in args.modes:
            on, off = rates[f"on {mode} {part}"], rates[f"off {mode} {part}"]
            ratio = [f"{paired(on, off):.3f}"]
            t = mode.split("@")[1]
            if "ahead" in mode and f"gamma 4@{t}" in args.modes:
                seq = f"gamma 4@{t} {part}"
                # each stack's own drafting ahead / sequential, by round
                gain = {
                    arm: ratios(rates[f"{arm} {mode} {part}"], rates[f"{arm} {seq}"])
                    for arm in ARMS
                }
                ratio += [f"{statistics.median(gain[arm]):.3f}" for arm in ARMS]
                # The stacks' own difference cancels out: the least noisy comparison.
                ratio.append(f"{paired(gain['on'], gain['off']):.3f}")
            else:
                ratio += ["-", "-", "-"]
            lines.append(
                f"| {mode.replace('@0', ', greedy').replace('@1', ', T=1')}, {part} | "
                f"{statistics.median(on):.1f} | {statistics.median(off):.1f} | "
                + " | ".join(ratio)
                + " |"
            )
    for n in args.clients:
        on, off = rates[f"on x{n}"], rates[f"off x{n}"]
        lines.append(
            f"| gamma 4 ahead, greedy, {n} clients, shared | {statistics.median(on):.1f} | "
            f"{statistics.median(off):.1f} | {paired(on, off):.3f} | - | - | - |"
        )
    save_side_by_side(out, lines, info, rates, med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
