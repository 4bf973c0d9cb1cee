"""Relay side by side: the draft sending its proposal straight to the target
(``orchestrator.relay``, the default) against the route through the
orchestrator, with one draft and one target service behind two orchestrators
that differ only in ``relay``.

    python -m benchmarks.relay [--repeats 5] [--out results/relay-<time>]

Parts (each configuration once to warm up, then interleaved rounds, the order
rotating; medians and paired ratios):
- one client, 8 prompts x 64 tokens, gamma 4 (sequential, and drafting ahead)
  and adaptive, greedy and T=1, on shared cores and pinned as in ``make bench``
  (draft, orchestrators and this client on one core, the target on the other;
  ``--rtts-only``: skipped);
- the same pinned, with round-trip time added on every hop (``--rtts``, the
  delay proxy: the relay goes through the target's proxy too), against plain
  decoding (gamma 0) through the same proxies;
- concurrent clients at T=1 (``--clients``), adaptive, shared cores.
``--baseline waiting``: the second orchestrator relays too, but without
drafting on (``orchestrator.draft_on: false``: the draft waits for each
propose), so the two differ only in drafting on. ``--baseline no-ahead``: it
drafts on too, but not in steps that draft ahead (``draft_on_ahead: false``).
Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from specdec.local.proxy import ProxyGroup

from .common import DEFAULT_DRAFT, DEFAULT_TARGET, PROMPTS, machine_info, start_services
from .plain_runs import (
    interleaved,
    one_client,
    paired,
    save_side_by_side,
    side_by_side_header,
)
from .run import DRAFT_CORE, FRONT_NICE, clients_round, pin_stack, unpin_stack

MAX_NEW = 64
ONE_CLIENT = {
    "gamma 4": {"gamma": 4, "overlap": False},
    "gamma 4 ahead": {"gamma": 4, "overlap": True},
    "adaptive": {"gamma": None},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rtts", type=float, nargs="*", default=[2.0, 10.0])
    ap.add_argument("--clients", type=int, nargs="*", default=[8, 16])
    ap.add_argument("--no-one-client", action="store_true", help="only the concurrent part")
    ap.add_argument(
        "--rtts-only", action="store_true", help="of the one-client parts, only the RTT ones"
    )
    ap.add_argument(
        "--relay-max-requests",
        type=int,
        default=None,
        help="the relaying orchestrator's relay_max_requests (default: the config's)",
    )
    ap.add_argument(
        "--baseline",
        choices=["direct", "waiting", "no-ahead"],
        default="direct",
        help="the second orchestrator: no relay (direct), a relay without drafting on "
        "(waiting), or drafting on but not in steps that draft ahead (no-ahead)",
    )
    ap.add_argument("--out", default=f"results/relay-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    stack = start_services(out, str(DEFAULT_DRAFT), str(DEFAULT_TARGET), threads=1, draft_threads=1)
    proxies = ProxyGroup()
    rates: dict[str, list[float]] = {}

    def unpin() -> None:
        unpin_stack(stack)

    def one_client_configs(orchs: dict, suffix: str, plain: bool = False) -> dict:
        configs = {}
        for temp in (0.0, 1.0):
            modes = {**ONE_CLIENT, **({"plain": {"gamma": 0}} if plain else {})}
            for mode, fields in modes.items():
                routes = orchs if mode != "plain" else {"direct": orchs["direct"]}
                for route, address in routes.items():
                    f = {**fields, "temperature": temp}
                    configs[f"{route} {mode}@{temp:g}{suffix}"] = lambda r, a=address, f=f: (
                        one_client(a, f, r)
                    )
        return configs

    try:
        d, t = stack.address("draft"), stack.address("target")
        sets = {"orchestrator.max_concurrent_requests": 32}
        relay_sets = dict(sets)
        if args.relay_max_requests is not None:
            relay_sets["orchestrator.relay_max_requests"] = args.relay_max_requests
            info["relay_max_requests"] = args.relay_max_requests
        relay_address, relay_metrics = stack.start_orchestrator("orch-relay", d, t, relay_sets)
        base_sets = {**sets, "orchestrator.relay": False}
        if args.baseline == "waiting":
            base_sets = {**relay_sets, "orchestrator.draft_on": False}
        elif args.baseline == "no-ahead":
            base_sets = {**relay_sets, "orchestrator.draft_on_ahead": False}
        info["baseline"] = args.baseline
        direct = {
            "relay": relay_address,
            "direct": stack.start_orchestrator("orch-direct", d, t, base_sets)[0],
        }
        if args.no_one_client:
            args.rtts = []
        proxied = {}  # through the delay proxies, for the RTT parts only
        if args.rtts:
            pd, pt = proxies.add(d), proxies.add(t)
            proxied = {
                "relay": stack.start_orchestrator("orch-relay-proxied", pd, pt, relay_sets)[0],
                "direct": stack.start_orchestrator("orch-direct-proxied", pd, pt, base_sets)[0],
            }
        if not (args.no_one_client or args.rtts_only):
            rates |= interleaved(one_client_configs(direct, " shared"), args.repeats)
            print("shared cores done", flush=True)
        if args.rtts:
            pin_stack(stack)
            stack.pin_extra(DRAFT_CORE, FRONT_NICE)
        if not (args.no_one_client or args.rtts_only):
            rates |= interleaved(one_client_configs(direct, " pinned"), args.repeats)
            print("pinned done", flush=True)
        for rtt in args.rtts:
            proxies.set_rtt_ms(rtt)
            rates |= interleaved(
                one_client_configs(proxied, f" +{rtt:g}ms", plain=True), args.repeats
            )
            print(f"RTT +{rtt:g} ms done", flush=True)
        unpin()
        for n in args.clients:
            configs = {
                f"{route} x{n}": (
                    lambda r, a=address, n=n: clients_round(
                        a, n, {"gamma": None, "temperature": 1.0}, PROMPTS, 3, MAX_NEW, r
                    )[0]
                )
                for route, address in direct.items()
            }
            rates |= interleaved(configs, args.repeats)
            print(f"{n} clients done", flush=True)
        text = stack.metrics_text("orchestrator", port=relay_metrics)
        info["relay_outcomes_unproxied"] = {
            ln.split('"')[1]: float(ln.split()[-1])
            for ln in text.splitlines()
            if ln.startswith("specdec_relayed_steps_total{")
        }
    finally:
        stack.stop()
        proxies.close()
    info["load_average_end"] = list(os.getloadavg())
    med = {k: statistics.median(v) for k, v in rates.items()}

    lines = side_by_side_header(
        "Relay: the draft's proposal straight to the target, side by side",
        info,
        f"{args.repeats} interleaved rounds after a warm-up run; medians, and the median "
        "of the paired per-round ratios. relay = the defaults (`orchestrator.relay` and "
        "`draft_on` true), "
        + (
            {
                "direct": "direct = `relay: false`",
                "waiting": "direct = the same relay with `draft_on: false` (the draft waits "
                "for each propose)",
                "no-ahead": "direct = drafting on too, but not in steps that draft ahead "
                "(`draft_on_ahead: false`)",
            }[args.baseline]
        )
        + "; one draft and one target behind both.",
    ) + [
        "| | relay tok/s | direct tok/s | relay / direct (medians) | paired | relay / plain |",
        "|---|---|---|---|---|---|",
    ]
    suffixes = [] if args.no_one_client or args.rtts_only else [" shared", " pinned"]
    suffixes += [f" +{rtt:g}ms" for rtt in args.rtts]
    for suffix in suffixes:
        for temp in (0.0, 1.0):
            for mode in ONE_CLIENT:
                key = f"{mode}@{temp:g}{suffix}"
                a, b = med[f"relay {key}"], med[f"direct {key}"]
                plain = med.get(f"direct plain@{temp:g}{suffix}")
                vs_plain = f"{a / plain:.2f}" if plain else "-"
                label = f"{mode}, {'greedy' if temp == 0 else 'T=1'}, {suffix.strip()}"
                lines.append(
                    f"| {label} | {a:.1f} | {b:.1f} | {a / b:.3f} | "
                    f"{paired(rates[f'relay {key}'], rates[f'direct {key}']):.3f} | {vs_plain} |"
                )
    for n in args.clients:
        a, b = med[f"relay x{n}"], med[f"direct x{n}"]
        lines.append(
            f"| adaptive, {n} clients, T=1, shared | {a:.1f} | {b:.1f} | {a / b:.3f} | "
            f"{paired(rates[f'relay x{n}'], rates[f'direct x{n}']):.3f} | - |"
        )
    save_side_by_side(out, lines, info, rates, med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
