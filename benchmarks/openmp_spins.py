"""How long GNU OpenMP's idle workers spin (``GOMP_SPINCOUNT``) in the target
service, side by side: libgomp's default against other counts.

    python -m benchmarks.openmp_spins [--spins 3000000] [--repeats 4] [--clients 2]
        [--out results/openmp-spins-<time>]

After a parallel region, libgomp (torch's CPU builds) keeps its idle worker
threads spinning ``GOMP_SPINCOUNT`` times (300,000 by default) before they
sleep. With ``plain_torch_threads`` 2 the target's passes during which no draft
works run on 2 threads: a short spin frees the second core sooner after such a
pass, for the draft; but a worker that has gone to sleep (between two parallel
regions of one pass, or between a lone request's verifies while its draft
drafts) must be woken for the next, which on a virtual machine can cost more
than the region. Such a target sets 3,000,000 for itself
(``specdec.runtime.openmp``); the default's arm sets libgomp's default, 300,000,
explicitly, which it then keeps.

One stack of the demo pair per spin count (the variable set in the services'
environment; one torch thread per service, the target's plain passes and idle
verifies on 2, ``adaptive_speculate_max_requests`` 2, as configs/default.yaml
sets them), and the target in this process with 2 threads (``generate()``):

- what a spin costs: the CPU milliseconds a process uses in the 50 ms after one
  2-thread matrix product, for each spin count (a fresh interpreter each);
- one client, ``--repeats`` rounds: ``generate()``, then plain decoding, sequential
  gamma 4 and adaptive through every stack (their order alternating), greedy and
  at T=1, 8 prompts x 64 tokens each (``benchmarks.plain_threads``' rounds);
- sustained rounds of ``--clients`` clients, T=1, plain and adaptive.

Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from .plain_runs import paired, paired_cells, side_by_side_header
from .plain_threads import MODES, SUSTAINED, TEMPERATURES, arm_options, run_arms, save_arms

DEFAULT = "libgomp default"  # the arm with GOMP_SPINCOUNT at libgomp's own default
LIBGOMP_DEFAULT = "300000"  # (set: unset, the target would set its own)
# The CPU a process uses in the 50 ms after one 2-thread product (median of 40).
_SPIN_PROBE = """
import resource, time, torch
torch.set_num_threads(2)
a = torch.randn(256, 256)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
ms = []
for _ in range(40):
    a @ a
    c0 = cpu(); time.sleep(0.05); ms.append((cpu() - c0) * 1e3)
print(sorted(ms)[20])
"""


def arm_name(spins: str | None) -> str:
    return DEFAULT if spins is None else f"{int(spins):,} spins"


@contextlib.contextmanager
def spin_env(spins: str | None) -> Iterator[None]:
    """GOMP_SPINCOUNT as ``spins`` (None: libgomp's default) for the processes started
    meanwhile."""
    before = os.environ.pop("GOMP_SPINCOUNT", None)
    os.environ["GOMP_SPINCOUNT"] = LIBGOMP_DEFAULT if spins is None else spins
    try:
        yield
    finally:
        os.environ.pop("GOMP_SPINCOUNT", None)
        if before is not None:
            os.environ["GOMP_SPINCOUNT"] = before


def idle_spin_ms(spins: str | None) -> float:
    """CPU ms a fresh interpreter uses in the 50 ms after a 2-thread product."""
    with spin_env(spins):
        out = subprocess.run(
            [sys.executable, "-c", _SPIN_PROBE], capture_output=True, text=True, check=True
        )
    return float(out.stdout.split()[-1])


def report(info: dict, args, spin_ms: dict, one: dict, sustained: dict) -> list[str]:
    arms = list(spin_ms)
    lines = side_by_side_header(
        "OpenMP's idle spin in the target",
        info,
        f"One stack per GOMP_SPINCOUNT ({', '.join(arms)}), one torch thread per service, "
        f"the target's plain passes and idle verifies on 2; generate() in this process on "
        f"2 threads. One client: {args.repeats} rounds of 8 prompts x {args.max_new_tokens} "
        f"tokens per configuration, the stacks' order alternating; sustained rounds "
        f"({args.warm:g} s not counted, {args.window:g} s counted), T=1.",
    )
    lines += ["## What a spin costs", ""]
    lines += ["| arm | CPU ms in the 50 ms after a 2-thread product (median) |", "|---|---|"]
    lines += [f"| {arm} | {ms:.2f} |" for arm, ms in spin_ms.items()]
    lines += ["", f"## One client (tok/s, median; paired ratios to {DEFAULT!r})", ""]
    lines += ["| mode | T | arm | tok/s | / default | rounds | / generate() |", "|---" * 7 + "|"]
    for t in TEMPERATURES:
        hf = one[f"generate()@{t:g}"]
        for mode in MODES:
            base = one[f"{DEFAULT}:{mode}@{t:g}"]
            for arm in arms:
                v = one[f"{arm}:{mode}@{t:g}"]
                lines.append(
                    f"| {mode} | {t:g} | {arm} | {statistics.median(v):.1f} | "
                    f"{paired_cells(v, base)} | {paired(v, hf):.3f} |"
                )
    if sustained:
        lines += ["", "## Sustained clients, T=1 (tok/s, median; paired ratios)", ""]
        lines += ["| clients | mode | arm | tok/s | / default | rounds |", "|---" * 6 + "|"]
        for n in args.clients:
            for mode in SUSTAINED:
                base = sustained[f"{n} clients, {mode}, {DEFAULT}"]
                for arm in arms:
                    v = sustained[f"{n} clients, {mode}, {arm}"]
                    lines.append(
                        f"| {n} | {mode} | {arm} | {statistics.median(v):.0f} | "
                        f"{paired_cells(v, base)} |"
                    )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arm_options(ap, 4, [2], "openmp-spins")
    ap.add_argument("--spins", nargs="*", default=["3000000"], help="counts beside the default")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spins_of = {arm_name(s): s for s in [None, *args.spins]}
    spin_ms = {arm: idle_spin_ms(s) for arm, s in spins_of.items()}
    print("idle spin, CPU ms:", spin_ms, flush=True)
    arms = {arm: {"plain_threads": 2} for arm in spins_of}
    info, one, sustained = run_arms(args, arms, out, lambda arm: spin_env(spins_of[arm]))
    lines = report(info, args, spin_ms, one, sustained)
    save_arms(out, lines, info, one, sustained, idle_spin_ms=spin_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
