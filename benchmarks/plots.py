"""PNG plots of a results dict (matplotlib, Agg backend). Returns the file names."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .report import STAGES  # noqa: E402

TEMPS = ((0.0, "0", "greedy"), (1.0, "1", "T=1"))
COLORS = {"0": "tab:blue", "1": "tab:orange"}


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name


def _spec_rows(r: dict, t: float) -> list[dict]:
    rows = [v for v in r["services"].values() if v["temperature"] == t and v["gamma"]]
    return sorted(rows, key=lambda v: v["gamma"])


def tokens_per_s(r: dict, out: Path) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    hf = r["hf"]["results"]
    for ax, (t, key, label) in zip(axes, TEMPS, strict=True):
        rows = _spec_rows(r, t)
        g = [v["gamma"] for v in rows]
        ax.plot(g, [v["tok_s"] for v in rows], "o-", color=COLORS[key], label="specdec (services)")
        plain = r["services"][f"0@{key}"]["tok_s"]
        ax.axhline(plain, color="black", ls="--", label="plain via target service")
        ax.plot(
            g,
            [plain * v["theoretical_speedup"] for v in rows],
            "s:",
            color="gray",
            label="plain x theoretical speedup",
        )
        wide = r.get("services_wide")
        if wide and key == "1":
            wr = sorted((v for v in wide["rows"].values() if v["gamma"]), key=lambda v: v["gamma"])
            ax.plot(
                [v["gamma"] for v in wr],
                [v["tok_s"] for v in wr],
                "^-",
                color="tab:brown",
                label=f"specdec, wire_top_k {wide['wire_top_k']}",
            )
        styles = {
            "hf_plain": ("tab:green", "-."),
            "hf_assisted": ("tab:red", ":"),
            "hf_assisted_fixed": ("tab:purple", ":"),
        }
        for mode, (color, ls) in styles.items():
            v = hf.get(f"{mode}@{key}")
            if v:
                ax.axhline(
                    v["tok_s"], color=color, ls=ls, label=mode.replace("_", " ") + " (in-process)"
                )
        ax.set_title(f"{label}: tokens/s vs gamma")
        ax.set_xlabel("gamma")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("generated tokens / s")
    axes[1].legend(fontsize=7, loc="best")
    return _save(fig, out, "tokens_per_s_vs_gamma.png")


def speedup(r: dict, out: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for t, key, label in TEMPS:
        rows = _spec_rows(r, t)
        g = [v["gamma"] for v in rows]
        ax.plot(g, [v["speedup"] for v in rows], "o-", color=COLORS[key], label=f"{label} measured")
        ax.plot(
            g,
            [v["theoretical_speedup"] for v in rows],
            "--",
            color=COLORS[key],
            label=f"{label} theoretical (alpha, c)",
        )
        ax.plot(
            g,
            [v["theoretical_speedup_verify_cost"] for v in rows],
            ":",
            color=COLORS[key],
            label=f"{label} theoretical with verify cost v(g)",
        )
        wide = r.get("services_wide")
        if wide and key == "1":
            wr = sorted((v for v in wide["rows"].values() if v["gamma"]), key=lambda v: v["gamma"])
            plain = r["services"]["0@1"]["tok_s"]
            ax.plot(
                [v["gamma"] for v in wr],
                [v["tok_s"] / plain for v in wr],
                "^-",
                color="tab:brown",
                label=f"{label} measured, wire_top_k {wide['wire_top_k']}",
            )
            ax.plot(
                [v["gamma"] for v in wr],
                [v["theoretical_speedup"] for v in wr],
                "--",
                color="tab:brown",
                label=f"{label} theoretical, wire_top_k {wide['wire_top_k']}",
            )
        hfa = r["hf"]["results"].get(f"hf_assisted@{key}")
        if hfa:
            ax.axhline(
                hfa["speedup_vs_services_plain"],
                color=COLORS[key],
                alpha=0.4,
                lw=3,
                label=f"{label} HF assisted (vs plain via service)",
            )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("gamma")
    ax.set_ylabel("speedup over plain decoding via the service")
    ax.set_title("Speedup vs gamma: measured and theoretical")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out, "speedup_vs_gamma.png")


def tokens_per_step(r: dict, out: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    an = r["analysis"]
    alphas = {"0": an["quality"]["greedy_agreement"], "1": an["alpha_used"]}
    for t, key, label in TEMPS:
        rows = _spec_rows(r, t)
        g = [v["gamma"] for v in rows]
        ax.plot(
            g,
            [v["tokens_per_step"] for v in rows],
            "o",
            color=COLORS[key],
            label=f"{label} measured",
        )
        a = alphas[key]
        xs = [x / 10 for x in range(10, 10 * max(g) + 1)]
        ys = [(1 - a ** (x + 1)) / (1 - a) if a < 1 else x + 1 for x in xs]
        ax.plot(
            xs,
            ys,
            "-",
            color=COLORS[key],
            alpha=0.6,
            label=f"{label} (1 - a^(g+1)) / (1 - a), a = {a:.3f}",
        )
    wide = r.get("services_wide")
    if wide:
        wr = sorted((v for v in wide["rows"].values() if v["gamma"]), key=lambda v: v["gamma"])
        a = wr[0]["alpha"] if wr else 0.0
        ax.plot(
            [v["gamma"] for v in wr],
            [v["tokens_per_step"] for v in wr],
            "^",
            color="tab:brown",
            label=f"T=1 wire_top_k {wide['wire_top_k']} measured (a = {a:.3f})",
        )
        xs = [x / 10 for x in range(10, 10 * max(v["gamma"] for v in wr) + 1)]
        ax.plot(
            xs,
            [(1 - a ** (x + 1)) / (1 - a) if a < 1 else x + 1 for x in xs],
            "-",
            color="tab:brown",
            alpha=0.6,
        )
    ax.set_xlabel("gamma")
    ax.set_ylabel("tokens per step (target call)")
    ax.set_title("Tokens per step: measured vs expected")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out, "tokens_per_step_vs_gamma.png")


def stage_breakdown(r: dict, out: Path) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    cmap = plt.get_cmap("tab10")
    for ax, (t, key, label) in zip(axes, TEMPS, strict=True):
        gammas = [0] + [v["gamma"] for v in _spec_rows(r, t)]
        bds = [r["services"][f"{g}@{key}"]["breakdown"] for g in gammas]
        bottom = [0.0] * len(gammas)
        for i, stage in enumerate(STAGES):
            vals = [b["ms_per_step"][stage] if b else 0.0 for b in bds]
            ax.bar([str(g) for g in gammas], vals, bottom=bottom, color=cmap(i), label=stage)
            bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
        per_tok = [b["ms_per_token"]["total"] if b else 0.0 for b in bds]
        ax.plot([str(g) for g in gammas], per_tok, "kD-", label="ms per generated token")
        ax.set_title(f"{label}: time per step by stage")
        ax.set_xlabel("gamma (0 = plain)")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("ms")
    axes[1].legend(fontsize=7, loc="upper left")
    return _save(fig, out, "stage_breakdown.png")


def rtt(r: dict, out: Path) -> str:
    pts = r["rtt"]["points"]
    xs = [v["rtt_ms"] for v in pts.values()]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for _t, key, label in TEMPS:
        name = f"T{key}"
        g = next(iter(pts.values()))[name]["gamma"]
        axes[0].plot(
            xs,
            [v[name]["speedup"] for v in pts.values()],
            "o-",
            color=COLORS[key],
            label=f"{label}, gamma {g}",
        )
        axes[1].plot(
            xs,
            [v[name]["spec_tok_s"] for v in pts.values()],
            "o-",
            color=COLORS[key],
            label=f"{label} specdec (gamma {g})",
        )
        axes[1].plot(
            xs,
            [v[name]["plain_tok_s"] for v in pts.values()],
            "s--",
            color=COLORS[key],
            alpha=0.6,
            label=f"{label} plain",
        )
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[0].set_ylabel("speedup over plain (same RTT)")
    axes[1].set_ylabel("tokens / s")
    for ax in axes:
        ax.set_xlabel("added round-trip time to each service (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title("Speedup vs added RTT")
    axes[1].set_title("Throughput vs added RTT")
    return _save(fig, out, "speedup_vs_rtt.png")


def concurrency(r: dict, out: Path) -> str:
    c = r["concurrency"]
    pts = c["points"]
    xs = [v["clients"] for v in pts.values()]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, [v["plain"]["tok_s"] for v in pts.values()], "s--", label="plain (gamma 0)")
    ax.plot(
        xs, [v["spec"]["tok_s"] for v in pts.values()], "o-", label=f"specdec (gamma {c['gamma']})"
    )
    ax.plot(
        xs,
        [v["spec"]["per_request_tok_s"] for v in pts.values()],
        "o:",
        alpha=0.6,
        label="specdec, per request",
    )
    ax.plot(
        xs,
        [v["plain"]["per_request_tok_s"] for v in pts.values()],
        "s:",
        alpha=0.6,
        label="plain, per request",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Throughput vs concurrency (T={c['temperature']:g})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out, "throughput_vs_concurrency.png")


def wire(r: dict, out: Path) -> str:
    w = r["wire"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for t, key, label in TEMPS:
        for mode, ls in (("sparse", "o-"), ("dense", "s--")):
            rows = sorted(
                (
                    v
                    for v in w.values()
                    if v["temperature"] == t and v["dense"] == (mode == "dense")
                ),
                key=lambda v: v["gamma"],
            )
            ax.plot(
                [v["gamma"] for v in rows],
                [v["wire_bytes_per_token"] for v in rows],
                ls,
                color=COLORS[key],
                label=f"{label} {mode}",
            )
    ax.set_yscale("log")
    ax.set_xlabel("gamma (0 = plain)")
    ax.set_ylabel("wire bytes per generated token")
    ax.set_title("Wire bytes per token: sparse (default) vs dense")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(fig, out, "wire_bytes_per_token.png")


def make_plots(results: dict, out: Path) -> list[str]:
    out = Path(out)
    return [
        f(results, out)
        for f in (tokens_per_s, speedup, tokens_per_step, stage_breakdown, rtt, concurrency, wire)
    ]
