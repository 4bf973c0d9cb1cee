"""The sampling arithmetic of one speculation step, without models or network.

Per step at gamma drafted tokens, on the CPU, one thread:

* **draft**: for each drafted position, q from the logits (``sparse_q``: the
  warped distribution cut and quantized as the wire carries it) and one draw
  from it; then the step's proposal packed for the wire (``pack_q``);
* **target**: the proposal unpacked and validated (``unpack_q``), the step's
  uniforms, and ``verify_draft`` over gamma + 1 rows of logits (p at each
  position, the residual draws and the bonus draw).

The logits are random (scaled normal; the timings depend little on the values
beyond the listed support), for the demo pair's vocabulary (4,096), Llama 2's
and Mistral's (32,000) and Qwen's (151,936). Each cell is the median over
``--steps`` steps after a warm-up. This is the part of a step's overhead that
the services' Python code computes, as opposed to the forward passes and the
transport.

    .venv/bin/python -m benchmarks.step_math [--steps 400] [--gamma 4] [--out DIR]
        [--against REV]   # also specdec/sampling.py as of REV, each step's pair back to back
        [--top-k K] [--top-p P]   # the requests' warping at T=1 (default: none)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
import types
from pathlib import Path

import torch

from specdec.rng import generator, uniforms
from specdec.runtime.memory import keep_freed
from specdec.sampling import SamplingParams, draft_position, verify_draft
from specdec.wire import DEFAULT_Q_BITS, pack_q, unpack_q

from .common import module_at

VOCABS = (4096, 32_000, 151_936)


def _median_us(f, steps: int) -> float:
    for i in range(max(5, steps // 10)):  # warm-up
        f(i)
    times = []
    for i in range(steps):
        t = time.perf_counter()
        f(i)
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def _paired_us(f, g, steps: int) -> tuple[float, float]:
    """Median microseconds of f and of g, run back to back at every step, in
    alternating order (so that neither always runs on the other's warm caches)."""
    for i in range(max(5, steps // 10)):  # warm-up
        f(i)
        g(i)
    times: tuple[list, list] = ([], [])
    for i in range(steps):
        order = ((0, f), (1, g)) if i % 2 else ((1, g), (0, f))
        for slot, h in order:
            t = time.perf_counter()
            h(i)
            times[slot].append(time.perf_counter() - t)
    return 1e6 * statistics.median(times[0]), 1e6 * statistics.median(times[1])


def sampling_at(rev: str) -> types.ModuleType:
    """``specdec.sampling`` as it was at git revision ``rev`` (``--against``)."""
    return module_at(rev, "specdec/sampling.py")


def measure(
    vocab: int,
    gamma: int,
    params: SamplingParams,
    steps: int,
    top_k: int = 256,
    before: types.ModuleType | None = None,
) -> dict[str, float]:
    """Median microseconds per step of the draft's and the target's arithmetic for
    requests with ``params``, listing ``top_k`` tokens of q; with ``before``
    (``sampling_at``), also that module's, measured in pairs."""
    g = torch.Generator().manual_seed(vocab)
    pool = 8  # distinct logits, cycled
    draft_logits = [torch.randn(gamma, vocab, generator=g) * 4 for _ in range(pool)]
    target_logits = [torch.randn(gamma + 1, vocab, generator=g) * 4 for _ in range(pool)]

    def drafter(position):
        def draft(i: int):  # what the draft service does per step (Drafter._draft)
            rng = None if params.greedy else generator(i)
            rows = draft_logits[i % pool]
            qs, tokens = [], []
            for j in range(gamma):
                x, q = position(rows[j], params, top_k, 0.0, DEFAULT_Q_BITS, rng)
                tokens.append(x)
                qs.append(q)
            return tokens, qs, pack_q(qs)

        return draft

    draft = drafter(draft_position)
    proposals = [draft(i) for i in range(pool)]

    def verifier(verify):
        def target(i: int):
            tokens, _, packed = proposals[i % pool]
            qs = unpack_q(packed, vocab, tokens)
            return verify(target_logits[i % pool], tokens, qs, params, uniforms(i, gamma + 1))

        return target

    target = verifier(verify_draft)
    if before is None:
        return {"draft_us": _median_us(draft, steps), "target_us": _median_us(target, steps)}
    old_draft, new_draft = _paired_us(drafter(before.draft_position), draft, steps)
    old_target, new_target = _paired_us(verifier(before.verify_draft), target, steps)
    return {
        "draft_us": new_draft,
        "target_us": new_target,
        "draft_us_before": old_draft,
        "target_us_before": old_target,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--wire-top-k", type=int, nargs="+", default=[256], help="entries listed per q")
    ap.add_argument("--out", help="output folder (default results/step-math-<time>)")
    ap.add_argument(
        "--against",
        metavar="REV",
        help="also time specdec/sampling.py as of this git revision, in pairs with today's",
    )
    ap.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    ap.add_argument(
        "--keep-freed-mb",
        type=int,
        default=0,
        help="glibc malloc as the services set it (their keep_freed_mb); 0: glibc's defaults",
    )
    ap.add_argument("--top-k", type=int, default=0, help="the requests' top-k at T=1 (0: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="the requests' top-p at T=1 (1: off)")
    args = ap.parse_args()
    keep_freed(args.keep_freed_mb)
    before = sampling_at(args.against) if args.against else None
    torch.set_num_threads(1)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"results/step-math-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    rows = []
    print(f"load average {load[0]:.2f}; gamma {args.gamma}; top-k {args.top_k}, top-p {args.top_p}")
    if before is None:
        print("| vocab | sampling | wire top-k | draft, us/step | target, us/step |")
    else:
        print(f"| vocab | sampling | wire top-k | draft, us/step: {args.against} / now / ratio "
              f"| target, us/step: {args.against} / now / ratio |")  # fmt: skip
    print("|---|---|---|---|---|")
    for vocab in args.vocabs:
        for t in (0.0, 1.0):
            for k in args.wire_top_k if t else args.wire_top_k[:1]:  # greedy lists one token
                params = SamplingParams(t, args.top_k, args.top_p)
                r = measure(vocab, args.gamma, params, args.steps, k, before)
                rows.append({"vocab": vocab, "temperature": t, "wire_top_k": k, **r})
                mode = "greedy" if t == 0 else f"T={t:g}"
                cells = [f"{r[f'{part}_us']:.0f}" for part in ("draft", "target")]
                if before is not None:
                    cells = [
                        f"{r[f'{part}_us_before']:.0f} / {r[f'{part}_us']:.0f} / "
                        f"{r[f'{part}_us'] / r[f'{part}_us_before']:.2f}"
                        for part in ("draft", "target")
                    ]
                print(f"| {vocab:,} | {mode} | {k} | {cells[0]} | {cells[1]} |")
    (out / "results.json").write_text(
        json.dumps(
            {
                "load_average": load,
                "gamma": args.gamma,
                "against": args.against,
                "keep_freed_mb": args.keep_freed_mb,
                "top_k": args.top_k,
                "top_p": args.top_p,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"saved {out / 'results.json'}")


if __name__ == "__main__":
    main()
