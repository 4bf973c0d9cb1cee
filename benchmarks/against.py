"""This build against an older one, end to end: two stacks side by side, requests
alternating between them.

    python -m benchmarks.against [REV] [--rounds 4] [--prompts 8]
        [--max-new-tokens 64] [--configs seq4@1 seq4@1-p0.9 ...]
        [--rtt-ms 10] [--set section.key=value ...] [--out DIR]

REV's code comes from a git worktree (made in a temporary folder and removed at
the end; REV must read the services' config this build writes, as recent
revisions do); without REV both stacks run this build, an A/A run that shows
the scatter of the measurement itself. Both stacks run the demo pair (``--draft``,
``--target``) with one torch thread per service, on the machine's shared cores,
and stay up for the whole run; only one serves at a time. Each round runs every
configuration on both stacks, over the same seeded prompts, in an order that
rotates from round to round (``run.measure``). The report gives each configuration's
tokens per second on each side (median of the rounds) and the paired ratio
this build / REV of every round: on this VM single runs drift by 10-20%, and
pairs taken minutes apart share most of it.

``--rtt-ms``: as separate machines instead (``benchmarks.pipeline``'s layout):
each side's draft and target pinned as in ``make bench``, and each side's
requests through an orchestrator of its own checkout whose every hop, the
draft's relays included, passes the delay proxy with that added round trip.
``--set``: service settings for both sides (``orchestrator.pipeline=true``);
``--set-now``: for this build's side only, after ``--set`` (without REV, an A/B
of a setting: ``--set orchestrator.paced=false --set-now orchestrator.paced=true``).
The report also gives each side's overhead a step (issue 15's: a step's wall
time beyond its draft's and target's forward passes, ``run.overhead_ms``).
Writes results.json and results.md to the output folder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from specdec.local.proxy import ProxyGroup

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    REPO,
    Client,
    machine_info,
    service_settings,
    start_services,
)
from .plain_runs import paired, side_by_side_header
from .run import DRAFT_CORE, FRONT_NICE, measure, pin_stack, unpin_self

# <mode><gamma>@<temperature>[-k<top_k>][-p<top_p>]: GenerateRequest fields. "seq":
# sequential, drafting nothing ahead. (Until 2026-12-05 these left ``overlap`` unset, so
# they took the orchestrator's default, drafting ahead: reports of this benchmark from
# before then measured "seq4" drafting ahead, as "ovl4".)
SEQ = dict(overlap=False)
CONFIGS: dict[str, dict] = {
    "plain@0": dict(temperature=0.0, gamma=0),
    "seq4@0": dict(temperature=0.0, gamma=4, **SEQ),
    "plain@1": dict(temperature=1.0, gamma=0),
    "seq4@1": dict(temperature=1.0, gamma=4, **SEQ),
    "plain@1-p0.9": dict(temperature=1.0, gamma=0, top_p=0.9),
    "seq4@1-p0.9": dict(temperature=1.0, gamma=4, top_p=0.9, **SEQ),
    "seq4@1-k50-p0.95": dict(temperature=1.0, gamma=4, top_k=50, top_p=0.95, **SEQ),
    # drafting ahead (pipelined where ``orchestrator.pipeline`` is set), and adaptive
    "ovl3@0": dict(temperature=0.0, gamma=3, overlap=True),
    "ovl4@0": dict(temperature=0.0, gamma=4, overlap=True),
    "ovl4@1": dict(temperature=1.0, gamma=4, overlap=True),
    "adaptive@0": dict(temperature=0.0, gamma=None, seed=None),
    "adaptive@1": dict(temperature=1.0, gamma=None, seed=None),
}
# The configurations run when none are named (those before drafting ahead).
DEFAULT_CONFIGS = [name for name in CONFIGS if not name.startswith(("ovl", "adaptive"))]


def _worktree(rev: str, parent: Path) -> Path:
    path = parent / "worktree"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(path), rev],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return path


SIDES = ("before", "now")


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = {name: CONFIGS[name] for name in args.configs}
    stacks = {}
    settings = service_settings(args.set)
    now_settings = service_settings([*args.set, *args.set_now])
    proxies = ProxyGroup()
    with tempfile.TemporaryDirectory(prefix="specdec-against-") as tmp:
        old = _worktree(args.rev, Path(tmp)) if args.rev else None
        try:
            order = list(zip(SIDES, (old, None), strict=True))
            for side, repo in order[::-1] if args.now_first else order:
                stacks[side] = start_services(
                    out / side, args.draft, args.target, threads=1, draft_threads=1,
                    settings=now_settings if side == "now" else settings, repo=repo,
                )  # fmt: skip
            addresses = {side: stacks[side].address("orchestrator") for side in SIDES}
            if args.rtt_ms is not None:
                # Every route and orchestrator first, then the pins: a thread (a
                # proxy's) or a child process (an orchestrator) made after this
                # process is pinned inherits its core, one made before does not, and
                # the side made first ran 5-10% faster in A/A runs.
                for side, stack in stacks.items():
                    pd, pt = (proxies.add(stack.address(r)) for r in ("draft", "target"))
                    addresses[side], _ = stack.start_orchestrator(f"orch-{side}", pd, pt)
                for stack in stacks.values():
                    pin_stack(stack)
                    stack.pin_extra(DRAFT_CORE, FRONT_NICE)
                proxies.set_rtt_ms(args.rtt_ms)
            clients = {side: Client(addresses[side]) for side in SIDES}
            info = machine_info("cpu")
            start = time.time()
            # Each configuration once per side, every round; the order rotates (run.measure).
            via = {f"{name}:{side}": clients[side] for name in configs for side in SIDES}
            both = {f"{name}:{side}": configs[name] for name in configs for side in SIDES}
            prompts = PROMPTS[: args.prompts]
            rates = measure(via, both, prompts, args.max_new_tokens, args.rounds)
            for client in clients.values():
                client.close()
        finally:
            for stack in stacks.values():
                stack.stop()
            proxies.close()
            unpin_self()
            if old is not None:
                for cmd in (["remove", "--force", str(old)], ["prune"]):
                    subprocess.run(["git", "worktree", *cmd], cwd=REPO, check=False)
    info["load_average_end"] = list(os.getloadavg())
    rows = {}
    for name in configs:
        before, now = (rates[f"{name}:{side}"] for side in SIDES)
        rows[name] = {
            "fields": configs[name],
            "before_tok_s": before["tok_s"],
            "now_tok_s": now["tok_s"],
            "ratios": [n / b for b, n in zip(before["tok_s_runs"], now["tok_s_runs"], strict=True)],
            "ratio_median": paired(now["tok_s_runs"], before["tok_s_runs"]),
            # issue 15's overhead: a step's wall time beyond its forward passes
            "before_overhead_ms": before["ms_per_step"]["overhead"],
            "now_overhead_ms": now["ms_per_step"]["overhead"],
        }
    return {
        "machine": info,
        "against": args.rev or ("itself, settings A/B" if args.set_now else "itself (A/A)"),
        "rounds": args.rounds,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "rtt_ms": args.rtt_ms,
        "settings": args.set,
        "settings_now": args.set_now,
        "seconds": time.time() - start,
        "rows": rows,
    }


def report(result: dict) -> str:
    lines = side_by_side_header(
        f"This build against {result['against']}",
        result["machine"],
        f"{result['rounds']} rounds of {result['prompts']} prompts x "
        f"{result['max_new_tokens']} new tokens per configuration and side, the order "
        f"rotating; {result['seconds']:.0f} s."
        + (
            f" Pinned, +{result['rtt_ms']:g} ms round trip on every hop."
            if result.get("rtt_ms") is not None
            else " Shared cores, no added round trip."
        )
        + (f" Settings: `{' '.join(result['settings'])}`." if result.get("settings") else "")
        + (
            f" This build's side only: `{' '.join(result['settings_now'])}`."
            if result.get("settings_now")
            else ""
        ),
    )
    lines += [
        "| configuration | before, tok/s | now, tok/s | now / before, by round | median "
        "| overhead, ms a step: before, now |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in result["rows"].items():
        over = ""
        if "now_overhead_ms" in row:
            over = f"{row['before_overhead_ms']:.2f}, {row['now_overhead_ms']:.2f}"
        lines.append(
            f"| {name} | {row['before_tok_s']:.1f} | {row['now_tok_s']:.1f} | "
            + ", ".join(f"{x:.2f}" for x in row["ratios"])
            + f" | {row['ratio_median']:.2f} | {over} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", nargs="?", help="git revision to compare with (none: an A/A run)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    ap.add_argument("--rtt-ms", type=float, help="as separate machines, this round trip added")
    ap.add_argument("--set", nargs="*", default=[], help="section.key=value, both sides")
    ap.add_argument(
        "--set-now", nargs="*", default=[], help="section.key=value, this build's side only"
    )
    ap.add_argument(
        "--now-first", action="store_true", help="start this build's side first (see --rtt-ms)"
    )
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--out", default=f"results/against-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()
    result = run(args)
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (out / "results.md").write_text(text)
    print(text)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
