"""Pipelined speculation (``orchestrator.pipeline``) beside the steps the
orchestrator asks for, with and without added round-trip time.

    python -m benchmarks.pipeline [--repeats 5] [--rtts 0 10] [--gammas 3 4] [--out DIR]

One draft and one target, pinned as in ``make bench`` (the draft, both
orchestrators and this client on one core, the target on the other); every hop
through the delay proxy, the draft's relays to the target included. Two
orchestrators share them: one with the defaults (steps it asks for: plain,
sequential, drafting ahead, adaptive) and one with ``orchestrator.pipeline`` on,
whose requests that draft ahead are pipelined (``pipe``; ``adaptive-pipe``: its
adaptive requests). Per RTT and temperature each configuration once to warm up,
then ``--repeats`` rounds, the order rotating; ratios are medians of per-round
ratios. Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from .adaptive_check import rate_fns
from .common import PROMPTS, machine_info
from .plain_runs import interleaved, paired, ratios, save_side_by_side, side_by_side_header
from .report import held_out_best
from .run import DRAFT_CORE, FRONT_NICE, pin_stack, proxied_services

PIPELINED = {"orchestrator.pipeline": "true"}


def configs_for(asked: str, piped: str, temp: float, gammas, prompts, tokens: int) -> dict:
    """name -> f(round) giving one round's tok/s."""
    fields: dict[str, dict] = {
        "plain": {"gamma": 0},
        "adaptive": {"gamma": None, "seed": None},
        "adaptive-pipe": {"gamma": None, "seed": None, "via": piped},
    }
    for g in gammas:
        fields[f"seq{g}"] = {"gamma": g, "overlap": False}
        fields[f"ovl{g}"] = {"gamma": g, "overlap": True}
        fields[f"pipe{g}"] = {"gamma": g, "overlap": True, "via": piped}
    return rate_fns(fields, asked, temp, prompts, tokens)


def comparisons(gammas) -> list[tuple[str, str]]:
    out = []
    for g in gammas:
        out += [(f"pipe{g}", f"ovl{g}"), (f"pipe{g}", f"seq{g}"), (f"pipe{g}", "plain")]
    out += [("adaptive-pipe", "adaptive"), ("adaptive-pipe", "plain"), ("adaptive", "plain")]
    return out


def held_out(rates: dict[str, list[float]]) -> dict:
    """Adaptive against the best fixed gamma, held out (``report.held_out_best``): with
    pipelines against every fixed configuration, without against those of the
    orchestrator without them."""
    asked = {k: v for k, v in rates.items() if k.startswith(("seq", "ovl"))}
    fixed = asked | {k: v for k, v in rates.items() if k.startswith("pipe")}
    return {
        "adaptive-pipe": held_out_best(rates["adaptive-pipe"], fixed),
        "adaptive": held_out_best(rates["adaptive"], asked),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rtts", type=float, nargs="*", default=[0.0, 10.0])
    ap.add_argument("--temperatures", type=float, nargs="*", default=[0.0, 1.0])
    ap.add_argument("--gammas", type=int, nargs="*", default=[3, 4])
    ap.add_argument("--prompts", type=int, default=4, help="per round, one after the other")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2, help="orchestrator.pipeline_depth")
    ap.add_argument(
        "--min-rtt-ms",
        type=float,
        default=0.0,
        help="orchestrator.pipeline_min_rtt_ms of the pipelined orchestrator (0: always)",
    )
    ap.add_argument("--out", default=f"results/pipeline-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    prompts = PROMPTS[: args.prompts]
    results: dict[str, dict] = {}
    with proxied_services(out) as (stack, proxies, pd, pt):
        asked, _ = stack.start_orchestrator("orchestrator-asked", pd, pt)
        sets = {
            **PIPELINED,
            "orchestrator.pipeline_depth": str(args.depth),
            "orchestrator.pipeline_min_rtt_ms": str(args.min_rtt_ms),
        }
        piped, _ = stack.start_orchestrator("orchestrator-piped", pd, pt, sets)
        pin_stack(stack)
        stack.pin_extra(DRAFT_CORE, FRONT_NICE)
        for rtt in args.rtts:
            proxies.set_rtt_ms(rtt)
            for temp in args.temperatures:
                key = f"+{rtt:g} ms, T={temp:g}"
                configs = configs_for(asked, piped, temp, args.gammas, prompts, args.max_new_tokens)
                rates = interleaved(configs, args.repeats)
                results[key] = {"rates": rates, "held_out": held_out(rates)}
                line = ", ".join(
                    f"{a}/{b} {paired(rates[a], rates[b]):.3f}" for a, b in comparisons(args.gammas)
                )
                print(f"{key}: {line}", flush=True)
    info["load_average_end"] = list(os.getloadavg())
    lines = side_by_side_header(
        "Pipelined speculation beside the steps the orchestrator asks for",
        info,
        f"Pinned as in `make bench` (pipeline depth {args.depth}, pipelines from "
        f"{args.min_rtt_ms:g} ms of measured round trip), round-trip time added on "
        f"every hop, the draft's relays included; per point {args.repeats} interleaved rounds "
        f"of {len(prompts)} prompts x {args.max_new_tokens} tokens per configuration, after "
        f"a warm-up run of each.",
    )
    pairs = comparisons(args.gammas)
    lines += [
        "| point | " + " | ".join(f"{a} / {b}" for a, b in pairs) + " |",
        "|---" * (len(pairs) + 1) + "|",
    ]
    for key, point in results.items():
        rates = point["rates"]
        cells = []
        for a, b in pairs:
            per = ratios(rates[a], rates[b])
            cells.append(f"**{statistics.median(per):.2f}** ({min(per):.2f}-{max(per):.2f})")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Adaptive against the best fixed gamma, held out (each round against the "
        "configuration fastest over the other rounds):",
        "",
        "| point | adaptive-pipe / best fixed (picks) | adaptive / best fixed without pipelines |",
        "|---|---|---|",
    ]
    for key, point in results.items():
        a, b = point["held_out"]["adaptive-pipe"], point["held_out"]["adaptive"]
        lines.append(
            f"| {key} | **{a['ratio']:.2f}** ({min(a['ratios']):.2f}-{max(a['ratios']):.2f}; "
            f"{', '.join(sorted(set(a['picks'])))}) | **{b['ratio']:.2f}** "
            f"({min(b['ratios']):.2f}-{max(b['ratios']):.2f}) |"
        )
    names = list(next(iter(results.values()))["rates"]) if results else []
    lines += ["", "Median tok/s:", ""]
    lines += ["| point | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    med: dict[str, float] = {}
    for key, point in results.items():
        row = [statistics.median(point["rates"][n]) for n in names]
        med |= {f"{key} {n}": v for n, v in zip(names, row, strict=True)}
        lines.append(f"| {key} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    save_side_by_side(out, lines, info, results, med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
