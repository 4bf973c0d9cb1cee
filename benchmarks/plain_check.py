"""The measured check against plain decoding, side by side: one draft and one
target service, orchestrators in front of them with ``adaptive_plain_check`` on
and off (the default), and plain decoding (gamma 0) through the same target.

    python -m benchmarks.plain_check [--repeats 3] [--out results/plain-check-<time>]

Two parts, each with its own warm-up run of every configuration (the check
learns from it, as it would from a server's earlier traffic):
- one client, the prompts one after the other, at added round-trip times
  (``--rtts``, through the delay proxy to both services), greedy and T=1, the
  services pinned as in ``make bench``'s round-trip sweep (draft, orchestrators
  and this client on one core, the target on the other);
- concurrent clients at T=1 (``--clients``), 3 requests of 64 tokens each, on
  shared cores as in ``make bench``'s concurrency section.
``--baseline-set KEY=VALUE ...`` adds a fourth configuration: adaptive requests,
the check on, through an orchestrator with those settings ("baseline"), for a
side-by-side of an adaptive setting under load. ``--set KEY=VALUE ...`` applies
to every orchestrator (the baseline's own settings win), and ``--services-set
SECTION.KEY=VALUE ...`` to the draft and target services; for example the
hidden-state wire against the list under load:

    python -m benchmarks.plain_check --rtts --clients 1 4 8 16 \
        --services-set draft.hidden_q=true target.draft_head=models/demo/draft \
        --set orchestrator.wire_hidden=false --baseline-set orchestrator.wire_hidden=true
Rounds interleave the configurations, the order rotating; medians. Prints a
table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from specdec.local.proxy import ProxyGroup

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    machine_info,
    service_settings,
    start_services,
)
from .plain_runs import interleaved, one_client, save_side_by_side, side_by_side_header
from .run import DRAFT_CORE, FRONT_NICE, clients_round, pin_stack, unpin_stack

MAX_NEW = 64
MODES = {  # name: (orchestrator, request fields)
    "check": ("on", {"gamma": None, "seed": None}),
    "no check": ("off", {"gamma": None, "seed": None}),
    "plain": ("on", {"gamma": 0}),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rtts", type=float, nargs="*", default=[2.0, 5.0])
    ap.add_argument("--clients", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument(
        "--check-min-requests",
        type=int,
        default=1,
        help="the check's adaptive_plain_check_min_requests (1: at any load)",
    )
    ap.add_argument(
        "--baseline-set",
        nargs="*",
        default=[],
        help="KEY=VALUE config settings of one more orchestrator (the check on) whose "
        "adaptive requests are measured beside (as 'baseline'), e.g. "
        "orchestrator.adaptive_explore_per_request=false",
    )
    ap.add_argument(
        "--services-set",
        nargs="*",
        default=[],
        help="SECTION.KEY=VALUE settings of the draft and target services, e.g. "
        "draft.hidden_q=true target.draft_head=models/demo/draft",
    )
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        dest="every_set",
        help="KEY=VALUE settings of every orchestrator (the baseline's own override them)",
    )
    ap.add_argument("--out", default=f"results/plain-check-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    info["check_min_requests"] = args.check_min_requests
    services = service_settings(args.services_set, "--services-set")
    info["services_set"], info["every_set"] = args.services_set, args.every_set
    stack = start_services(
        out, str(DEFAULT_DRAFT), str(DEFAULT_TARGET), threads=1, draft_threads=1, settings=services
    )
    proxies = ProxyGroup()
    rates: dict[str, list[float]] = {}
    try:

        def sets(check: bool) -> dict:
            return {
                "orchestrator.adaptive_plain_check": check,
                "orchestrator.adaptive_plain_check_min_requests": args.check_min_requests,
                "orchestrator.max_concurrent_requests": 32,
                **dict(kv.split("=", 1) for kv in args.every_set),  # parsed as --set
            }

        d, t = stack.address("draft"), stack.address("target")
        direct = {
            "on": stack.start_orchestrator("orchestrator-check", d, t, sets(True))[0],
            "off": stack.start_orchestrator("orchestrator-nocheck", d, t, sets(False))[0],
        }
        modes = dict(MODES)
        if args.baseline_set:
            extra = dict(kv.split("=", 1) for kv in args.baseline_set)  # parsed as --set
            direct["baseline"] = stack.start_orchestrator(
                "orchestrator-baseline", d, t, {**sets(True), **extra}
            )[0]
            modes["baseline"] = ("baseline", MODES["check"][1])
            info["baseline_set"] = args.baseline_set
        d, t = proxies.add(d), proxies.add(t)
        proxied = {
            "on": stack.start_orchestrator("orchestrator-proxied", d, t, sets(True))[0],
            "off": stack.start_orchestrator("orchestrator-proxied-nocheck", d, t, sets(False))[0],
        }
        pin_stack(stack)
        stack.pin_extra(DRAFT_CORE, FRONT_NICE)
        for rtt in args.rtts:
            proxies.set_rtt_ms(rtt)
            configs = {}
            for temp in (0.0, 1.0):
                for mode, (orch, fields) in MODES.items():
                    f = {**fields, "temperature": temp}
                    configs[f"{mode}@{temp:g} +{rtt:g}ms"] = lambda r, a=proxied[orch], f=f: (
                        one_client(a, f, r)
                    )
            rates |= interleaved(configs, args.repeats)
            print(f"RTT +{rtt:g} ms done", flush=True)
        unpin_stack(stack)
        for n in args.clients:
            configs = {
                f"{mode} x{n}": (
                    lambda r, a=direct[orch], f={**fields, "temperature": 1.0}, n=n: clients_round(
                        a, n, f, PROMPTS, 3, MAX_NEW, r
                    )[0]
                )
                for mode, (orch, fields) in modes.items()
            }
            rates |= interleaved(configs, args.repeats)
            print(f"{n} clients done", flush=True)
    finally:
        stack.stop()
        proxies.close()
    info["load_average_end"] = list(os.getloadavg())
    med = {k: statistics.median(v) for k, v in rates.items()}
    lines = side_by_side_header(
        "The measured check against plain decoding, side by side",
        info,
        f"{args.repeats} interleaved rounds after a warm-up run; medians. Adaptive requests "
        f"(gamma unset) with the check on (from {args.check_min_requests} requests at once) "
        f"and off; plain = gamma 0.",
    ) + [
        "| | check tok/s | no check | plain | check / plain | no check / plain | "
        "check / no check |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [(f"{'greedy' if t == 0 else 'T=1'}, +{rtt:g} ms RTT, 1 client", f"@{t:g} +{rtt:g}ms")
            for rtt in args.rtts for t in (0.0, 1.0)]  # fmt: skip
    rows += [(f"{n} clients, T=1 (aggregate)", f" x{n}") for n in args.clients]
    for label, key in rows:
        c, nc, p = med[f"check{key}"], med[f"no check{key}"], med[f"plain{key}"]
        lines.append(
            f"| {label} | {c:.1f} | {nc:.1f} | {p:.1f} | {c / p:.2f} | {nc / p:.2f} | "
            f"{c / nc:.2f} |"
        )
    if args.baseline_set:
        lines += [
            "",
            f"Baseline: adaptive, the check on, with {' '.join(args.baseline_set)}.",
            "",
            "| | check tok/s | baseline | plain | check / plain | baseline / plain | "
            "check / baseline, paired rounds |",
            "|---|---|---|---|---|---|---|",
        ]
        for n in args.clients:
            key = f" x{n}"
            c, b, p = med[f"check{key}"], med[f"baseline{key}"], med[f"plain{key}"]
            pair = zip(rates[f"check{key}"], rates[f"baseline{key}"], strict=True)
            each = [x / y for x, y in pair]  # per round; their median is the paired ratio
            lines.append(
                f"| {n} clients | {c:.1f} | {b:.1f} | {p:.1f} | {c / p:.2f} | {b / p:.2f} | "
                f"{statistics.median(each):.2f} ({', '.join(f'{x:.2f}' for x in each)}) |"
            )
    save_side_by_side(out, lines, info, rates, med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
