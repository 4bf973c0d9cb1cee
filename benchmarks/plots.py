"""PNG plots of a benchmark run (matplotlib, Agg backend). Returns the file names."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .report import TEMPS, _gamma  # noqa: E402

COLORS = {"plain": "black", "seq": "tab:blue", "ovl": "tab:orange", "adaptive": "tab:green"}


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name


def _series(rows: dict, t: str, prefix: str) -> tuple[list[int], list[float]]:
    pts = sorted(
        (_gamma(k), v["tok_s"])
        for k, v in rows.items()
        if k.startswith(prefix) and k.endswith(f"@{t}")
    )
    return [g for g, _ in pts], [v for _, v in pts]


def tokens_vs_gamma(r: dict, out: Path) -> list[str]:
    names = []
    for section, title in (("services", "shared cores"), ("pinned", "pinned (separate machines)")):
        rows = r.get(section)
        if not rows:
            continue
        hf_key = "shared" if section == "services" else "target_core"
        hf = r.get("hf", {}).get(hf_key, {})
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for ax, (_, t, label) in zip(axes, TEMPS, strict=True):
            for prefix, name in (("seq", "sequential"), ("ovl", "overlapped")):
                g, v = _series(rows, t, prefix)
                ax.plot(g, v, "o-", color=COLORS[prefix], label=f"specdec {name}")
            ax.axhline(rows[f"plain@{t}"]["tok_s"], color="black", ls="--", label="plain (service)")
            ax.axhline(rows[f"adaptive@{t}"]["tok_s"], color=COLORS["adaptive"], ls="-.",
                       label="specdec adaptive")  # fmt: skip
            if hf:
                ax.axhline(hf[f"plain@{t}"]["tok_s"], color="gray", ls=":", label="generate()")
                g, v = _series(hf, t, "assisted")
                ax.plot(g, v, "s:", color="tab:red", label="assisted generation (k)")
            ax.set_title(f"{label}, {title}")
            ax.set_xlabel("gamma (k for assisted)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("tokens/s")
        axes[0].legend(fontsize=7)
        names.append(_save(fig, out, f"tokens_per_s_{section}.png"))
    return names


def stage_breakdown(r: dict, out: Path) -> str | None:
    rows = r.get("services")
    if not rows:
        return None
    bars = []
    before = r.get("before")  # the previous release, measured on this machine (optional)
    if before:
        for label, ms in before.items():
            bars.append((f"before: {label}", ms))
    for _, t, label in TEMPS:
        for name in ("plain", "seq4"):
            key = f"{name}@{t}"
            if key in rows:
                bars.append((f"{label} {name}", rows[key]["ms_per_step"]))
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(bars) + 1.5))
    parts = (
        ("draft_forward", "tab:orange"),
        ("target_forward", "tab:blue"),
        ("overhead", "tab:red"),
    )
    for i, (_, ms) in enumerate(bars):
        left = 0.0
        for part, color in parts:
            ax.barh(i, ms.get(part, 0.0), left=left, color=color,
                    label=part.replace("_", " ") if i == 0 else None)  # fmt: skip
            left += ms.get(part, 0.0)
        ax.text(left + 0.2, i, f"{ms.get('overhead', 0):.2f} ms overhead", va="center", fontsize=7)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.set_xlabel("ms per step")
    ax.set_title("Where a step's time goes")
    ax.legend(fontsize=7)
    return _save(fig, out, "stage_breakdown.png")


def rtt_plot(r: dict, out: Path) -> str | None:
    rtt = r.get("rtt")
    if not rtt:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    xs = [float(k) for k in rtt]
    for ax, (_, t, label) in zip(axes, TEMPS, strict=True):
        modes = (
            ("plain", "plain"),
            ("seq", "sequential (best gamma)"),
            ("ovl", "overlapped (best gamma)"),
            ("adaptive", "adaptive"),
        )
        for prefix, name in modes:
            ys = []
            for k in rtt:
                rows = rtt[k]["rows"]
                cands = [v["tok_s"] for n, v in rows.items()
                         if n.startswith(prefix) and n.endswith(f"@{t}")]  # fmt: skip
                ys.append(max(cands) if cands else float("nan"))
            ax.plot(xs, ys, "o-", color=COLORS[prefix], label=name)
        # The cost model: plain's rate scaled by the model's speedup at the adaptive choice.
        model = r.get("rtt_model", {}).get(t)
        if model:
            ax.plot(xs, model, "k:", label="cost model (adaptive)")
        ax.set_title(label)
        ax.set_xlabel("added round-trip time (ms)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens/s")
    axes[0].legend(fontsize=7)
    return _save(fig, out, "tokens_per_s_vs_rtt.png")


def concurrency_plot(r: dict, out: Path) -> str | None:
    conc = r.get("concurrency")
    if not conc:
        return None
    ns = [int(n) for n in conc]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, color in (("plain", "black"), ("adaptive", "tab:green"), ("seq4", "tab:blue")):
        axes[0].plot(ns, [conc[str(n)][mode]["tok_s"] for n in ns], "o-", color=color, label=mode)
        if "sustained_tok_s" in conc[str(ns[0])][mode]:
            held = [conc[str(n)][mode]["sustained_tok_s"] for n in ns]
            axes[0].plot(ns, held, "s--", color=color, alpha=0.6, label=f"{mode}, sustained")
        axes[1].plot(ns, [conc[str(n)][mode]["p50_latency_s"] for n in ns], "o-", color=color,
                     label=mode)  # fmt: skip
    axes[0].set_ylabel("aggregate tokens/s")
    axes[1].set_ylabel("p50 request latency (s)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out, "throughput_vs_clients.png")


def make_plots(r: dict, out: Path) -> list[str]:
    names = tokens_vs_gamma(r, out)
    for fn in (stage_breakdown, rtt_plot, concurrency_plot):
        name = fn(r, out)
        if name:
            names.append(name)
    return names
