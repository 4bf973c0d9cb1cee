"""oneDNN-packed linear layers (``packed_linear``, the default on the CPU) against
torch's stock ones, side by side.

    python -m benchmarks.packed_linear [--repeats 2] [--clients 1 8 32] [--window 5]
        [--out results/packed-linear-<time>]

Parts:
- pass times: the demo target's and draft's forward through the ragged runtime
  (one thread) at several pass shapes (tokens x sessions), stock and packed
  alternating, the best of ``--passes`` each;
- two stacks that differ only in ``packed_linear`` (draft and target), sustained
  load (``benchmarks.sustained``'s rounds: N clients back to back, tokens
  streamed inside a window counted), plain decoding, adaptive and gamma 4 at T=1,
  the stacks' rounds interleaved, the order alternating; paired ratios.
Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from specdec.runtime import packed_linear
from specdec.runtime.loading import load_model
from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    machine_info,
    stacks_per_arm,
    torch_threads,
)
from .plain_runs import ratios, save_side_by_side, side_by_side_header
from .run import CONCURRENCY_MODES as MODES
from .run import sustained_round, sustained_side_by_side

SHAPES = ((1, 1), (5, 1), (1, 8), (5, 4), (5, 8), (1, 32), (64, 1))  # tokens x sessions
MAX_NEW = 64


def pass_ms(runner: RaggedRunner, tokens: int, sessions: int, passes: int) -> float:
    """Best time of one pass: ``sessions`` sessions (50 tokens cached) feeding ``tokens`` each."""
    v = runner.vocab_size
    kvs = [SessionKV() for _ in range(sessions)]
    runner.forward([Feed(kv, [t % v for t in range(10, 60)], 1) for kv in kvs])
    best = float("inf")
    for i in range(passes):
        feeds = [Feed(kv, [(i + j + 5) % v for j in range(tokens)], tokens) for kv in kvs]
        t = time.perf_counter()
        runner.forward(feeds)
        best = min(best, time.perf_counter() - t)
        for kv in kvs:
            kv.truncate(50)
    return best * 1e3


@torch.inference_mode()
def pass_times(path: str, passes: int, shapes=SHAPES) -> dict[str, dict[str, float]]:
    """{shape: {stock, packed}} ms for the model at ``path``, one thread."""
    with torch_threads(1):
        stock = RaggedRunner(load_model(path))
        model = load_model(path)
        packed_linear.pack_model(model, min_rows=1)
        packed = RaggedRunner(model)
        out = {}
        for tokens, sessions in shapes:
            a = b = float("inf")
            for _ in range(2):  # alternating, the best of each
                a = min(a, pass_ms(stock, tokens, sessions, passes))
                b = min(b, pass_ms(packed, tokens, sessions, passes))
            out[f"{tokens}x{sessions}"] = {"stock": a, "packed": b}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    ap.add_argument("--warm", type=float, default=1.5, help="seconds not counted per round")
    ap.add_argument("--window", type=float, default=5.0, help="seconds counted per round")
    ap.add_argument("--passes", type=int, default=40, help="passes per pass-time measurement")
    ap.add_argument("--out", default=f"results/packed-linear-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    passes = {role: pass_times(path, args.passes) for role, path in
              (("target", args.target), ("draft", args.draft))}  # fmt: skip
    rows = ["| model | tokens x sessions | stock ms | packed ms | packed / stock |"]
    rows.append("|---" * 5 + "|")
    for role, shapes in passes.items():
        for shape, t in shapes.items():
            rows.append(
                f"| {role} | {shape} | {t['stock']:.2f} | {t['packed']:.2f} | "
                f"{t['packed'] / t['stock']:.2f} |"
            )
    arms = {"stock": False, "packed": True}
    with stacks_per_arm(out, args.draft, args.target, "packed_linear", arms) as stacks:
        for stack in stacks.values():  # warm up
            sustained_round(stack.orchestrator_address, 4, MODES["adaptive"], PROMPTS, MAX_NEW,
                            1.0, 1.0, 99)  # fmt: skip
        rates = sustained_side_by_side(
            {arm: stack.orchestrator_address for arm, stack in stacks.items()}, args.clients,
            {m: MODES[m] for m in args.modes}, PROMPTS, MAX_NEW, args.repeats, args.warm,
            args.window,
        )  # fmt: skip
    info["load_average_end"] = list(os.getloadavg())
    lines = side_by_side_header(
        "oneDNN-packed linear layers against torch's stock ones",
        info,
        f"Pass times: best of {args.passes} passes, twice alternating, one thread. "
        f"Services: sustained rounds ({args.warm:g} s not counted, {args.window:g} s "
        f"counted), T=1, {args.repeats} interleaved rounds per configuration.",
    )
    lines += ["## Pass times", ""] + rows + ["", "## Through the services (tok/s)", ""]
    lines += [
        "| clients | mode | stock | packed | packed / stock (paired) |",
        "|---" * 5 + "|",
    ]
    med = {k: statistics.median(v) for k, v in rates.items()}
    for n in args.clients:
        for mode in args.modes:
            s, p = rates[f"{n} clients, {mode}, stock"], rates[f"{n} clients, {mode}, packed"]
            paired = ratios(p, s)
            lines.append(
                f"| {n} | {mode} | {statistics.median(s):.0f} | {statistics.median(p):.0f} | "
                f"{statistics.median(paired):.2f} ({', '.join(f'{x:.2f}' for x in paired)}) |"
            )
    save_side_by_side(out, lines, info, rates | {"pass_times": passes}, med)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
