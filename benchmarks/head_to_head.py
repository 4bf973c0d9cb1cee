"""Issue 15's and issue 10's comparisons with transformers, round by round: the
services and ``generate()`` measured in the same rounds, so that a VM whose
speed drifts between ``make bench``'s sections cannot decide a ratio.

    python -m benchmarks.head_to_head [--parts shared pinned] [--rounds 5]
        [--ks 3 4 5 6] [--gammas 2 3 4 5] [--temperatures 0 1] [--one-process]
        [--out results/head-to-head-<time>]

One stack of the demo pair (one torch thread per service) and the same two
models in this process. ``shared``: the services on both cores, transformers
with 2 threads on both (issue 15): ``generate()`` plain, assisted with a fixed
k (``--ks``, no confidence threshold), and through the services plain
decoding (gamma 0), sequential speculation at ``--gammas`` and adaptive.
``pinned`` (separate machines, as ``make bench`` pins them: the draft with the
orchestrator and this client at niceness 10 on one core, the target on the
other): assisted generation with 1 thread on the target's core (what a user
with only the target's machine gets) against sequential and overlapped
speculation at ``--gammas`` (issue 10). Stock transformers, as a user runs it.

Every configuration runs the prompts (8 x 64 tokens) once to warm up, then
``--rounds`` rounds of all of a part's configurations, the order rotating; a
rate is tokens over the seconds of the prompts' calls. Each criterion is the
median of its per-round ratios: plain / ``generate()`` in the same round;
"best" / "best" as ``benchmarks.report.held_out_best`` takes it (each round's
pick is the configuration fastest over the other rounds, so the winner's
curse does not flatter either side); overlapped / sequential at the same
gamma, at overlapped's held-out pick. Issue 15's orchestration overhead (a
step's wall time minus its forward passes, from the responses' stats) is taken
round by round from the shared part's sequential gamma 4. ``--one-process`` adds to the shared part
an orchestrator with both models in its process (``orchestrator.local_models``,
the target's torch threads on both cores), started beside the stack and idle
while the other configurations run: its plain, sequential and adaptive requests
(``one_*``) against the same ``generate()`` and assisted rates, and its best
gamma against the three services' in the same rounds. Prints a table; writes
results.json and results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import analyze as analyze_mod
from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    Client,
    finish,
    machine_info,
    start_services,
)
from .plain_runs import MAX_NEW, WARM_UP, interleaved, ratios, side_by_side_header
from .report import held_out_best, held_out_picks
from .run import (
    TARGET_CORE,
    _run_prompts,
    assistant_k,
    hf_generate,
    overhead_ms,
    pin_stack,
    torch_on,
    unpin_stack,
)


class Transformers:
    """The pair in this process: plain and assisted ``generate()``, per round."""

    def __init__(self, pair, prompts: list[str], max_new_tokens: int) -> None:
        """``pair``: (tokenizer, draft, target), as ``analyze.load_pair`` loads them."""
        tok, self.draft, self.target = pair
        self.ids = [tok(p, return_tensors="pt")["input_ids"] for p in prompts]
        self.max_new_tokens = max_new_tokens

    def rate(self, k: int | None, t: float, r: int, threads: int, cores: set[int] | None) -> float:
        """tok/s of the prompts with assistant k (None: plain), ``threads`` torch
        threads on ``cores`` (None: every core)."""
        every = set(range(os.cpu_count() or 1))
        with torch_on(threads, cores or every), assistant_k(self.draft, k):
            tokens = secs = 0.0
            for j, x in enumerate(self.ids):
                n, dt = hf_generate(
                    self.target, x, self.max_new_tokens, t, 1000 * r + j, self.draft if k else None
                )
                tokens, secs = tokens + n, secs + dt
        return tokens / secs


@dataclass
class Choices:
    """What a head-to-head run compares."""

    prompts: list[str]
    max_new_tokens: int = MAX_NEW
    rounds: int = 5
    ks: list[int] = field(default_factory=lambda: [3, 4, 5, 6])
    gammas: list[int] = field(default_factory=lambda: [2, 3, 4, 5])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])


def services_rate(
    client: Client, fields: dict, r: int, c: Choices, steps: list[float] | None = None
) -> float:
    """tok/s of the prompts through the services (tokens over the calls' seconds).
    ``steps``: where to append the round's orchestration overhead (``overhead_ms``);
    not the warm-up's (round 99, ``plain_runs.interleaved``)."""
    total = _run_prompts(client, c.prompts, c.max_new_tokens, fields, r)
    if steps is not None and r != WARM_UP:
        steps.append(overhead_ms(total))
    return total["tokens"] / total["wall_s"]


def overhead_gamma(gammas: list[int]) -> int:
    """The gamma issue 15's overhead is taken at: 4, or the largest measured below it
    (the quick runs measure fewer)."""
    return 4 if 4 in gammas else max(gammas)


def configs_for(
    part: str,
    hf: Transformers,
    client: Client,
    c: Choices,
    one: Client | None = None,
    overheads: dict[str, list[float]] | None = None,
) -> dict:
    """The part's configurations: name -> (round -> tok/s). ``one``: an orchestrator
    with both models in its process (``orchestrator.local_models``), whose plain,
    sequential and adaptive requests join the shared part as ``one_*``.
    ``overheads``: filled, for the shared part's sequential configurations at
    ``overhead_gamma``, with their overhead round by round (``overhead_ms``)."""
    g_over = overhead_gamma(c.gammas)

    def svc_rate(f: dict, to: Client = client, name: str | None = None):
        steps = None
        if overheads is not None and name is not None:
            steps = overheads.setdefault(name, [])
        return lambda r: services_rate(to, f, r, c, steps)

    # transformers: both cores with 2 threads, or the target's core with 1
    cores, threads = (None, 2) if part == "shared" else ({TARGET_CORE}, 1)
    out = {}
    for t in c.temperatures:
        at = f"@{t:g}"
        if part == "shared":
            out["generate" + at] = lambda r, t=t: hf.rate(None, t, r, 2, None)
        for k in c.ks:
            out[f"assisted{k}{at}"] = lambda r, k=k, t=t: hf.rate(k, t, r, threads, cores)
        svc = {"temperature": t}
        if part == "shared":
            out["plain" + at] = svc_rate(svc | {"gamma": 0})
            out["adaptive" + at] = svc_rate(svc | {"gamma": None, "seed": None})
        for g in c.gammas:
            name = f"seq{g}{at}"
            watch = name if part == "shared" and g == g_over else None
            out[name] = svc_rate(svc | {"gamma": g, "overlap": False}, name=watch)
            if part == "pinned":
                out[f"ovl{g}{at}"] = svc_rate(svc | {"gamma": g, "overlap": True})
        if part == "shared" and one is not None:
            out["one_plain" + at] = svc_rate(svc | {"gamma": 0}, one)
            out["one_adaptive" + at] = svc_rate(svc | {"gamma": None, "seed": None}, one)
            for g in c.gammas:
                name = f"one_seq{g}{at}"
                watch = name if g == g_over else None
                out[name] = svc_rate(svc | {"gamma": g, "overlap": False}, one, watch)
    return out


def family(rates: dict[str, list[float]], prefix: str, at: str) -> dict[str, list[float]]:
    return {k: v for k, v in rates.items() if k.startswith(prefix) and k.endswith(at)}


def held_out_series(fam: dict[str, list[float]]) -> tuple[list[float], list[str]]:
    """Round by round, the rate of the configuration fastest over the other rounds
    (``report.held_out_picks``), and those picks."""
    picks = held_out_picks(fam)
    return [fam[p][i] for i, p in enumerate(picks)], picks


def criteria(
    rates: dict[str, list[float]],
    part: str,
    temperatures,
    overheads: dict[str, list[float]] | None = None,
) -> list[dict]:
    """The part's criteria: name, goal, the median of the per-round ratios, the ratios.
    ``overheads``: the shared part's overhead in ms a step by round (``configs_for``),
    for issue 15's goal of at most 1 ms (lower is better)."""
    rows = []
    overheads = overheads or {}
    for t in temperatures:
        at = f"@{t:g}"
        label = "greedy" if t == 0 else f"T={t:g}"
        assisted = family(rates, "assisted", at)
        if part == "shared":
            seq = _speed_rows(rows, rates, at, label, assisted, "", SERVICES_ROWS)
            if "one_plain" + at in rates:  # (issue 15's goals, for a user with one machine)
                one = _speed_rows(rows, rates, at, label, assisted, "one_", ONE_PROCESS_ROWS)
                rows.append(_row(f"one process / three services, best gamma each, {label}",
                                 None, ratios(one, seq)))  # fmt: skip
            for prefix, who in (("", "15"), ("one_", "15, one process")):
                for name, ms in overheads.items():
                    if name.startswith(prefix + "seq") and name.endswith(at) and ms:
                        g = name[len(prefix) + 3 : -len(at)]
                        rows.append(_row(f"{who}: overhead at gamma {g}, ms a step, {label}",
                                         1.0, ms, higher=False))  # fmt: skip
        else:
            ovl_fam = family(rates, "ovl", at)
            ovl, picks = held_out_series(ovl_fam)
            best = held_out_best(ovl, assisted)
            rows.append(_row(f"10: overlapped best / assisted best k on the target's core, "
                             f"{label}", 1.3, best["ratios"], picks))  # fmt: skip
            same = [ovl[i] / rates[p.replace("ovl", "seq")][i] for i, p in enumerate(picks)]
            rows.append(_row(f"10: overlapped / sequential at the same gamma, {label}", 1.15,
                             same, picks))  # fmt: skip
    return rows


# The names of _speed_rows' three rows, for the three services and for one process.
SERVICES_ROWS = (
    "15: plain / generate()",
    "15: specdec best gamma / assisted best k",
    "adaptive / assisted best k",
)
ONE_PROCESS_ROWS = (
    "15, one process: plain / generate()",
    "15, one process: best gamma / assisted best k",
    "one process: adaptive / assisted best k",
)


def _speed_rows(
    rows: list, rates, at: str, label: str, assisted: dict, prefix: str, names
) -> list[float]:
    """Issue 15's ratios of one way of serving (its configurations named ``prefix``
    plain, seq<g>, adaptive), appended to ``rows``: plain / ``generate()``, its best
    gamma and adaptive / assisted generation at its best k (``assisted``: that
    family's rates). Returns its best gamma's rate, round by round."""
    seq, picks = held_out_series(family(rates, prefix + "seq", at))
    plain = ratios(rates[prefix + "plain" + at], rates["generate" + at])
    rows.append(_row(f"{names[0]}, {label}", 0.95, plain))
    rows.append(_row(f"{names[1]}, {label}", 1.0, held_out_best(seq, assisted)["ratios"], picks))
    ada = held_out_best(rates[prefix + "adaptive" + at], assisted)
    rows.append(_row(f"{names[2]}, {label}", None, ada["ratios"]))
    return seq


def _row(
    name: str, goal: float | None, ratios: list[float], picks=None, higher: bool = True
) -> dict:
    """A criterion: the median of its per-round values (ratios, or ms where
    ``higher`` is False: the goal is then an upper bound)."""
    return {
        "criterion": name,
        "goal": goal,
        "higher_is_better": higher,
        "ratio": statistics.median(ratios),
        "ratios": [round(x, 3) for x in ratios],
        "picks": picks,
    }


def _meets(c: dict, x: float) -> bool:
    return x >= c["goal"] if c.get("higher_is_better", True) else x <= c["goal"]


def report(result: dict) -> str:
    info = result["machine"] | {"load_average_end": result["load_average_end"]}
    lines = side_by_side_header(
        "Head to head with transformers, round by round",
        info,
        f"{result['rounds']} rounds after a warm-up, configurations rotating; "
        f"{result.get('prompts', 8)} prompts x {result.get('max_new_tokens', 64)} tokens; "
        "medians.",
    )
    lines += [
        "| criterion | goal | median of per-round values | rounds | met in rounds |",
        "|---|---|---|---|---|",
    ]
    for part in result["parts"].values():
        for c in part["criteria"]:
            sign = "≥" if c.get("higher_is_better", True) else "≤"
            goal = "" if c["goal"] is None else f"{sign} {c['goal']:g}"
            met = "" if c["goal"] is None else sum(_meets(c, x) for x in c["ratios"])
            met = "" if met == "" else f"{met} of {len(c['ratios'])}"
            lines.append(
                f"| {c['criterion']} | {goal} | **{c['ratio']:.3f}** | "
                f"{', '.join(f'{x:.2f}' for x in c['ratios'])} | {met} |"
            )
    for name, part in result["parts"].items():
        lines += ["", f"## {name}: tok/s by configuration (median; rounds)", ""]
        lines += ["| configuration | tok/s | rounds |", "|---|---|---|"]
        for k, v in part["rates"].items():
            lines.append(
                f"| {k} | {statistics.median(v):.1f} | {', '.join(f'{x:.0f}' for x in v)} |"
            )
    return "\n".join(lines) + "\n"


ONE_PROCESS_SETS = {  # both models in the orchestrator, on both cores
    "orchestrator.local_models": "true",
    "target.torch_threads": 2,
    "target.plain_torch_threads": 0,
}


def start_one_process(stack) -> str:
    """An orchestrator with both models in its process (``ONE_PROCESS_SETS``) beside
    ``stack`` (an extra, stopped with ``stop_extra``); returns its address."""
    draft, target = stack.address("draft"), stack.address("target")  # (unused there)
    return stack.start_orchestrator("one-process", draft, target, ONE_PROCESS_SETS)[0]


def run_parts(
    stack, hf: Transformers, parts: list[str], c: Choices, one_process: bool = False
) -> dict:
    """Each part's rates by round and its criteria, on ``stack`` (left unpinned).
    ``one_process``: the shared part also measures an orchestrator with both models
    in its process (``ONE_PROCESS_SETS``), started beside the stack."""
    client = Client(stack.orchestrator_address)
    one = None
    if one_process and "shared" in parts:
        one = Client(start_one_process(stack))
    out = {}
    try:
        for part in parts:
            (pin_stack if part == "pinned" else unpin_stack)(stack)
            overheads: dict[str, list[float]] = {}
            rates = interleaved(configs_for(part, hf, client, c, one, overheads), c.rounds)
            out[part] = {
                "rates": rates,
                "overhead_ms": overheads,
                "criteria": criteria(rates, part, c.temperatures, overheads),
            }
            print(f"{part} done", flush=True)
            if part == "shared" and one is not None:  # (not idle beside the pinned part)
                one.close()
                stack.stop_extra()
                one = None
    finally:
        client.close()
        if one is not None:
            one.close()
            stack.stop_extra()
        unpin_stack(stack)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--parts", nargs="*", default=["shared", "pinned"],
                    choices=["shared", "pinned"])  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="per round, in turn")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW, help="per request")
    ap.add_argument("--ks", type=int, nargs="*", default=[3, 4, 5, 6])
    ap.add_argument("--gammas", type=int, nargs="*", default=[2, 3, 4, 5])
    ap.add_argument("--temperatures", type=float, nargs="*", default=[0.0, 1.0])
    ap.add_argument(
        "--one-process",
        action="store_true",
        help="shared: also an orchestrator with both models in its process",
    )
    ap.add_argument("--out", default=f"results/head-to-head-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts, max_new = list(PROMPTS[: args.prompts]), args.max_new_tokens
    c = Choices(prompts, max_new, args.rounds, args.ks, args.gammas, args.temperatures)
    result: dict = {"machine": machine_info("cpu"), "rounds": args.rounds}
    result |= {"prompts": len(prompts), "max_new_tokens": max_new}
    hf = Transformers(analyze_mod.load_pair(args.draft, args.target), prompts, max_new)
    stack = start_services(out / "stack", args.draft, args.target, threads=1, draft_threads=1)
    try:
        result["parts"] = run_parts(stack, hf, args.parts, c, args.one_process)
    finally:
        stack.stop()
    return finish(out, result, report)


if __name__ == "__main__":
    raise SystemExit(main())
