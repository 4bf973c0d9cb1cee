"""Decoder layers run fused (``fused_projections``, the default for Llama, Mistral,
Qwen2 and Qwen3) against their own calls, side by side.

    python -m benchmarks.fused_projections [--repeats 4] [--clients 8] [--passes 200]
        [--out results/fused-projections-<time>]

Parts:
- pass times: the demo draft's and target's passes through the ragged runtime, one
  runner switching between fused and unfused pass by pass, packed as a service packs
  them (calibrated unfused; fused passes stop where packed ones start); the target
  on 1 thread (a service's) and 2 (one process's), the draft on 1;
- one client, two ways of serving, each with the setting on and off: the three
  services (one torch thread each) and one process (``orchestrator.local_models``,
  as ``benchmarks.head_to_head`` runs it); plain decoding, gamma 4 greedy and at
  T=1, adaptive at T=1; every arm's rounds interleaved (``benchmarks.run.measure``),
  each mode's time per step split into forwards and the rest (issue 15's
  orchestration overhead);
- sustained rounds of ``--clients`` clients on the three services (none: skipped).
Paired ratios. Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from specdec.runtime import packed_linear
from specdec.runtime.loading import load_model
from specdec.runtime.ragged import RaggedRunner

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    Client,
    machine_info,
    stacks_per_arm,
    torch_threads,
)
from .head_to_head import start_one_process
from .lean_forward import alternating_passes
from .plain_runs import ratios, save_side_by_side, side_by_side_header
from .run import CONCURRENCY_MODES, measure, sustained_side_by_side

MODES = {
    "plain@0": {"temperature": 0.0, "gamma": 0},
    "seq4@0": {"temperature": 0.0, "gamma": 4, "overlap": False},
    "seq4@1": {"temperature": 1.0, "gamma": 4, "overlap": False},
    "adaptive@1": {"temperature": 1.0, "gamma": None, "seed": None},
}
ARMS = ("unfused", "fused")
WAYS = ("services", "one")  # the three services; one process
SUSTAINED = ("plain", "seq4", "adaptive")  # CONCURRENCY_MODES, at T=1
MAX_NEW = 64


def pass_times(path: str, passes: int, threads: int) -> dict[str, dict[str, float]]:
    """{shape: {unfused, fused, unfused_best, fused_best}} ms, one runner."""
    with torch_threads(threads):
        model = load_model(path)
        runner = RaggedRunner(model)
        if not runner.fused:
            raise SystemExit(f"{path}: its layers cannot run fused")
        runner.fused = False  # calibrated as a service calibrates
        choice, _ = packed_linear.pack_model(model, runner, 64, 0)
        runner.fused_below = choice or runner.fused_below

        def way(fused: bool) -> Callable[[], None]:
            return lambda: setattr(runner, "fused", fused)

        return alternating_passes(runner, {arm: way(arm == "fused") for arm in ARMS}, passes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--clients", type=int, nargs="*", default=[8])
    ap.add_argument("--warm", type=float, default=1.5, help="seconds not counted per round")
    ap.add_argument("--window", type=float, default=5.0, help="seconds counted per round")
    ap.add_argument("--passes", type=int, default=200, help="passes per arm and shape")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW, help="per request")
    ap.add_argument("--out", default=f"results/fused-projections-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    passes = {
        f"{role}, {threads} thread{'s' * (threads > 1)}": pass_times(path, args.passes, threads)
        for role, path, threads in (
            ("target", args.target, 1),
            ("target", args.target, 2),
            ("draft", args.draft, 1),
        )
    }
    rows = [
        "| model | tokens x sessions | unfused ms (best) | fused ms (best) | fused / unfused |",
        "|---" * 5 + "|",
    ]
    for model, shapes in passes.items():
        for shape, t in shapes.items():
            rows.append(
                f"| {model} | {shape} | {t['unfused']:.3f} ({t['unfused_best']:.3f}) | "
                f"{t['fused']:.3f} ({t['fused_best']:.3f}) | {t['fused'] / t['unfused']:.2f} |"
            )
    arms = {arm: arm == "fused" for arm in ARMS}
    with stacks_per_arm(out, args.draft, args.target, "fused_projections", arms) as stacks:
        # Each arm's one-process orchestrator reads its stack's config: the same setting.
        addresses = {("services", arm): stacks[arm].orchestrator_address for arm in ARMS}
        addresses |= {("one", arm): start_one_process(stacks[arm]) for arm in ARMS}
        clients = {key: Client(address) for key, address in addresses.items()}
        via = {f"{w}:{a}:{m}": clients[w, a] for (w, a) in clients for m in MODES}
        configs = {f"{w}:{a}:{m}": f for (w, a) in clients for m, f in MODES.items()}
        one = measure(via, configs, PROMPTS[:8], args.max_new_tokens, args.repeats)
        for client in clients.values():
            client.close()
        for stack in stacks.values():
            stack.stop_extra()  # (the one-process orchestrators: not idle beside the load)
        rates = sustained_side_by_side(
            {arm: stack.orchestrator_address for arm, stack in stacks.items()}, args.clients,
            {m: CONCURRENCY_MODES[m] for m in SUSTAINED}, PROMPTS, args.max_new_tokens,
            args.repeats, args.warm, args.window,
        )  # fmt: skip
    info["load_average_end"] = list(os.getloadavg())
    lines = side_by_side_header(
        "Decoder layers run fused against their own calls",
        info,
        f"Pass times: {args.passes} passes per arm, alternating. One client: "
        f"{args.repeats} interleaved rounds of 8 prompts x {args.max_new_tokens} tokens per "
        f"mode and arm; the three services on one thread each, one process as head_to_head "
        f"runs it. Sustained rounds ({args.warm:g} s not counted, {args.window:g} s "
        f"counted), T=1, the three services, {args.repeats} per configuration.",
    )
    lines += ["## Pass times (median ms)", ""] + rows
    lines += ["", "## One client (tok/s; ms per step: forwards of draft + target, the rest)", ""]
    lines += [
        "| serving | mode | unfused | fused | fused / unfused (paired) | unfused step | "
        "fused step |",
        "|---" * 7 + "|",
    ]

    def step(row: dict) -> str:
        ms = row["ms_per_step"]
        return (
            f"{ms['step']:.2f} ({ms['draft_forward']:.2f} + {ms['target_forward']:.2f}, "
            f"{ms['overhead']:.2f})"
        )

    for way in WAYS:
        for m in MODES:
            a, b = one[f"{way}:unfused:{m}"], one[f"{way}:fused:{m}"]
            paired = ratios(b["tok_s_runs"], a["tok_s_runs"])
            lines.append(
                f"| {'three services' if way == 'services' else 'one process'} | {m} | "
                f"{a['tok_s']:.1f} | {b['tok_s']:.1f} | {statistics.median(paired):.3f} "
                f"({', '.join(f'{x:.2f}' for x in paired)}) | {step(a)} | {step(b)} |"
            )
    if args.clients:
        lines += ["", "## Sustained load, three services (tok/s)", ""]
        lines += [
            "| clients | mode | unfused | fused | fused / unfused (paired) |",
            "|---" * 5 + "|",
        ]
    med = {k: statistics.median(v) for k, v in rates.items()}
    for n in args.clients:
        for mode in SUSTAINED:
            a, b = rates[f"{n} clients, {mode}, unfused"], rates[f"{n} clients, {mode}, fused"]
            paired = ratios(b, a)
            lines.append(
                f"| {n} | {mode} | {statistics.median(a):.0f} | {statistics.median(b):.0f} | "
                f"{statistics.median(paired):.3f} ({', '.join(f'{x:.2f}' for x in paired)}) |"
            )
    results = rates | {"pass_times": passes, "one_client": one}
    save_side_by_side(out, lines, info, results, med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
