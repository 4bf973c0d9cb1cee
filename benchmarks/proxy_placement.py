"""Where the delay proxies run, and what that does to the round-trip emulation:
the services pinned and proxied as in ``make bench``'s RTT section (draft,
orchestrator and this client on the draft's core, the target on the other; every
hop through a delay proxy), and the proxies' threads moved between runs:

- ``front``: on the draft's core at the front's niceness (``FRONT_NICE``): where
  the RTT section's proxies ran before 2026-12-06, afternoon (made after the pin,
  their threads inherited it), so a held chunk waited for the draft's work;
- ``front-nice0``: on the draft's core at niceness 0;
- ``free``: on every core at niceness 0, where ``FaultProxy`` now puts itself
  (and where the other benchmarks' proxies, made before any pin, always ran).

    python -m benchmarks.proxy_placement [--rtt-ms 10] [--rounds 6]
        [--configs plain@0 adaptive@0 plain@1 adaptive@1]
        [--placements front front-nice0 free] [--prompts 4] [--max-new-tokens 48]
        [--out results/proxy-placement-<time>]

Each round runs every configuration under every placement (order rotating). The
report gives each one's median tok/s and its ratio to the first placement,
paired round by round; how late the proxies forwarded held chunks (the
emulation's own error, on top of half the RTT per hop: median and 90th
percentile); and the proxies' CPU per generated token. Lowering the proxies'
niceness between runs needs CAP_SYS_NICE (root). Writes results.json and
results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from .common import PROMPTS, Client, machine_info
from .cpu_share import cpu_seconds
from .placement import configs_named, placements_table
from .plain_runs import ratios, save_side_by_side, side_by_side_header
from .run import (
    DRAFT_CORE,
    FRONT_NICE,
    RTT_SETS,
    _run_prompts,
    pin_stack,
    proxied_services,
)

EVERY = frozenset(range(os.cpu_count() or 1))
PLACEMENTS = {  # name: (the proxies' cores, their niceness)
    "front": (frozenset({DRAFT_CORE}), FRONT_NICE),
    "front-nice0": (frozenset({DRAFT_CORE}), 0),
    "free": (EVERY, 0),
}


def place(proxies, where: str) -> None:
    """Every proxy thread of ``proxies`` (a ProxyGroup) on ``where``'s cores and niceness."""
    cores, nice = PLACEMENTS[where]
    for proxy in proxies.proxies:
        tid = proxy._thread.native_id
        os.sched_setaffinity(tid, cores)
        os.setpriority(os.PRIO_PROCESS, tid, nice)


def cpu_s(proxies) -> float:
    """CPU seconds the proxies' threads have used."""
    return sum(cpu_seconds(os.getpid(), p._thread.native_id) for p in proxies.proxies)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt-ms", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--configs", nargs="*", default=["plain@0", "adaptive@0", "plain@1", "adaptive@1"]
    )
    ap.add_argument("--placements", nargs="*", choices=list(PLACEMENTS), default=list(PLACEMENTS))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default=f"results/proxy-placement-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    order = list(dict.fromkeys(args.placements))
    if len({PLACEMENTS[p][1] for p in order}) > 1 and os.geteuid() != 0:
        ap.error("placements of two nicenesses lower it between runs: that needs root")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    configs = configs_named(args.configs)
    prompts = PROMPTS[: args.prompts]
    rates: dict[str, dict[str, list[float]]] = {p: {c: [] for c in configs} for p in order}
    late: dict[str, list[dict]] = {p: [] for p in order}
    cpu: dict[str, dict[str, list[float]]] = {p: {c: [] for c in configs} for p in order}
    with proxied_services(out) as (stack, proxies, pd, pt):
        address, _ = stack.start_orchestrator("orchestrator-proxied", pd, pt, dict(RTT_SETS))
        pin_stack(stack)
        stack.pin_extra(DRAFT_CORE, FRONT_NICE)
        proxies.set_rtt_ms(args.rtt_ms)
        client = Client(address)
        for fields in configs.values():  # warm every kind of call
            _run_prompts(client, prompts[:1], 8, fields, 0)
        for r in range(args.rounds):
            for where in order[r % len(order) :] + order[: r % len(order)]:
                place(proxies, where)
                proxies.lateness_ms()  # (from here)
                for name, fields in configs.items():
                    c0 = cpu_s(proxies)
                    t = _run_prompts(client, prompts, args.max_new_tokens, fields, r + 1)
                    rates[where][name].append(t["tokens"] / t["wall_s"])
                    cpu[where][name].append((cpu_s(proxies) - c0) / t["tokens"] * 1e3)
                late[where].append(proxies.lateness_ms())
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        client.close()
    info["load_average_end"] = list(os.getloadavg())
    first = order[0]
    lines = side_by_side_header(
        "Where the delay proxies run",
        info,
        f"+{args.rtt_ms:g} ms on every hop, the services pinned as in `make bench` (the "
        f"orchestrator with `{' '.join(f'{k}={v}' for k, v in RTT_SETS.items())}`); "
        f"{args.rounds} rounds, each running every configuration under every placement "
        f"(order rotating); {len(prompts)} prompts x {args.max_new_tokens} tokens. The "
        "proxies: " + "; ".join(f"`{p}`: {_where(p)}" for p in order) + ". tok/s medians; "
        f"ratios to `{first}` paired by round (median, range).",
    )
    table, summary = placements_table(list(configs), order, rates)
    lines += table
    lines += [
        "",
        "How late the proxies forwarded held chunks (ms past the hold; each run's median "
        "and 90th percentile, the median over runs), and their CPU per generated token:",
        "",
        "| placement | late, median | late, p90 | chunks | "
        + " | ".join(f"CPU ms/token, {c}" for c in configs)
        + " |",
        "|---" * (4 + len(configs)) + "|",
    ]
    for p in order:
        runs = late[p]
        lines.append(
            f"| {p} | {statistics.median(x['median'] for x in runs):.2f} | "
            f"{statistics.median(x['p90'] for x in runs):.2f} | "
            f"{sum(x['chunks'] for x in runs)} | "
            + " | ".join(f"{statistics.median(cpu[p][c]):.3f}" for c in configs)
            + " |"
        )
    for t in ("0", "1"):
        if f"adaptive@{t}" in configs and f"plain@{t}" in configs:
            each = {
                p: statistics.median(ratios(rates[p][f"adaptive@{t}"], rates[p][f"plain@{t}"]))
                for p in order
            }
            lines += ["", f"adaptive / plain at T={t}, paired: "
                      + ", ".join(f"{p} {v:.3f}" for p, v in each.items())]  # fmt: skip
    save_side_by_side(
        out, lines, info, {"rates": rates, "late_ms": late, "cpu_ms_per_token": cpu}, summary
    )
    return 0


def _where(p: str) -> str:
    cores, nice = PLACEMENTS[p]
    on = "every core" if cores == EVERY else f"core {', '.join(map(str, sorted(cores)))}"
    return f"{on} at niceness {nice}"


if __name__ == "__main__":
    raise SystemExit(main())
