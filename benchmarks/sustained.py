"""Sustained load: N clients each sending requests back to back, counted by the
tokens streamed to them inside a fixed window, for each target thread count.

    python -m benchmarks.sustained [--clients 1,2,4,8,16,32] [--threads 1,2]
        [--window 5] [--repeats 2] [--one-process] [--out results/sustained-<time>]

What a server sees under steady traffic. ``make bench``'s concurrency section
runs rounds instead (every client starts together, sends 2 requests and the
round ends with its slowest client), which also charges the idle tail of each
round. Here a round lasts ``--warm`` seconds (not counted: requests starting
and the measured check settling) plus ``--window`` seconds, and every token
streamed to any client inside the window counts, whichever request it belongs
to. Per thread setting one stack (draft 1 thread, target ``threads``); per
client count, plain decoding, adaptive and gamma 4, T=1, the order rotating
each round. ``--one-process``: beside each stack, an orchestrator with both
models in its process (``orchestrator.local_models``, its target on 2 threads:
``head_to_head.start_one_process``), whose modes (``one process <mode>``) join the
same rotation. Reported: median tok/s of the rounds and their ratios. Prints a
table; writes results.json, results.md and sustained.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from .common import DEFAULT_DRAFT, DEFAULT_TARGET, PROMPTS, machine_info, rotated_rounds
from .common import start_services as _start
from .head_to_head import start_one_process
from .plain_runs import side_by_side_header
from .run import CONCURRENCY_MODES as MODES
from .run import sustained_round

MAX_NEW = 64
ONE = "one process"  # the prefix of the one-process orchestrator's arms


def measure(args, threads: int, out: Path) -> dict[str, dict[str, list[float]]]:
    """{clients: {mode: tok/s of each round}} on a fresh stack with ``threads``."""
    stack = _start(
        out / f"threads{threads}", args.draft, args.target,
        threads=threads, draft_threads=1,
    )  # fmt: skip
    rates: dict[str, dict[str, list[float]]] = {}
    try:
        arms = {m: (stack.orchestrator_address, f) for m, f in MODES.items()}
        if args.one_process:
            address = start_one_process(stack)
            arms |= {f"{ONE} {m}": (address, f) for m, f in MODES.items()}
        for address in {a for a, _ in arms.values()}:  # warm
            sustained_round(address, 4, MODES["adaptive"], PROMPTS, MAX_NEW, 1.0, 1.0, 99)
        for n in args.clients:
            row: dict[str, list[float]] = {arm: [] for arm in arms}
            for r, arm in rotated_rounds(list(arms), args.repeats):
                address, fields = arms[arm]
                row[arm].append(
                    sustained_round(address, n, fields, PROMPTS, MAX_NEW, args.warm, args.window, r)
                )
            rates[str(n)] = row
            med = {m: statistics.median(v) for m, v in row.items()}
            print(
                f"target {threads} thread(s), {n} clients: "
                + ", ".join(f"{m} {v:.0f}" for m, v in med.items())
                + f" tok/s; load average {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    finally:
        stack.stop()
    return rates


def _best_ratio(row: dict[str, float]) -> float:
    """The one-process orchestrator's fastest mode over the stack's fastest."""
    one = max(v for arm, v in row.items() if arm.startswith(ONE))
    return one / max(v for arm, v in row.items() if not arm.startswith(ONE))


def plot(med: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"plain": "black", "adaptive": "tab:green", "seq4": "tab:blue"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for threads, rows in med.items():
        style = "-" if threads == "1" else "--"
        clients = sorted(rows, key=int)
        for arm in rows[clients[0]]:
            one = arm.startswith(ONE)
            ax.plot(
                [int(c) for c in clients],
                [rows[c][arm] for c in clients],
                ":" if one else style,
                marker="s" if one else "o",
                color=colors[arm.split()[-1]],
                label=f"{arm} (stack: target {threads} thread(s))"
                if one
                else f"{arm}, target {threads} thread(s)",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("tokens/s streamed (sustained)")
    ax.set_title("Sustained load, T=1, shared cores")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "sustained.png", dpi=90)
    plt.close(fig)
    return "sustained.png"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--clients", default="1,2,4,8,16,32")
    ap.add_argument("--threads", default="1,2", help="target torch threads to compare")
    ap.add_argument("--warm", type=float, default=2.0, help="seconds not counted per round")
    ap.add_argument("--window", type=float, default=5.0, help="seconds counted per round")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--one-process", action="store_true", help="also an orchestrator with both models in it"
    )
    ap.add_argument("--out", default=f"results/sustained-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    args.clients = [int(x) for x in args.clients.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    rates = {str(t): measure(args, int(t), out) for t in args.threads.split(",")}
    info["load_average_end"] = list(os.getloadavg())
    med = {
        t: {n: {m: statistics.median(v) for m, v in row.items()} for n, row in rows.items()}
        for t, rows in rates.items()
    }
    lines = side_by_side_header(
        "Sustained load: target threads and concurrent clients",
        info,
        f"T=1, {MAX_NEW} new tokens per request, draft 1 thread, shared cores; per round "
        f"{args.warm:g} s not counted then a {args.window:g} s window; {args.repeats} rounds "
        "per configuration, interleaved; medians (tok/s).",
    )
    first = next(iter(med))
    arms = list(med[first][next(iter(med[first]))])
    ratio_names = ["adaptive / plain", "seq4 / plain"]
    if args.one_process:
        ratio_names.append(f"{ONE}, best mode / the stack's best")
    head = (
        "| clients | "
        + " | ".join(f"{arm}, {t} thr" for t in med for arm in arms)
        + " | "
        + " | ".join(ratio_names)
        + " |"
    )
    lines += [head, "|" + "---|" * (1 + len(med) * len(arms) + len(ratio_names))]
    for n in med[first]:
        cells = [f"{med[t][n][arm]:.0f}" for t in med for arm in arms]
        ratios = [
            "; ".join(f"{med[t][n][m] / med[t][n]['plain']:.2f} ({t} thr)" for t in med)
            for m in ("adaptive", "seq4")
        ]
        if args.one_process:
            ratios.append("; ".join(f"{_best_ratio(med[t][n]):.2f} ({t} thr)" for t in med))
        lines.append(f"| {n} | " + " | ".join(cells + ratios) + " |")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps({"machine": info, "rates": rates, "median": med}, indent=2)
    )
    plot(med, out)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
