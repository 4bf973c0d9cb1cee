"""Adaptive gamma against the best fixed gamma, with enough rounds to tell.

    python -m benchmarks.adaptive_check [--repeats 6] [--rtts 0 2 10] [--out DIR]

Issue 10 asks adaptive gamma to stay within 5% of the best fixed gamma at 0, 2
and 10 ms of added round-trip time, greedy and T=1. ``make bench`` measures that
in its RTT section with 4 rounds of 3 prompts, and takes the largest of twelve
medians as "the best fixed gamma": an estimate biased upward (see
``benchmarks.report.held_out_best``). This run measures the same setting (the
services pinned as in ``make bench``: draft, orchestrator and this client on one
core, the target on the other; round-trip time added on every hop by the delay
proxy; the orchestrators with the section's settings, ``run.RTT_SETS``:
drafting-ahead steps pipelined where the hop is long, ``--no-pipeline`` for the
defaults) with more rounds, and reports both the in-sample ratio and the held-out
one (round i compared with the fixed configuration that was fastest in the
other rounds).

Per RTT and temperature: adaptive (unseeded: seeded requests use the configured
gamma), plain decoding, and sequential and drafting-ahead gamma for each of
``--gammas``; each configuration once to warm up, then ``--repeats`` rounds, the
order rotating. Per point it also reports, from each orchestrator's metrics,
the mean gamma its adaptive requests chose and its estimate of what a drafted
token costs (the cost model's ``draft_token_seconds``): the benchmark's own
orchestrator serves the fixed configurations too, and what they feed its
estimates can move the adaptive choice ("Requests that draft ahead misled
adaptive ones" in docs/benchmarks.md). Writes results.json, results.md and
adaptive_check.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from .common import PROMPTS, Client, delta, machine_info, pick, scrape
from .plain_runs import interleaved, paired, save_side_by_side, side_by_side_header
from .report import held_out_best
from .run import DRAFT_CORE, FRONT_NICE, RTT_SETS, _run_prompts, pin_stack, proxied_services


def configs_for(
    address: str, temp: float, gammas: list[int], prompts, tokens: int, baseline: str | None
) -> dict:
    """name -> f(round) giving one round's tok/s through ``address`` (and adaptive
    through ``baseline``'s orchestrator as "baseline")."""
    fields = {"adaptive": {"gamma": None, "seed": None}, "plain": {"gamma": 0}}
    if baseline:
        fields["baseline"] = {"gamma": None, "seed": None, "via": baseline}
    for g in gammas:
        fields[f"seq{g}"] = {"gamma": g, "overlap": False}
        fields[f"ovl{g}"] = {"gamma": g, "overlap": True}
    return rate_fns(fields, address, temp, prompts, tokens)


def rate_fns(fields: dict[str, dict], address: str, temp: float, prompts, tokens: int) -> dict:
    """name -> f(round) giving one round's tok/s with that configuration's request
    fields (at ``temp``), through ``address`` or the orchestrator its "via" names."""

    def run(f: dict, r: int) -> float:
        f = dict(f)
        c = Client(f.pop("via", address))
        try:
            t = _run_prompts(c, prompts, tokens, {**f, "temperature": temp}, r)
        finally:
            c.close()
        return t["tokens"] / t["wall_s"]

    return {name: (lambda r, f=f: run(f, r)) for name, f in fields.items()}


def choices(port: int, before: dict) -> dict:
    """What one orchestrator's adaptive requests chose since ``before`` (a scrape of
    its metrics port), and its cost model's estimate of a drafted token's cost now."""
    now = scrape(port)
    d = delta(now, before)
    steps = pick(d, "specdec_adaptive_gamma_count")
    return {
        "mean_gamma": pick(d, "specdec_adaptive_gamma_sum") / steps if steps else None,
        "steps": steps,
        "draft_token_ms": 1000
        * pick(now, "specdec_adaptive_estimate", quantity="draft_token_seconds"),
    }


def plot(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, xs = [], []
    for i, (key, point) in enumerate(results.items()):
        held = point["held_out"]
        ax.bar(i, held["ratio"], color="tab:blue", alpha=0.6)
        ax.scatter([i] * len(held["ratios"]), held["ratios"], color="black", s=10, zorder=3)
        ax.scatter([i], [held["in_sample"]], marker="x", color="tab:red", zorder=4)
        labels.append(key)
        xs.append(i)
    ax.axhline(0.95, color="gray", linestyle="--", linewidth=1)
    ax.axhline(1.0, color="gray", linewidth=0.5)
    ax.set_xticks(xs, labels, rotation=30, ha="right")
    ax.set_ylabel("adaptive / best fixed gamma")
    ax.set_title("bars: held-out best (dots: rounds); x: in-sample largest median")
    fig.tight_layout()
    fig.savefig(out / "adaptive_check.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--rtts", type=float, nargs="*", default=[0.0, 2.0, 10.0])
    ap.add_argument("--temperatures", type=float, nargs="*", default=[0.0, 1.0])
    ap.add_argument("--gammas", type=int, nargs="*", default=[3, 4, 5, 6])
    ap.add_argument("--prompts", type=int, default=4, help="per round, one after the other")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument(
        "--baseline-set",
        nargs="*",
        default=[],
        help="KEY=VALUE config settings of a second orchestrator whose adaptive requests "
        "are measured beside (as 'baseline'), e.g. orchestrator.adaptive_draft_lead=false",
    )
    ap.add_argument(
        "--no-pipeline",
        action="store_true",
        help="the orchestrators without make bench's RTT-section settings (RTT_SETS: "
        "pipelines where the hop is long): drafting-ahead steps asked for, as by default",
    )
    ap.add_argument("--out", default=f"results/adaptive-check-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    prompts = PROMPTS[: args.prompts]
    results: dict[str, dict] = {}
    own = {} if args.no_pipeline else dict(RTT_SETS)
    info["orchestrator_set"] = [f"{k}={v}" for k, v in own.items()]
    with proxied_services(out) as (stack, proxies, pd, pt):
        address, port = stack.start_orchestrator("orchestrator-proxied", pd, pt, own)
        baseline, ports = None, {"adaptive": port}
        if args.baseline_set:
            sets = dict(kv.split("=", 1) for kv in args.baseline_set)  # parsed as --set
            baseline, ports["baseline"] = stack.start_orchestrator(
                "orchestrator-baseline", pd, pt, {**own, **sets}
            )
            info["baseline_set"] = args.baseline_set
        pin_stack(stack)
        stack.pin_extra(DRAFT_CORE, FRONT_NICE)
        for rtt in args.rtts:
            proxies.set_rtt_ms(rtt)
            for temp in args.temperatures:
                key = f"+{rtt:g} ms, T={temp:g}"
                configs = configs_for(
                    address, temp, args.gammas, prompts, args.max_new_tokens, baseline
                )
                before = {name: scrape(p) for name, p in ports.items()}
                rates = interleaved(configs, args.repeats)
                fixed = {k: v for k, v in rates.items() if k[0] in "so"}
                results[key] = {
                    "rates": rates,
                    "held_out": held_out_best(rates["adaptive"], fixed),
                    "vs_plain": paired(rates["adaptive"], rates["plain"]),
                    "chose": {name: choices(p, before[name]) for name, p in ports.items()},
                }
                if baseline:
                    results[key]["baseline_held_out"] = held_out_best(rates["baseline"], fixed)
                    results[key]["vs_baseline"] = paired(rates["adaptive"], rates["baseline"])
                h = results[key]["held_out"]
                print(
                    f"{key}: adaptive / best fixed {h['ratio']:.3f} held out, "
                    f"{h['in_sample']:.3f} in sample; / plain {results[key]['vs_plain']:.3f}",
                    flush=True,
                )
    info["load_average_end"] = list(os.getloadavg())
    sets = ", ".join(f"`{x}`" for x in info["orchestrator_set"]) or "the defaults"
    lines = side_by_side_header(
        "Adaptive gamma against the best fixed gamma",
        info,
        f"Pinned as in `make bench`, round-trip time added on every hop; the "
        f"orchestrators with {sets}; per point "
        f"{args.repeats} interleaved rounds of {len(prompts)} prompts x "
        f"{args.max_new_tokens} tokens per configuration, after a warm-up run of each.",
    )
    lines += [
        "| point | adaptive tok/s | best fixed (in sample) | adaptive / best, in sample | "
        "adaptive / best, held out (rounds) | picks | adaptive / plain |",
        "|---" * 7 + "|",
    ]
    med: dict[str, float] = {}
    for key, point in results.items():
        rates, h = point["rates"], point["held_out"]
        meds = {k: statistics.median(v) for k, v in rates.items()}
        med |= {f"{key} {k}": v for k, v in meds.items()}
        best = max((k for k in meds if k[0] in "so"), key=meds.get)
        picks = ", ".join(sorted(set(h["picks"])))
        per_round = ", ".join(f"{x:.2f}" for x in h["ratios"])
        lines.append(
            f"| {key} | {meds['adaptive']:.1f} | {best} {meds[best]:.1f} | "
            f"{h['in_sample']:.3f} | **{h['ratio']:.3f}** ({per_round}) "
            f"| {picks} | {point['vs_plain']:.3f} |"
        )
    if any("vs_baseline" in point for point in results.values()):
        lines += [
            "",
            f"Beside it, adaptive through a second orchestrator with "
            f"`{' '.join(args.baseline_set)}` (baseline):",
            "",
            "| point | baseline / best, held out | adaptive / baseline (paired) |",
            "|---" * 3 + "|",
        ]
        for key, point in results.items():
            lines.append(
                f"| {key} | {point['baseline_held_out']['ratio']:.3f} | "
                f"{point['vs_baseline']:.3f} |"
            )
    lines += [
        "",
        "What adaptive requests chose (mean gamma over the point's steps, warm-up "
        "included) and each orchestrator's estimate of a drafted token's cost at "
        "the point's end:",
        "",
        "| point | "
        + " | ".join(f"{n} mean gamma | {n} ms per drafted token" for n in ports)
        + " |",
        "|---" * (1 + 2 * len(ports)) + "|",
    ]
    for key, point in results.items():
        cells = []
        for name in ports:
            c = point["chose"][name]
            g = "-" if c["mean_gamma"] is None else f"{c['mean_gamma']:.2f}"
            cells += [g, f"{c['draft_token_ms']:.3f}"]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += ["", "Every configuration's median tok/s:", ""]
    names = list(next(iter(results.values()))["rates"]) if results else []
    lines += ["| point | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key, point in results.items():
        row = [f"{statistics.median(point['rates'][n]):.1f}" for n in names]
        lines.append(f"| {key} | " + " | ".join(row) + " |")
    lines += ["", "![adaptive / best fixed](adaptive_check.png)"]
    plot(out, results)
    save_side_by_side(out, lines, info, results, med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
