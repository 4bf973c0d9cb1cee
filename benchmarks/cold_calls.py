"""What one library call costs right after a target pass, against the same call at once
again: a pass streams the target's weights through the caches and evicts the code and
data that the work around it then needs (docs/benchmarks.md, "After a forward pass
every library call is cold").

    python -m benchmarks.cold_calls [--target DIR] [--passes 40] [--out results/cold-calls-<time>]

One process, one torch thread. For each call, ``--passes`` times: a target pass over
5 tokens (a gamma-4 verify), then the call (cold), then the call again; medians in us.
Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from specdec import kernels
from specdec.rng import generator, uniforms
from specdec.sampling import (
    SamplingParams,
    SparseQ,
    draft_position,
    greedy_tokens,
    q_entries,
    sparse_q,
    verify_draft,
)
from specdec.wire import pack_q, unpack_q

from .common import DEFAULT_TARGET, machine_info
from .plain_runs import save_side_by_side, side_by_side_header


def calls(vocab: int) -> dict:
    """name -> f(logits [5, vocab]): the pieces of a greedy step's work, plain ones, and a
    sampled step's uniforms, judging and wire (T=1, 1,024 tokens listed, as the demo sends)."""
    greedy = SamplingParams(temperature=0.0)
    drafts = [1, min(300, vocab - 2), 3, vocab - 1]  # (300: an escaped id on the wire)
    points = [SparseQ.point(x, vocab) for x in drafts]
    packed = pack_q(points)
    sampled = SamplingParams(1.0)
    z = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 3
    qs = [sparse_q(z[i], sampled, 1024, 0.0) for i in range(4)]
    rng = generator(1)
    xs = [q.sample(rng) for q in qs]
    u = uniforms(2, 5)

    sampled_pb = pack_q(qs)

    def reference(f):  # f with the kernels off: the numpy and torch path
        def call(lg):
            kernels.ENABLED = False
            try:
                return f(lg)
            finally:
                kernels.ENABLED = True

        return call

    def judge(lg):
        return verify_draft(lg, xs, qs, sampled, u)

    def decode(lg):
        return unpack_q(sampled_pb, vocab, xs, params=sampled)

    def draft(lg):
        return draft_position(lg[0], sampled, 1024, 0.0, 16, rng)

    return {
        "nothing (the timer)": lambda lg: None,
        "a Python loop of 50 multiplications": lambda lg: sum(i * i for i in range(50)),
        "np.cumsum of 5 integers": lambda lg: np.cumsum(np.arange(5)),
        "torch.zeros(5)": lambda lg: torch.zeros(5, dtype=torch.float64),
        "logits.argmax(-1).tolist()": lambda lg: lg.argmax(-1).tolist(),
        "greedy_tokens(logits)": greedy_tokens,
        "q_entries of 4 points": lambda lg: q_entries(points),
        "pack_q of 4 points": lambda lg: pack_q(points),
        "unpack_q of 4 points": lambda lg: unpack_q(packed, vocab, drafts, params=greedy),
        "verify_draft, greedy, gamma 4": lambda lg: verify_draft(lg, drafts, points, greedy, None),
        "numpy's Generator(Philox(seed)).random(5)": lambda lg: np.random.Generator(
            np.random.Philox(key=2**63 + 5)
        ).random(5),
        "uniforms(seed, 5) (specdec.rng.Philox)": lambda lg: uniforms(2**63 + 5, 5),
        "verify_draft, T=1, gamma 4, numpy and torch": reference(judge),
        "verify_draft, T=1, gamma 4, compiled (specdec.kernels)": judge,
        "unpack_q, T=1, gamma 4, numpy": reference(decode),
        "unpack_q, T=1, gamma 4, compiled (specdec.kernels)": decode,
        "pack_q, T=1, gamma 4, numpy": reference(lambda lg: pack_q(qs)),
        "pack_q, T=1, gamma 4, compiled (specdec.kernels)": lambda lg: pack_q(qs),
        "draft_position, T=1, numpy": reference(draft),
        "draft_position, T=1, compiled (specdec.kernels)": draft,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--passes", type=int, default=40)
    ap.add_argument("--out", default=f"results/cold-calls-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    info = machine_info("cpu")
    model = AutoModelForCausalLM.from_pretrained(args.target).eval()
    vocab = model.config.vocab_size
    pieces = calls(vocab)
    kernels.warm()
    cold: dict[str, list[float]] = {name: [] for name in pieces}
    again: dict[str, list[float]] = {name: [] for name in pieces}
    with torch.no_grad():
        cache = model(torch.randint(0, vocab, (1, 64)), use_cache=True).past_key_values
        for _ in range(args.passes):
            for name, f in pieces.items():
                logits = model(torch.randint(0, vocab, (1, 5)), cache=cache).logits[0]
                cache.crop(-5)
                t0 = time.perf_counter()
                f(logits)
                t1 = time.perf_counter()
                f(logits)
                t2 = time.perf_counter()
                cold[name].append((t1 - t0) * 1e6)
                again[name].append((t2 - t1) * 1e6)
    info["load_average_end"] = list(os.getloadavg())
    lines = side_by_side_header(
        "A library call right after a target pass",
        info,
        f"Target {args.target}, one thread; {args.passes} passes of 5 tokens per call, each "
        "followed by the call (cold) and the call again; medians in microseconds.",
    )
    lines += ["| call | right after a pass | again |", "|---|---|---|"]
    summary = {}
    for name in pieces:
        c, a = statistics.median(cold[name]), statistics.median(again[name])
        lines.append(f"| {name} | {c:.0f} | {a:.0f} |")
        summary[name] = c
    save_side_by_side(out, lines, info, {"cold": cold, "again": again}, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
