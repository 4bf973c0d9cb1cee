"""The sampling arithmetic of one speculation step, without models or network.

Per step at gamma drafted tokens, on the CPU, one thread:

* **draft**: for each drafted position, q from the logits (``sparse_q``: the
  warped distribution cut and quantized as the wire carries it) and one draw
  from it; then the step's proposal packed for the wire (``pack_q``);
* **target**: the proposal unpacked and validated (``unpack_q``), the step's
  uniforms, and ``verify_draft`` over gamma + 1 rows of logits (p at each
  position, the residual draws and the bonus draw).

The logits are random (scaled normal; the timings do not depend on the values
beyond the listed support), for the demo pair's vocabulary (4,096) and a
151,936-token one. Each cell is the median over ``--steps`` steps after a
warm-up. This is the part of a step's overhead that the services' Python code
computes, as opposed to the forward passes and the transport.

    .venv/bin/python -m benchmarks.step_math [--steps 400] [--gamma 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch

from specdec.rng import generator, uniforms
from specdec.sampling import SamplingParams, draft_position, verify_draft
from specdec.wire import DEFAULT_Q_BITS, pack_q, unpack_q

VOCABS = (4096, 151_936)


def _median_us(f, steps: int) -> float:
    for i in range(max(5, steps // 10)):  # warm-up
        f(i)
    times = []
    for i in range(steps):
        t = time.perf_counter()
        f(i)
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def measure(
    vocab: int, gamma: int, temperature: float, steps: int, top_k: int = 256
) -> dict[str, float]:
    """Median microseconds per step of the draft's and the target's arithmetic."""
    params = SamplingParams(temperature=temperature)
    g = torch.Generator().manual_seed(vocab)
    pool = 8  # distinct logits, cycled
    draft_logits = [torch.randn(gamma, vocab, generator=g) * 4 for _ in range(pool)]
    target_logits = [torch.randn(gamma + 1, vocab, generator=g) * 4 for _ in range(pool)]

    def draft(i: int):  # what the draft service does per step (Drafter._draft)
        rng = None if params.greedy else generator(i)
        rows = draft_logits[i % pool]
        qs, tokens = [], []
        for j in range(gamma):
            x, q = draft_position(rows[j], params, top_k, 0.0, DEFAULT_Q_BITS, rng)
            tokens.append(x)
            qs.append(q)
        return tokens, qs, pack_q(qs)

    proposals = [draft(i) for i in range(pool)]

    def target(i: int):
        tokens, _, packed = proposals[i % pool]
        qs = unpack_q(packed, vocab, tokens)
        return verify_draft(target_logits[i % pool], tokens, qs, params, uniforms(i, gamma + 1))

    return {"draft_us": _median_us(draft, steps), "target_us": _median_us(target, steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--wire-top-k", type=int, nargs="+", default=[256], help="entries listed per q")
    ap.add_argument("--out", help="output folder (default results/step-math-<time>)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"results/step-math-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    rows = []
    print(f"load average {load[0]:.2f}; gamma {args.gamma}")
    print("| vocab | sampling | wire top-k | draft, us/step | target, us/step |")
    print("|---|---|---|---|---|")
    for vocab in VOCABS:
        for t in (0.0, 1.0):
            for k in args.wire_top_k if t else args.wire_top_k[:1]:  # greedy lists one token
                r = measure(vocab, args.gamma, t, args.steps, k)
                rows.append({"vocab": vocab, "temperature": t, "wire_top_k": k, **r})
                mode = "greedy" if t == 0 else f"T={t:g}"
                print(f"| {vocab:,} | {mode} | {k} | {r['draft_us']:.0f} | {r['target_us']:.0f} |")
    (out / "results.json").write_text(
        json.dumps({"load_average": load, "gamma": args.gamma, "rows": rows}, indent=1)
    )
    print(f"saved {out / 'results.json'}")


if __name__ == "__main__":
    main()
