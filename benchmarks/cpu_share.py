"""Where the CPU goes per generated token: each process's CPU time per token
streamed, how many cores the stack kept busy, and the tokens/s that CPU allows.

    python -m benchmarks.cpu_share [--clients 1 8] [--modes plain seq4 adaptive]
        [--rounds 3] [--temperature 1] [--out results/cpu-share-<time>]

One stack of the demo pair (draft, target and orchestrator, one torch thread
per service, as ``make bench``'s concurrency section runs them) on the shared
cores; adaptive requests may speculate at any load (the config default,
``adaptive_speculate_max_requests: 0``). For each client count and mode: a
warm-up round, then ``--rounds`` rounds of N clients x 2 requests x 64
tokens (``run.clients_round``), the modes' rounds interleaved. Each
process's CPU time (user + system, all its threads, from ``/proc/<pid>/stat``)
is read before and after every round:

* CPU ms per generated token, per process (``client`` is this process: the
  benchmark's gRPC clients);
* cores busy: the four processes' CPU seconds over the round's wall seconds;
* two ceilings from those costs: the target's one thread alone allows at most
  1000 / (its CPU ms per token) tokens/s, and the whole stack at most
  cores x 1000 / (every process's CPU ms per token), if nothing ever waited.

Issue 14 asks 8 clients for 4x one client's tokens/s; where 4x one client is
above the second ceiling, no scheduling of this work on these cores reaches it.
Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    finish,
    machine_info,
    rotated_rounds,
    start_services,
)
from .plain_runs import MAX_NEW, side_by_side_header
from .run import clients_round

ROLES = ("draft", "target", "orchestrator", "client")
MODES = {
    "plain": {"gamma": 0},
    "seq4": {"gamma": 4, "overlap": False},
    "adaptive": {"gamma": None},
}
REQUESTS = 2  # per client and round
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of every thread of process ``pid`` (of its thread
    ``tid`` alone, if given)."""
    with open(f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def one_round(address: str, pids: dict[str, int], n: int, fields: dict, r: int) -> dict:
    """n clients x REQUESTS requests: tokens/s, cores busy, CPU ms per token by process."""
    before = {role: cpu_seconds(pid) for role, pid in pids.items()}
    t0 = time.perf_counter()
    rate, _ = clients_round(address, n, fields, PROMPTS, REQUESTS, MAX_NEW, r)
    wall = time.perf_counter() - t0
    used = {role: cpu_seconds(pid) - before[role] for role, pid in pids.items()}
    tokens = rate * wall
    return {
        "tok_s": rate,
        "cores_busy": sum(used.values()) / wall,
        "cpu_ms_per_token": {role: 1e3 * s / tokens for role, s in used.items()},
    }


def summary(rounds: list[dict], cores: int) -> dict:
    """Medians over rounds, and the two ceilings the CPU costs imply."""
    per = {role: statistics.median(r["cpu_ms_per_token"][role] for r in rounds) for role in ROLES}
    total = sum(per.values())
    return {
        "tok_s": statistics.median(r["tok_s"] for r in rounds),
        "cores_busy": statistics.median(r["cores_busy"] for r in rounds),
        "cpu_ms_per_token": per,
        "total_cpu_ms_per_token": total,
        "target_ceiling_tok_s": 1e3 / per["target"] if per["target"] else None,
        "stack_ceiling_tok_s": cores * 1e3 / total if total else None,
    }


def report(result: dict) -> str:
    info = result["machine"] | {"load_average_end": result["load_average_end"]}
    lines = side_by_side_header(
        "CPU time per generated token, by process",
        info,
        f"T={result['temperature']:g}, {REQUESTS} requests x {MAX_NEW} tokens per client "
        f"and round, {result['rounds']} rounds after a warm-up, medians; one torch thread "
        "per service, shared cores.",
    )
    lines += [
        "| clients | mode | tok/s | cores busy | CPU ms/token: draft | target | orchestrator "
        "| client | all | ceiling: target thread | ceiling: stack |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, modes in result["runs"].items():
        for mode, s in modes.items():
            c = s["cpu_ms_per_token"]
            lines.append(
                f"| {n} | {mode} | {s['tok_s']:.1f} | {s['cores_busy']:.2f} | {c['draft']:.2f} "
                f"| {c['target']:.2f} | {c['orchestrator']:.2f} | {c['client']:.2f} "
                f"| {s['total_cpu_ms_per_token']:.2f} | {s['target_ceiling_tok_s']:.0f} "
                f"| {s['stack_ceiling_tok_s']:.0f} |"
            )
    counts = list(result["runs"])
    lo = counts[0]
    if len(counts) > 1:
        lines += ["", f"Each client count against {lo}; 4x {lo}'s tokens/s against the ceiling:"]
    for hi in counts[1:]:
        for mode, many in result["runs"][hi].items():
            one = result["runs"][lo][mode]["tok_s"]
            lines.append(
                f"- {hi} clients, {mode}: {many['tok_s'] / one:.2f}x; 4x = {4 * one:.0f} tok/s, "
                f"ceiling {many['stack_ceiling_tok_s']:.0f}"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", default=f"results/cpu-share-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "machine": machine_info("cpu"),
        "temperature": args.temperature,
        "rounds": args.rounds,
        "runs": {},
    }
    cores = os.cpu_count() or 1
    stack = start_services(out / "stack", args.draft, args.target, threads=1, draft_threads=1)
    try:
        pids = {role: stack.proc(role).pid for role in ROLES[:3]} | {"client": os.getpid()}
        address = stack.orchestrator_address
        for n in args.clients:
            fields = {m: MODES[m] | {"temperature": args.temperature} for m in args.modes}
            rounds: dict[str, list[dict]] = {m: [] for m in args.modes}
            for m in args.modes:  # warm-up
                clients_round(address, n, fields[m], PROMPTS, 1, MAX_NEW, 99)
            for r, m in rotated_rounds(args.modes, args.rounds):
                rounds[m].append(one_round(address, pids, n, fields[m], r))
            result["runs"][str(n)] = {m: summary(rounds[m], cores) for m in args.modes}
            result.setdefault("rounds_raw", {})[str(n)] = rounds
            print(f"{n} clients done", flush=True)
    finally:
        stack.stop()
    return finish(out, result, report)


if __name__ == "__main__":
    raise SystemExit(main())
