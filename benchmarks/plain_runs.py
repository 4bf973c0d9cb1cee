"""Plain runs side by side: one draft and one target service, two orchestrators
in front of them (``plain_run_tokens`` 8, the default, and 1: one token per
round trip), and ``generate()`` in-process on the same machine for reference.

    python -m benchmarks.plain_runs [--repeats 5] [--out results/plain-runs-<time>]

Rounds interleave every configuration (the order rotating); each round runs the
prompts one after the other (64 new tokens), and, for 8 concurrent clients, 2
requests per client. Reported: median tok/s, and the ratios of the medians.
Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    Client,
    machine_info,
    rotated_rounds,
    start_services,
)
from .run import _run_prompts, clients_round, hf_generate

MAX_NEW = 64
CLIENTS = 8


def one_client(
    address: str, fields: dict, r: int, prompts: int = 8, max_new_tokens: int = MAX_NEW
) -> float:
    """The first ``prompts`` prompts one after the other through one orchestrator: tok/s."""
    c = Client(address)
    t = _run_prompts(c, PROMPTS[:prompts], max_new_tokens, fields, r)
    c.close()
    return t["tokens"] / t["wall_s"]


def _concurrent(address: str, r: int) -> float:
    """CLIENTS clients at once, 2 requests each (T=1): aggregate tok/s."""
    fields = {"temperature": 1.0, "gamma": 0}
    return clients_round(address, CLIENTS, fields, PROMPTS, 2, MAX_NEW, r)[0]


def _generate(model, tok, temperature: float, r: int) -> float:
    """``generate()`` in this process, the same prompts and length (benchmarks.run's call)."""
    tokens = secs = 0.0
    for j, prompt in enumerate(PROMPTS[:8]):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        n, dt = hf_generate(model, ids, MAX_NEW, temperature, 1000 * r + j)
        tokens, secs = tokens + n, secs + dt
    return tokens / secs


WARM_UP = 99  # the round number ``interleaved``'s warm-up calls are given


def interleaved(configs: dict, repeats: int) -> dict[str, list[float]]:
    """Every configuration (a function of the round, giving tok/s) once to warm up
    (round ``WARM_UP``), then ``repeats`` rounds of all of them, the order rotating
    each round."""
    for fn in configs.values():
        fn(WARM_UP)
    names = list(configs)
    rates: dict[str, list[float]] = {k: [] for k in names}
    for r, name in rotated_rounds(names, repeats):
        rates[name].append(configs[name](r))
        if name == names[(r - 1) % len(names)]:  # the round's last
            print(f"round {r + 1}/{repeats} done", flush=True)
    return rates


def ratios(a: list[float], b: list[float]) -> list[float]:
    """Round i of ``a`` over round i of ``b``: the per-round ratios (rounds interleaved,
    so paired)."""
    return [x / y for x, y in zip(a, b, strict=True)]


def paired(a: list[float], b: list[float]) -> float:
    """The median of the per-round ratios a / b."""
    return statistics.median(ratios(a, b))


def paired_cells(a: list[float], b: list[float]) -> str:
    """Two table cells: the median of the per-round ratios a / b, and the rounds'."""
    r = ratios(a, b)
    return f"{statistics.median(r):.3f} | {', '.join(f'{x:.2f}' for x in r)}"


def _loads(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def side_by_side_header(title: str, info: dict, detail: str) -> list[str]:
    """A report's title and its line on the machine, the commit and the load."""
    return [
        f"# {title}",
        "",
        f"{info['date']}, commit {info['git_commit']}, {info['cpu_model']}, "
        f"{info['cpu_cores']} cores; load average {_loads(info['load_average'])} at the start, "
        f"{_loads(info['load_average_end'])} at the end. {detail}",
        "",
    ]


def save_side_by_side(out: Path, lines: list[str], info: dict, rates: dict, med: dict) -> None:
    """Print the table and write it (results.md) and every rate (results.json) to ``out``."""
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps({"machine": info, "rates": rates, "median": med}, indent=2)
    )
    print(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=f"results/plain-runs-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_TARGET))
    model = AutoModelForCausalLM.from_pretrained(str(DEFAULT_TARGET), dtype=torch.float32).eval()
    stack = start_services(out, str(DEFAULT_DRAFT), str(DEFAULT_TARGET), threads=1)
    try:
        runs8 = stack.orchestrator_address
        runs1, _ = stack.start_orchestrator(
            "orchestrator-runs1",
            stack.address("draft"),
            stack.address("target"),
            {"orchestrator.plain_run_tokens": 1, "orchestrator.max_concurrent_requests": 32},
        )
        configs = {
            f"generate()@{t:g}": (lambda r, t=t: _generate(model, tok, t, r)) for t in (0.0, 1.0)
        }
        for name, address in (("runs8", runs8), ("runs1", runs1)):
            for t in (0.0, 1.0):
                f = {"temperature": t, "gamma": 0}
                configs[f"{name}@{t:g}"] = lambda r, a=address, f=f: one_client(a, f, r)
            configs[f"{name} x{CLIENTS} clients@1"] = lambda r, a=address: _concurrent(a, r)
        rates = interleaved(configs, args.repeats)
    finally:
        stack.stop()
    info["load_average_end"] = list(os.getloadavg())
    med = {k: statistics.median(v) for k, v in rates.items()}
    rows = [
        ("greedy", "runs8@0", "runs1@0", "generate()@0"),
        ("T=1", "runs8@1", "runs1@1", "generate()@1"),
    ]
    lines = side_by_side_header(
        "Plain runs, side by side",
        info,
        f"{args.repeats} interleaved rounds; 8 prompts x {MAX_NEW} new tokens; medians.",
    ) + [
        "| | runs (8) tok/s | one token per round trip | runs / one | `generate()` | "
        "runs / `generate()` |",
        "|---|---|---|---|---|---|",
    ]
    for label, a, b, g in rows:
        lines.append(
            f"| {label} | {med[a]:.1f} | {med[b]:.1f} | {med[a] / med[b]:.2f} | {med[g]:.1f} | "
            f"{med[a] / med[g]:.2f} |"
        )
    a, b = f"runs8 x{CLIENTS} clients@1", f"runs1 x{CLIENTS} clients@1"
    lines.append(
        f"| {CLIENTS} clients, T=1 (aggregate) | {med[a]:.1f} | {med[b]:.1f} | "
        f"{med[a] / med[b]:.2f} | | |"
    )
    save_side_by_side(out, lines, info, rates, med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
