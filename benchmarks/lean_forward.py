"""Passes that call the decoder layers directly (``lean_forward``, the default for
the Llama family) against the model's wrapped forward, side by side (both with
``fused_projections`` off: ``benchmarks.fused_projections`` measures that).

    python -m benchmarks.lean_forward [--repeats 6] [--clients 8] [--window 5]
        [--out results/lean-forward-<time>]

Parts:
- pass times: the demo target's and draft's passes through the ragged runtime
  (one thread, packed as a service packs them), one runner switching between
  the two ways pass by pass; the median and the best of ``--passes`` each;
- two stacks that differ only in ``lean_forward`` (draft and target): one client,
  8 prompts x 64 tokens per round, plain decoding, gamma 4 greedy and at T=1,
  and adaptive at T=1, the stacks' rounds interleaved (``benchmarks.run.measure``),
  with each mode's time per step split into forwards and the rest; then
  sustained rounds of ``--clients`` clients (``benchmarks.sustained``'s rounds),
  the order alternating. Paired ratios.
Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.runtime import packed_linear
from specdec.runtime.loading import load_model
from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    Client,
    machine_info,
    stacks_per_arm,
    torch_threads,
)
from .plain_runs import ratios, save_side_by_side, side_by_side_header
from .run import CONCURRENCY_MODES, measure, sustained_side_by_side

SHAPES = ((1, 1), (5, 1), (5, 8), (1, 32))  # tokens x sessions
MODES = {
    "plain@0": {"temperature": 0.0, "gamma": 0},
    "seq4@0": {"temperature": 0.0, "gamma": 4, "overlap": False},
    "seq4@1": {"temperature": 1.0, "gamma": 4, "overlap": False},
    "adaptive@1": {"temperature": 1.0, "gamma": None, "seed": None},
}
ARMS = ("wrapped", "lean")
SUSTAINED = ("plain", "seq4", "adaptive")  # CONCURRENCY_MODES, at T=1
MAX_NEW = 64


@torch.inference_mode()
def alternating_passes(
    runner: RaggedRunner, arms: dict[str, Callable[[], None]], passes: int
) -> dict[str, dict[str, float]]:
    """{shape: {arm, arm_best, ...}} ms: for each of ``SHAPES``, ``passes`` passes per
    arm, the arms alternating pass by pass (``arms[arm]()`` switches ``runner`` to it)."""
    out = {}
    for tokens, sessions in SHAPES:
        v = runner.vocab_size
        kvs = [SessionKV() for _ in range(sessions)]
        runner.forward([Feed(kv, [t % v for t in range(10, 60)], 1) for kv in kvs])
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        names = list(arms)
        for i in range(passes):
            fed = [(i + j + 5) % v for j in range(tokens)]
            for arm in names if i % 2 else names[::-1]:
                arms[arm]()
                feeds = [Feed(kv, fed, tokens) for kv in kvs]
                t = time.perf_counter()
                runner.forward(feeds)
                times[arm].append(1e3 * (time.perf_counter() - t))
                for kv in kvs:
                    kv.truncate(50)
        cell = {arm: statistics.median(ts) for arm, ts in times.items()}
        cell |= {f"{arm}_best": min(ts) for arm, ts in times.items()}
        out[f"{tokens}x{sessions}"] = cell
    return out


def pass_times(path: str, passes: int) -> dict[str, dict[str, float]]:
    """{shape: {wrapped, lean, wrapped_best, lean_best}} ms, one thread, one runner."""
    with torch_threads(1):
        model = load_model(path)
        runner = RaggedRunner(model, fused=False)  # (fused: benchmarks.fused_projections)
        if not runner.lean:
            raise SystemExit(f"{path}: its passes cannot call the layers directly")
        packed_linear.pack_model(model, runner, 64, 0)

        def way(lean: bool) -> Callable[[], None]:
            return lambda: setattr(runner, "lean", lean)

        return alternating_passes(runner, {arm: way(arm == "lean") for arm in ARMS}, passes)


def side_by_side_args(doc: str, name: str, repeats: int) -> argparse.ArgumentParser:
    """The options of a benchmark of one model-service setting on and off."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--clients", type=int, nargs="*", default=[8])
    ap.add_argument("--warm", type=float, default=1.5, help="seconds not counted per round")
    ap.add_argument("--window", type=float, default=5.0, help="seconds counted per round")
    ap.add_argument("--passes", type=int, default=200, help="passes per arm and shape")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW, help="per request")
    ap.add_argument("--out", default=f"results/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    return ap


def pass_rows(passes: dict[str, dict[str, dict[str, float]]], arms: tuple[str, str]) -> list[str]:
    """The pass-time table: {model: {shape: times}}, ``arms`` (before, after)."""
    a, b = arms
    rows = [f"| model | tokens x sessions | {a} ms (best) | {b} ms (best) | {b} / {a} |"]
    rows.append("|---" * 5 + "|")
    for model, shapes in passes.items():
        for shape, t in shapes.items():
            rows.append(
                f"| {model} | {shape} | {t[a]:.3f} ({t[f'{a}_best']:.3f}) | "
                f"{t[b]:.3f} ({t[f'{b}_best']:.3f}) | {t[b] / t[a]:.2f} |"
            )
    return rows


def step_cell(row: dict) -> str:
    """A mode's ms per step: all (draft forwards + target forwards, the rest)."""
    ms = row["ms_per_step"]
    return (
        f"{ms['step']:.2f} ({ms['draft_forward']:.2f} + {ms['target_forward']:.2f}, "
        f"{ms['overhead']:.2f})"
    )


def paired_cell(before: list[float], after: list[float]) -> str:
    """The median of the per-round ratios after / before, and the ratios."""
    paired = ratios(after, before)
    return f"{statistics.median(paired):.3f} ({', '.join(f'{x:.2f}' for x in paired)})"


def sustained_rows(rates: dict, clients: list[int], arms: tuple[str, str]) -> list[str]:
    """The sustained-load table of ``sustained_side_by_side``'s rates."""
    a, b = arms
    rows = [f"| clients | mode | {a} | {b} | {b} / {a} (paired) |", "|---" * 5 + "|"]
    for n in clients:
        for mode in SUSTAINED:
            x, y = rates[f"{n} clients, {mode}, {a}"], rates[f"{n} clients, {mode}, {b}"]
            rows.append(
                f"| {n} | {mode} | {statistics.median(x):.0f} | {statistics.median(y):.0f} | "
                f"{paired_cell(x, y)} |"
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = side_by_side_args(__doc__, "lean-forward", 6).parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    passes = {role: pass_times(path, args.passes) for role, path in
              (("target", args.target), ("draft", args.draft))}  # fmt: skip
    rows = pass_rows(passes, ARMS)
    # Unfused on both sides: this compares the direct calls alone.
    arms = {arm: {"lean_forward": arm == "lean", "fused_projections": False} for arm in ARMS}
    with stacks_per_arm(out, args.draft, args.target, "lean_forward", arms) as stacks:
        clients = {arm: Client(stacks[arm].orchestrator_address) for arm in ARMS}
        via = {f"{arm}:{m}": clients[arm] for arm in ARMS for m in MODES}
        configs = {f"{arm}:{m}": fields for arm in ARMS for m, fields in MODES.items()}
        one = measure(via, configs, PROMPTS[:8], args.max_new_tokens, args.repeats)
        rates = sustained_side_by_side(
            {arm: stack.orchestrator_address for arm, stack in stacks.items()}, args.clients,
            {m: CONCURRENCY_MODES[m] for m in SUSTAINED}, PROMPTS, args.max_new_tokens,
            args.repeats, args.warm, args.window,
        )  # fmt: skip
    info["load_average_end"] = list(os.getloadavg())
    lines = side_by_side_header(
        "Passes calling the decoder layers directly against the wrapped forward",
        info,
        f"Pass times: {args.passes} passes per arm, alternating, one thread. Services: "
        f"one client, {args.repeats} interleaved rounds of 8 prompts x {args.max_new_tokens} "
        f"tokens per mode; sustained rounds ({args.warm:g} s not counted, {args.window:g} s "
        f"counted), T=1, {args.repeats} per configuration.",
    )
    lines += ["## Pass times (median ms)", ""] + rows
    lines += ["", "## One client (tok/s; ms per step: forwards of draft + target, the rest)", ""]
    lines += [
        "| mode | wrapped | lean | lean / wrapped (paired) | wrapped step | lean step |",
        "|---" * 6 + "|",
    ]
    for m in MODES:
        a, b = one[f"wrapped:{m}"], one[f"lean:{m}"]
        lines.append(
            f"| {m} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | "
            f"{paired_cell(a['tok_s_runs'], b['tok_s_runs'])} | {step_cell(a)} | {step_cell(b)} |"
        )
    lines += ["", "## Sustained load (tok/s)", ""] + sustained_rows(rates, args.clients, ARMS)
    med = {k: statistics.median(v) for k, v in rates.items()}
    results = rates | {"pass_times": passes, "one_client": one}
    save_side_by_side(out, lines, info, results, med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
