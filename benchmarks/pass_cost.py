"""What a forward pass costs by the sessions and tokens it carries: the target's
(and the draft's) passes through the ragged runtime, one thread, packed as a
service packs them.

    python -m benchmarks.pass_cost [--sessions 1 2 4 8 16] [--tokens 1 5]
        [--contexts 100 400] [--passes 40] [--out results/pass-cost-<time>]

For each context length (tokens already cached per session), tokens per session
and number of sessions, the median pass time over ``--passes`` passes, and the
same tokens fed as one session (``one session`` column); then a least-squares fit
per model and context,

    pass = a + b * tokens + c * sessions,

a: the part every pass pays (on a CPU, reading the weights), b: a token's
arithmetic, c: what a session adds beyond its tokens (its segment's attention,
which reads that session's cached keys and values). With ``--cold`` each pass
comes after a buffer twice the last-level cache was written (as in a service,
where the other model's passes evict the caches between two of its own).
Prints a table; writes results.json, results.md and pass_cost.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specdec.runtime import packed_linear
from specdec.runtime.loading import load_model
from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

from .common import DEFAULT_DRAFT, DEFAULT_TARGET, machine_info, torch_threads

_COLD_BYTES = 64 * 1024 * 1024  # twice the 32 MB L3 of the machine measured


@torch.inference_mode()
def pass_grid(
    path: str, sessions: list[int], tokens: list[int], contexts: list[int], passes: int, cold: bool
) -> list[dict]:
    """One row per (context, tokens per session, sessions): median ms of a pass with
    that many sessions, and of one session fed all their tokens."""
    with torch_threads(1):
        model = load_model(path)
        runner = RaggedRunner(model)
        packed_linear.pack_model(model, runner, 64, 0)
        v = runner.vocab_size
        flush = torch.zeros(_COLD_BYTES // 4) if cold else None
        rows = []
        for context in contexts:
            kvs = [SessionKV() for _ in range(max(sessions))]
            for i, kv in enumerate(kvs):
                runner.forward([Feed(kv, [(31 * i + 7 * j) % v for j in range(context)], 0)])

            for n in tokens:
                for s in sessions:
                    fed = [(5 + j) % v for j in range(n)]
                    arms = (
                        lambda: [Feed(kv, fed, n) for kv in kvs[:s]],  # noqa: B023 (called now)
                        lambda: [Feed(kvs[0], fed * s, n * s)],  # noqa: B023
                    )
                    many, one = _median_ms(runner, arms, passes, flush)
                    rows.append(
                        {"context": context, "tokens_per_session": n, "sessions": s,
                         "ms": many, "one_session_ms": one}
                    )  # fmt: skip
    return rows


def _median_ms(runner: RaggedRunner, arms, passes: int, flush) -> list[float]:
    """Median ms of a pass of each arm's feeds (``arms``: functions making them), the
    arms' passes alternating; every session is rolled back after each pass."""
    times: list[list[float]] = [[] for _ in arms]
    for k in range(passes):
        for i in range(len(arms)) if k % 2 else reversed(range(len(arms))):
            feeds = arms[i]()
            cached = [f.kv.length for f in feeds]
            if flush is not None:
                flush.add_(1.0)
            t = time.perf_counter()
            runner.forward(feeds)
            times[i].append(1e3 * (time.perf_counter() - t))
            for f, length in zip(feeds, cached, strict=True):
                f.kv.truncate(length)
    return [statistics.median(ts) for ts in times]


def fit(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per context: pass ms = a + b * tokens + c * sessions, least squares over the
    grid (the one-session passes included: they tell tokens from sessions). Beside
    it, ``line_ms_per_token``: the slope of a line in tokens alone through the
    passes of the most tokens per session, sessions varying, which is what a line
    fitted to verify passes under load sees (``orchestrator.adaptive``'s
    ``target_pass``): b + c / tokens per session."""
    out = {}
    for context in sorted({r["context"] for r in rows}):
        xs, ys = [], []
        for r in rows:
            if r["context"] != context:
                continue
            tokens = r["tokens_per_session"] * r["sessions"]
            xs += [[1.0, tokens, r["sessions"]], [1.0, tokens, 1.0]]
            ys += [r["ms"], r["one_session_ms"]]
        (a, b, c), *_ = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)
        n = max(r["tokens_per_session"] for r in rows if r["context"] == context)
        verify = [r for r in rows if r["context"] == context and r["tokens_per_session"] == n]
        line = float("nan")
        if len({r["sessions"] for r in verify}) > 1:
            x = np.array([n * r["sessions"] for r in verify], dtype=float)
            line = float(np.polyfit(x, np.array([r["ms"] for r in verify]), 1)[0])
        out[str(context)] = {
            "a_ms": float(a),
            "b_ms_per_token": float(b),
            "c_ms_per_session": float(c),
            "line_ms_per_token": line,
        }
    return out


def report(result: dict) -> str:
    info = result["machine"]
    lines = [
        "# Pass cost by sessions and tokens",
        "",
        f"{info['date']}, commit {info['git_commit']}, {info['cpu_model']}, "
        f"{info['cpu_cores']} cores, load average {info['load_average'][0]:.2f} at the start; "
        f"one torch thread; {'cold' if result['cold'] else 'warm'} caches; "
        f"median of {result['passes']} passes.",
        "",
    ]
    for role, part in result["models"].items():
        lines += [
            f"## {role}",
            "",
            "| context | tokens / session | sessions | pass ms | as one session, ms | ratio |",
            "|---|---|---|---|---|---|",
        ]
        for r in part["grid"]:
            lines.append(
                f"| {r['context']} | {r['tokens_per_session']} | {r['sessions']} | "
                f"{r['ms']:.2f} | {r['one_session_ms']:.2f} | {r['ms'] / r['one_session_ms']:.2f} |"
            )
        lines += [
            "",
            "| context | a (ms a pass) | b (ms a token) | c (ms a session) "
            "| a line in tokens alone (ms a token) |",
            "|---|---|---|---|---|",
        ]
        for context, f in part["fit"].items():
            lines.append(
                f"| {context} | {f['a_ms']:.2f} | {f['b_ms_per_token']:.3f} | "
                f"{f['c_ms_per_session']:.3f} | {f['line_ms_per_token']:.3f} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = result["models"]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4), squeeze=False)
    for ax, (role, part) in zip(axes[0], parts.items(), strict=True):
        for context in sorted({r["context"] for r in part["grid"]}):
            for n in sorted({r["tokens_per_session"] for r in part["grid"]}):
                rs = [
                    r
                    for r in part["grid"]
                    if r["context"] == context and r["tokens_per_session"] == n
                ]
                x = [r["sessions"] * n for r in rs]
                ax.plot(x, [r["ms"] for r in rs], "o-", label=f"ctx {context}, {n} tok/session")
                ax.plot(x, [r["one_session_ms"] for r in rs], "x--", color=ax.lines[-1].get_color(),
                        label=f"ctx {context}, as one session")  # fmt: skip
        ax.set_title(f"{role}: pass time by tokens carried")
        ax.set_xlabel("tokens in the pass")
        ax.set_ylabel("ms")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pass_cost.png", dpi=90)
    plt.close(fig)
    return "pass_cost.png"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--roles", nargs="*", default=["target", "draft"], choices=["target", "draft"])
    ap.add_argument("--sessions", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 5], help="per session")
    ap.add_argument("--contexts", type=int, nargs="*", default=[100, 400])
    ap.add_argument("--passes", type=int, default=40, help="per cell")
    ap.add_argument("--cold", action="store_true", help="evict the caches before each pass")
    ap.add_argument("--out", default=f"results/pass-cost-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info("cpu"), "cold": args.cold, "passes": args.passes,
              "models": {}}  # fmt: skip
    for role in args.roles:
        path = args.target if role == "target" else args.draft
        grid = pass_grid(path, args.sessions, args.tokens, args.contexts, args.passes, args.cold)
        result["models"][role] = {"path": path, "grid": grid, "fit": fit(grid)}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    md = report(result)
    (out / "results.md").write_text(md + f"\n![pass cost]({plot(result, out)})\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
