"""A second target thread for passes of plain decoding steps alone
(``target.plain_torch_threads``) against one thread for every pass, side by side.

    python -m benchmarks.plain_threads [--repeats 5] [--clients 1 2 4 8 16]
        [--out results/plain-threads-<time>]

Two stacks of the demo pair that differ only in the target's
``plain_torch_threads`` (0 and 2; one torch thread per service otherwise, and
``adaptive_speculate_max_requests`` 2, as configs/default.yaml and ``make
bench``'s shared stack set them), and the target in this process with 2
threads (transformers' ``generate()``, what a user with the same 2 cores runs
instead).

- one client, ``--repeats`` rounds: in each round ``generate()`` and then,
  through both stacks (their order alternating round by round), plain decoding
  (gamma 0), sequential gamma 4 and adaptive, greedy and at T=1; 8 prompts x 64
  tokens each. Paired ratios: plain / ``generate()`` per stack, and each mode's
  two threads / one;
- sustained rounds of ``--clients`` clients at T=1 (``benchmarks.sustained``'s
  rounds), plain and adaptive, the stacks' order alternating.

Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import analyze as analyze_mod
from .common import DEFAULT_DRAFT, DEFAULT_TARGET, PROMPTS, Client, machine_info, start_services
from .head_to_head import Choices, Transformers, services_rate
from .plain_runs import paired_cells, save_side_by_side, side_by_side_header
from .run import CONCURRENCY_MODES, sustained_side_by_side

ARMS = {"one thread": 0, "plain passes 2": 2}  # arm -> the target's plain_torch_threads
MODES = {
    "plain": {"gamma": 0},
    "seq4": {"gamma": 4, "overlap": False},
    "adaptive": {"gamma": None, "seed": None},
}
TEMPERATURES = (0.0, 1.0)
SUSTAINED = ("plain", "adaptive")  # CONCURRENCY_MODES, at T=1
MAX_NEW = 64


def one_client(stacks: dict, hf: Transformers, c: Choices, repeats: int) -> dict[str, list[float]]:
    """{"generate()@t" or "<arm>:<mode>@t": tok/s per round} (arms: ``stacks``' keys,
    their order alternating round by round), every configuration once to warm up first."""
    arms = list(stacks)
    clients = {arm: Client(stack.orchestrator_address) for arm, stack in stacks.items()}
    rates: dict[str, list[float]] = {}
    try:
        for r in range(repeats + 1):  # round 0: the warm-up, not kept
            for t in TEMPERATURES:
                got = {f"generate()@{t:g}": hf.rate(None, t, r, 2, None)}
                for mode, fields in MODES.items():
                    for arm in arms if r % 2 else arms[::-1]:
                        got[f"{arm}:{mode}@{t:g}"] = services_rate(
                            clients[arm], {"temperature": t, **fields}, r, c
                        )
                if r:
                    for key, rate in got.items():
                        rates.setdefault(key, []).append(rate)
            if r:
                print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()))
    finally:
        for client in clients.values():
            client.close()
    return rates


def report(info: dict, args, one: dict[str, list[float]], sustained: dict) -> list[str]:
    one_arm, two_arm = ARMS
    lines = side_by_side_header(
        "A second target thread for plain passes",
        info,
        f"Target plain_torch_threads 0 ({one_arm!r}) against 2 ({two_arm!r}), one torch "
        f"thread per service otherwise; generate() in this process on 2 threads. One "
        f"client: {args.repeats} rounds of 8 prompts x {args.max_new_tokens} tokens per "
        f"configuration, the stacks' order alternating; sustained rounds ({args.warm:g} s "
        f"not counted, {args.window:g} s counted), T=1, {args.repeats} per configuration.",
    )
    lines += ["## One client (tok/s, median; paired ratios: median and rounds)", ""]
    lines += [
        "| mode | T | one thread | plain passes 2 | 2 / 1 | rounds |",
        "|---" * 6 + "|",
    ]
    for t in TEMPERATURES:
        for mode in MODES:
            a, b = one[f"{one_arm}:{mode}@{t:g}"], one[f"{two_arm}:{mode}@{t:g}"]
            lines.append(
                f"| {mode} | {t:g} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | "
                f"{paired_cells(b, a)} |"
            )
    lines += ["", "Plain decoding through the target service / `generate()` (2 threads):", ""]
    lines += ["| T | generate() tok/s | arm | plain / generate() | rounds |", "|---" * 5 + "|"]
    for t in TEMPERATURES:
        hf = one[f"generate()@{t:g}"]
        for arm in ARMS:
            lines.append(
                f"| {t:g} | {statistics.median(hf):.1f} | {arm} | "
                f"{paired_cells(one[f'{arm}:plain@{t:g}'], hf)} |"
            )
    lines += ["", "## Sustained clients, T=1 (tok/s, median; paired ratios)", ""]
    lines += ["| clients | mode | one thread | plain passes 2 | 2 / 1 | rounds |", "|---" * 6 + "|"]
    for n in args.clients:
        for mode in SUSTAINED:
            a = sustained[f"{n} clients, {mode}, {one_arm}"]
            b = sustained[f"{n} clients, {mode}, {two_arm}"]
            lines.append(
                f"| {n} | {mode} | {statistics.median(a):.0f} | {statistics.median(b):.0f} | "
                f"{paired_cells(b, a)} |"
            )
    return lines


def _nothing(arm: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def arm_options(ap: argparse.ArgumentParser, repeats: int, clients: list[int], name: str) -> None:
    """The options of a side-by-side run of stacks (``run_arms``); ``name``: of its
    default output folder."""
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--clients", type=int, nargs="*", default=clients)
    ap.add_argument("--warm", type=float, default=1.5, help="seconds not counted per round")
    ap.add_argument("--window", type=float, default=5.0, help="seconds counted per round")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW, help="per request")
    ap.add_argument("--out", default=f"results/{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def run_arms(
    args, arms: dict[str, dict], out: Path, around: Callable[[str], Any] = _nothing
) -> tuple[dict, dict, dict]:
    """One stack of the pair per arm (arm -> ``start_services``' keyword arguments; one
    torch thread per service and ``adaptive_speculate_max_requests`` 2, as
    configs/default.yaml; each started inside the context ``around(arm)``),
    ``one_client``'s rounds with ``generate()`` and then sustained rounds of
    ``args.clients`` clients (none: skipped); every stack stopped at the end.
    Returns (machine info, one client's rates, sustained rates)."""
    info = machine_info("cpu")
    pair = analyze_mod.load_pair(args.draft, args.target)
    hf = Transformers(pair, PROMPTS[:8], args.max_new_tokens)
    c = Choices(PROMPTS[:8], args.max_new_tokens)
    stacks = {}
    try:
        for arm, kwargs in arms.items():
            with around(arm):
                stacks[arm] = start_services(
                    out / arm.replace(" ", "-").replace(",", ""), args.draft, args.target,
                    threads=1, draft_threads=1,
                    settings={"orchestrator": {"adaptive_speculate_max_requests": 2}},
                    **kwargs,
                )  # fmt: skip
        one = one_client(stacks, hf, c, args.repeats)
        sustained = sustained_side_by_side(
            {arm: stack.orchestrator_address for arm, stack in stacks.items()}, args.clients,
            {m: CONCURRENCY_MODES[m] for m in SUSTAINED}, PROMPTS, args.max_new_tokens,
            args.repeats, args.warm, args.window,
        ) if args.clients else {}  # fmt: skip
    finally:
        for stack in stacks.values():
            stack.stop()
    info["load_average_end"] = list(os.getloadavg())
    return info, one, sustained


def save_arms(out: Path, lines: list[str], info: dict, one: dict, sustained: dict, **more) -> None:
    """``run_arms``' report and rates (and ``more`` of them) to ``out``."""
    rates = {"one_client": one, **sustained}
    med = {k: statistics.median(v) for k, v in rates.items() if isinstance(v, list)}
    save_side_by_side(out, lines, info, {**rates, **more}, med)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arm_options(ap, 5, [1, 2, 4, 8, 16], "plain-threads")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = {arm: {"plain_threads": plain} for arm, plain in ARMS.items()}
    info, one, sustained = run_arms(args, arms, out)
    save_arms(out, report(info, args, one, sustained), info, one, sustained)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
