"""Sustained load: N clients each sending requests back to back, counted by the
tokens streamed to them inside a fixed window, for each target thread count.

    python -m benchmarks.sustained [--clients 1,2,4,8,16,32] [--threads 1,2]
        [--window 5] [--repeats 2] [--out results/sustained-<time>]

What a server sees under steady traffic. ``make bench``'s concurrency section
runs rounds instead (every client starts together, sends 2 requests and the
round ends with its slowest client), which also charges the idle tail of each
round. Here a round lasts ``--warm`` seconds (not counted: requests starting
and the measured check settling) plus ``--window`` seconds, and every token
streamed to any client inside the window counts, whichever request it belongs
to. Per thread setting one stack (draft 1 thread, target ``threads``); per
client count, plain decoding, adaptive and gamma 4, T=1, the order rotating
each round. Reported: median tok/s of the rounds and their ratios. Prints a
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
from .plain_runs import side_by_side_header
from .run import CONCURRENCY_MODES as MODES
from .run import sustained_round

MAX_NEW = 64


def measure(args, threads: int, out: Path) -> dict[str, dict[str, list[float]]]:
    """{clients: {mode: tok/s of each round}} on a fresh stack with ``threads``."""
    stack = _start(
        out / f"threads{threads}", str(DEFAULT_DRAFT), str(DEFAULT_TARGET),
        threads=threads, draft_threads=1,
    )  # fmt: skip
    rates: dict[str, dict[str, list[float]]] = {}
    try:
        address = stack.orchestrator_address
        sustained_round(address, 4, MODES["adaptive"], PROMPTS, MAX_NEW, 1.0, 1.0, 99)  # warm
        for n in args.clients:
            row: dict[str, list[float]] = {m: [] for m in MODES}
            for r, mode in rotated_rounds(list(MODES), args.repeats):
                row[mode].append(
                    sustained_round(
                        address, n, MODES[mode], PROMPTS, MAX_NEW, args.warm, args.window, r
                    )
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


def plot(med: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"plain": "black", "adaptive": "tab:green", "seq4": "tab:blue"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for threads, rows in med.items():
        style = "-" if threads == "1" else "--"
        clients = sorted(rows, key=int)
        for mode in MODES:
            ax.plot(
                [int(c) for c in clients],
                [rows[c][mode] for c in clients],
                style,
                marker="o",
                color=colors[mode],
                label=f"{mode}, target {threads} thread(s)",
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
    ap.add_argument("--clients", default="1,2,4,8,16,32")
    ap.add_argument("--threads", default="1,2", help="target torch threads to compare")
    ap.add_argument("--warm", type=float, default=2.0, help="seconds not counted per round")
    ap.add_argument("--window", type=float, default=5.0, help="seconds counted per round")
    ap.add_argument("--repeats", type=int, default=2)
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
    head = (
        "| clients | "
        + " | ".join(f"{m}, {t} thr" for t in med for m in MODES)
        + " | adaptive / plain | seq4 / plain |"
    )
    lines += [head, "|" + "---|" * (2 + len(med) * len(MODES) + 1)]
    for n in med[next(iter(med))]:
        cells = [f"{med[t][n][m]:.0f}" for t in med for m in MODES]
        ratios = [
            "; ".join(f"{med[t][n][m] / med[t][n]['plain']:.2f} ({t} thr)" for t in med)
            for m in ("adaptive", "seq4")
        ]
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
