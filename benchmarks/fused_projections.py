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

import os
import statistics
from collections.abc import Callable
from pathlib import Path

from specdec.runtime import packed_linear
from specdec.runtime.loading import load_model
from specdec.runtime.ragged import RaggedRunner

from .common import (
    PROMPTS,
    Client,
    machine_info,
    stacks_per_arm,
    torch_threads,
)
from .head_to_head import start_one_process
from .lean_forward import (
    SUSTAINED,
    alternating_passes,
    paired_cell,
    pass_rows,
    side_by_side_args,
    step_cell,
    sustained_rows,
)
from .plain_runs import save_side_by_side, side_by_side_header
from .run import CONCURRENCY_MODES, measure, sustained_side_by_side

MODES = {
    "plain@0": {"temperature": 0.0, "gamma": 0},
    "seq4@0": {"temperature": 0.0, "gamma": 4, "overlap": False},
    "seq4@1": {"temperature": 1.0, "gamma": 4, "overlap": False},
    "adaptive@1": {"temperature": 1.0, "gamma": None, "seed": None},
}
ARMS = ("unfused", "fused")
WAYS = ("services", "one")  # the three services; one process
MAX_NEW = 64


def pass_times(path: str, passes: int, threads: int) -> dict[str, dict[str, float]]:
    """{shape: {unfused, fused, unfused_best, fused_best}} ms, one runner."""
    with torch_threads(threads):
        model = load_model(path)
        runner = RaggedRunner(model)
        if not runner.fused:
            raise SystemExit(f"{path}: its layers cannot run fused")
        packed_linear.pack_model(model, runner, 64, 0)  # as a service packs

        def way(fused: bool) -> Callable[[], None]:
            return lambda: setattr(runner, "fused", fused)

        return alternating_passes(runner, {arm: way(arm == "fused") for arm in ARMS}, passes)


def measure_both_ways(
    args, out: Path, key: str, arms: dict[str, object], modes: dict[str, dict]
) -> tuple[dict, dict]:
    """One stack per arm (``stacks_per_arm``: the model-service setting ``key`` at the
    arm's value), each also served by one process (``start_one_process``, which reads
    the stack's config: the same setting). One client: every mode both ways and
    arms, rounds interleaved (``measure``), rows named "way:arm:mode"; then the three
    services under sustained load (``args.clients``). Returns (rows, sustained rates)."""
    names = list(arms)
    with stacks_per_arm(out, args.draft, args.target, key, arms) as stacks:
        addresses = {("services", arm): stacks[arm].orchestrator_address for arm in names}
        addresses |= {("one", arm): start_one_process(stacks[arm]) for arm in names}
        clients = {k: Client(address) for k, address in addresses.items()}
        via = {f"{w}:{a}:{m}": clients[w, a] for (w, a) in clients for m in modes}
        configs = {f"{w}:{a}:{m}": f for (w, a) in clients for m, f in modes.items()}
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
    return one, rates


def both_ways_rows(
    one: dict, modes: dict, arms: tuple[str, str], extra: tuple[str, Callable] | None = None
) -> list[str]:
    """The one-client table of ``measure_both_ways``'s rows: each way and mode, both
    arms' tok/s, their paired ratio and steps; ``extra``: (header, cell of the two
    arms' rows), a column more."""
    a, b = arms
    head = f"| serving | mode | {a} | {b} | {b} / {a} (paired) | {a} step | {b} step |"
    lines = [head + (f" {extra[0]} |" if extra else ""), "|---" * (7 + bool(extra)) + "|"]
    for way in WAYS:
        for m in modes:
            x, y = one[f"{way}:{a}:{m}"], one[f"{way}:{b}:{m}"]
            lines.append(
                f"| {'three services' if way == 'services' else 'one process'} | {m} | "
                f"{x['tok_s']:.1f} | {y['tok_s']:.1f} | "
                f"{paired_cell(x['tok_s_runs'], y['tok_s_runs'])} | {step_cell(x)} | "
                f"{step_cell(y)} |" + (f" {extra[1](x, y)} |" if extra else "")
            )
    return lines


def side_by_side_both_ways(
    args,
    title: str,
    key: str,
    arms: tuple[str, str],
    modes: dict[str, dict],
    passes_of: Callable[[], dict],
    extra: tuple[str, Callable] | None = None,
) -> int:
    """A model-service setting ``key`` off (``arms[0]``) and on (``arms[1]``): pass times
    (``passes_of()``, {model: {shape: times}}), then ``measure_both_ways``; writes the
    report (``both_ways_rows``, with ``extra``) and results.json into ``args.out``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    passes = passes_of()
    one, rates = measure_both_ways(args, out, key, {arm: arm == arms[1] for arm in arms}, modes)
    info["load_average_end"] = list(os.getloadavg())
    lines = side_by_side_header(
        title,
        info,
        f"Pass times: {args.passes} passes per arm, alternating. One client: "
        f"{args.repeats} interleaved rounds of 8 prompts x {args.max_new_tokens} tokens per "
        f"mode and arm; the three services on one thread each, one process as head_to_head "
        f"runs it. Sustained rounds ({args.warm:g} s not counted, {args.window:g} s "
        f"counted), T=1, the three services, {args.repeats} per configuration.",
    )
    lines += ["## Pass times (median ms)", ""] + pass_rows(passes, arms)
    lines += ["", "## One client (tok/s; ms per step: forwards of draft + target, the rest)", ""]
    lines += both_ways_rows(one, modes, arms, extra)
    if args.clients:
        lines += ["", "## Sustained load, three services (tok/s)", ""]
        lines += sustained_rows(rates, args.clients, arms)
    med = {k: statistics.median(v) for k, v in rates.items()}
    results = rates | {"pass_times": passes, "one_client": one}
    save_side_by_side(out, lines, info, results, med)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = side_by_side_args(__doc__, "fused-projections", 4).parse_args(argv)

    def passes() -> dict:
        return {
            f"{role}, {n} thread{'s' * (n > 1)}": pass_times(path, args.passes, n)
            for role, path, n in (
                ("target", args.target, 1),
                ("target", args.target, 2),
                ("draft", args.draft, 1),
            )
        }

    title = "Decoder layers run fused against their own calls"
    return side_by_side_both_ways(args, title, "fused_projections", ARMS, MODES, passes)


if __name__ == "__main__":
    raise SystemExit(main())
