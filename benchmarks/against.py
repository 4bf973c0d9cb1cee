"""This build against an older one, end to end: two stacks side by side, requests
alternating between them.

    python -m benchmarks.against [REV] [--rounds 4] [--prompts 8]
        [--max-new-tokens 64] [--configs seq4@1 seq4@1-p0.9 ...] [--out DIR]

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

from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    PROMPTS,
    REPO,
    Client,
    machine_info,
    start_services,
)
from .plain_runs import paired, side_by_side_header
from .run import measure

# <mode><gamma>@<temperature>[-k<top_k>][-p<top_p>]: GenerateRequest fields
CONFIGS: dict[str, dict] = {
    "plain@0": dict(temperature=0.0, gamma=0),
    "seq4@0": dict(temperature=0.0, gamma=4),
    "plain@1": dict(temperature=1.0, gamma=0),
    "seq4@1": dict(temperature=1.0, gamma=4),
    "plain@1-p0.9": dict(temperature=1.0, gamma=0, top_p=0.9),
    "seq4@1-p0.9": dict(temperature=1.0, gamma=4, top_p=0.9),
    "seq4@1-k50-p0.95": dict(temperature=1.0, gamma=4, top_k=50, top_p=0.95),
}


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
    with tempfile.TemporaryDirectory(prefix="specdec-against-") as tmp:
        old = _worktree(args.rev, Path(tmp)) if args.rev else None
        try:
            for side, repo in zip(SIDES, (old, None), strict=True):
                stacks[side] = start_services(
                    out / side, args.draft, args.target, threads=1, draft_threads=1, repo=repo
                )  # fmt: skip
            clients = {side: Client(stacks[side].address("orchestrator")) for side in SIDES}
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
        }
    return {
        "machine": info,
        "against": args.rev or "itself (A/A)",
        "rounds": args.rounds,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "seconds": time.time() - start,
        "rows": rows,
    }


def report(result: dict) -> str:
    lines = side_by_side_header(
        f"This build against {result['against']}",
        result["machine"],
        f"{result['rounds']} rounds of {result['prompts']} prompts x "
        f"{result['max_new_tokens']} new tokens per configuration and side, the order "
        f"rotating; {result['seconds']:.0f} s.",
    )
    lines += [
        "| configuration | before, tok/s | now, tok/s | now / before, by round | median |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in result["rows"].items():
        lines.append(
            f"| {name} | {row['before_tok_s']:.1f} | {row['now_tok_s']:.1f} | "
            + ", ".join(f"{x:.2f}" for x in row["ratios"])
            + f" | {row['ratio_median']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", nargs="?", help="git revision to compare with (none: an A/A run)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
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
