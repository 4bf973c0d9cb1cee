"""results.json -> results.md (Markdown tables) and the printed summary."""

from __future__ import annotations

TEMPS = ("0", "1")
STAGES = (
    "draft_forward",
    "draft_service",
    "draft_network",
    "target_forward",
    "target_service",
    "target_network",
    "rollback",
    "orchestrator",
)


def _t(t: str) -> str:
    return "greedy" if t == "0" else f"T={t}"


def _f(x, fmt: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def throughput_rows(r: dict, t: str) -> list[list[str]]:
    sweep, hf = r["services"], r["hf"]["results"]
    best = r["best_gamma"][t]
    plain = sweep[f"0@{t}"]
    rows = [
        [
            "plain decoding through the target service (gamma 0)",
            "0",
            _f(plain["tok_s"], ".1f"),
            "1.00x",
            "-",
            "-",
            "1.00 / 1.00",
            "-",
        ]
    ]
    for _key, v in sorted(
        ((k, v) for k, v in sweep.items() if v["temperature"] == float(t) and v["gamma"]),
        key=lambda kv: kv[1]["gamma"],
    ):
        frac = v.get("fraction_of_theoretical")
        rows.append(
            [
                "specdec" + (" (best)" if v["gamma"] == best else ""),
                str(v["gamma"]),
                _f(v["tok_s"], ".1f"),
                _f(v["speedup"], ".2f") + "x",
                _f(v.get("theoretical_speedup"), ".2f") + "x",
                _f(frac * 100 if frac is not None else None, ".0f") + "%",
                f"{v['tokens_per_step']:.2f} / {v.get('expected_tokens_per_step', 0):.2f}",
                _f(v.get("acceptance"), ".2f"),
            ]
        )
    wide = r.get("services_wide")
    if wide and t == "1":
        k = wide["wire_top_k"]
        for v in sorted(wide["rows"].values(), key=lambda v: v["gamma"]):
            frac = v.get("fraction_of_theoretical")
            base = plain["tok_s"]
            rows.append(
                [
                    f"wire_top_k {k}: "
                    + ("plain (gamma 0, re-measured)" if not v["gamma"] else "specdec")
                    + (" (best)" if v["gamma"] and v["gamma"] == wide["best_gamma"] else ""),
                    str(v["gamma"]),
                    _f(v["tok_s"], ".1f"),
                    _f(v["tok_s"] / base, ".2f") + "x",
                    _f(v.get("theoretical_speedup"), ".2f") + ("x" if v["gamma"] else ""),
                    _f(frac * 100 if frac is not None else None, ".0f")
                    + ("%" if v["gamma"] else ""),
                    f"{v['tokens_per_step']:.2f} / {v.get('expected_tokens_per_step', 1.0):.2f}",
                    _f(v.get("acceptance"), ".2f"),
                ]
            )
    names = {
        "hf_plain": "HF `generate`, plain, in-process",
        "hf_assisted": "HF assisted generation (defaults), in-process",
        "hf_assisted_fixed": "HF assisted generation (fixed gamma, constant), in-process",
    }
    for mode in ("hf_plain", "hf_assisted", "hf_assisted_fixed"):
        v = hf.get(f"{mode}@{t}")
        if v is None:
            continue
        g = "-"
        if mode == "hf_assisted_fixed":
            g = str(r["hf"]["fixed_gamma"])
        elif mode == "hf_assisted":
            g = "auto"
        rows.append(
            [
                names[mode],
                g,
                _f(v["tok_s"], ".1f"),
                _f(v["speedup_vs_services_plain"], ".2f") + "x",
                "-",
                "-",
                "-",
                "-",
            ]
        )
    return rows


def accounting(r: dict) -> list[str]:
    """Milliseconds per generated token by component: plain vs the best gamma."""
    names = {
        "draft_forward": "draft forward passes",
        "draft_service": "draft service overhead",
        "draft_network": "draft network + gRPC",
        "target_forward": "target forward passes",
        "target_service": "target service overhead",
        "target_network": "target network + gRPC",
        "rollback": "rollback RPCs",
        "orchestrator": "orchestrator (accept test, text, stream)",
        "outside_steps": "outside steps (prefill, set-up, client)",
        "total": "total (wall time / tokens)",
    }
    header = ["ms per generated token"]
    cols = []
    for t in TEMPS:
        g = r["best_gamma"][t]
        header += [f"{_t(t)} plain", f"{_t(t)} gamma {g}"]
        cols += [r["services"][f"0@{t}"]["breakdown"], r["services"][f"{g}@{t}"]["breakdown"]]
    rows = [
        [label] + [_f(c["ms_per_token"].get(k), ".3f") if c else "-" for c in cols]
        for k, label in names.items()
    ]
    return [
        "### Per generated token: plain vs the best gamma",
        "",
        _table(header, rows),
    ]


def markdown(r: dict) -> str:
    m, s, an = r["machine"], r["settings"], r["analysis"]
    q, c = an["quality"], an["cost"]
    d, tg = r["models"]["draft"], r["models"]["target"]
    out = [
        "# specdec benchmark results",
        "",
        f"{m['date']} on {m['cpu_model']} ({m['cpu_cores']} cores"
        + (f", {m['gpu']}" if m.get("gpu") else "")
        + f"), device {s['device']}, {s['dtype']}; torch {m['torch']}, transformers "
        f"{m['transformers']}, grpcio {m['grpc']}; commit {m.get('git_commit', '')}. "
        f"Load average at start {m['load_average'][0]:.2f}, at end "
        f"{m.get('load_average_end', [float('nan')])[0]:.2f}. Run took {r['seconds']:.0f} s"
        + (" (--quick)." if s["quick"] else "."),
        "",
        f"* draft: `{d['path']}`, {d['architecture']}, {d['parameters'] / 1e6:.2f} M parameters "
        f"({d['layers']} layers, width {d['hidden_size']}, vocab {d['vocab_size']})",
        f"* target: `{tg['path']}`, {tg['architecture']}, {tg['parameters'] / 1e6:.2f} M "
        f"parameters ({tg['layers']} layers, width {tg['hidden_size']})",
        f"* {len(s['prompts'])} prompts x {s['max_new_tokens']} new tokens per configuration, "
        f"median of {s['repeats']} repeats (interleaved); torch threads {s['torch_threads']} per "
        "service (draft and target run one after the other within a request) and in-process; "
        "sampling: greedy, or temperature 1 with no top-k / top-p; "
        f"wire top-k {q['wire_top_k']}.",
        "",
        "## The pair (benchmarks.analyze)",
        "",
        _table(
            ["quantity", "value"],
            [
                ["alpha at T=1 (full q)", _f(q["alpha"], ".3f")],
                [
                    f"alpha at T=1 (q truncated to top-{q['wire_top_k']}, used below)",
                    _f(q["alpha_wire_top_k"], ".3f"),
                ],
                [
                    "alpha at T=1 by wire_top_k",
                    ", ".join(f"{k}: {v:.3f}" for k, v in q.get("alpha_by_wire_top_k", {}).items()),
                ],
                ["greedy agreement (alpha of greedy decoding)", _f(q["greedy_agreement"], ".3f")],
                ["draft decode step (in-process, median)", f"{c['draft_step_ms']:.3f} ms"],
                ["target decode step (in-process, median)", f"{c['target_step_ms']:.3f} ms"],
                ["cost ratio c", _f(c["c"], ".3f")],
                [
                    "verify cost v(g) = target forward over g+1 tokens / one step",
                    ", ".join(f"{g}: {v:.2f}" for g, v in c["verify_cost_ratio"].items()),
                ],
                [
                    "recommended gamma (formula)",
                    f"{an['recommended_gamma']} (T=1), {an['recommended_gamma_greedy']} (greedy)",
                ],
            ],
        ),
        "",
        "## Throughput: plain, speculative and assisted decoding",
        "",
        "Speedups are over plain decoding through the same target service (gamma 0); "
        "theoretical = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) with alpha and c "
        "from this run (alpha of the q actually sent: top-k truncated at T=1, greedy agreement "
        "when greedy); tokens/step = measured mean (accepted + 1) / expected "
        "(1 - alpha^(gamma+1)) / (1 - alpha)."
        + (
            f" The `wire_top_k {r['services_wide']['wire_top_k']}` rows come from a second "
            "orchestrator with that setting on the same draft and target services; their "
            "speedup is over the main plain row, their theory uses alpha at that k."
            if r.get("services_wide")
            else ""
        ),
    ]
    header = [
        "configuration",
        "gamma",
        "tok/s",
        "speedup",
        "theoretical",
        "% of theory",
        "tokens/step (meas. / exp.)",
        "acceptance",
    ]
    for t in TEMPS:
        out += ["", f"### {_t(t)}", "", _table(header, throughput_rows(r, t))]
    ad = r["hf"]["assistant_defaults"]
    out += [
        "",
        f"HF assisted generation defaults here: num_assistant_tokens {ad['num_assistant_tokens']}, "
        f"schedule {ad['num_assistant_tokens_schedule']}, confidence threshold "
        f"{ad['assistant_confidence_threshold']} (None = transformers' built-in default: 20, "
        "constant, 0.4).",
        "",
        "## Where a step's time goes",
        "",
        "Milliseconds per step from the /metrics deltas: forward = the model's forward passes "
        "(service side), service = server RPC time minus forward (validation, sampling, "
        "protobuf, thread hop), network = the orchestrator's stage time minus the server RPC "
        "time (loopback TCP, gRPC, (de)serialization, the orchestrator's handling of the "
        "messages), orchestrator = the rest of the step (acceptance test, text, streaming). "
        "ms/token adds the time outside steps (prefill, stream set-up, client).",
    ]
    for t in TEMPS:
        rows = []
        for g in [0, *s["gammas"]]:
            b = r["services"][f"{g}@{t}"]["breakdown"]
            if not b:
                continue
            ps, pt = b["ms_per_step"], b["ms_per_token"]
            rows.append(
                [str(g)]
                + [_f(ps[k], ".2f") for k in STAGES]
                + [
                    _f(ps["step_total"], ".2f"),
                    _f(pt["outside_steps"], ".2f"),
                    _f(pt["total"], ".2f"),
                ]
            )
        out += [
            "",
            f"### {_t(t)}",
            "",
            _table(
                [
                    "gamma",
                    "draft fwd",
                    "draft svc",
                    "draft net",
                    "target fwd",
                    "target svc",
                    "target net",
                    "rollback",
                    "orch.",
                    "step total",
                    "outside steps ms/tok",
                    "ms/token",
                ],
                rows,
            ),
        ]
    out += ["", *accounting(r)]
    rtt = r["rtt"]["points"]
    out += [
        "",
        "## Added network round-trip time",
        "",
        "Draft and target reached through `specdec.local.proxy` (half the RTT each way, per "
        "chunk) by a second orchestrator; plain = gamma 0 through the same proxies. "
        f"{len(s['prompts'][: s['rtt_prompts']])} prompts, median of {s['rtt_repeats']}. "
        "Info call = measured latency of one small RPC through the proxy.",
        "",
        _table(
            ["added RTT ms", "Info call ms"]
            + [f"{_t(t)} {x}" for t in TEMPS for x in ("plain tok/s", "spec tok/s", "speedup")],
            [
                [k, _f(v["info_call_ms"], ".2f")]
                + [
                    y
                    for t in TEMPS
                    for y in (
                        _f(v[f"T{t}"]["plain_tok_s"], ".1f"),
                        _f(v[f"T{t}"]["spec_tok_s"], ".1f") + f" (g={v[f'T{t}']['gamma']})",
                        _f(v[f"T{t}"]["speedup"], ".2f") + "x",
                    )
                ]
                for k, v in rtt.items()
            ],
        ),
    ]
    conc = r["concurrency"]
    out += [
        "",
        "## Concurrent clients",
        "",
        f"Aggregate tok/s with N clients at once (T={conc['temperature']:g}, spec gamma "
        f"{conc['gamma']}, {s['concurrency_requests']} request(s) per client, median of "
        f"{s['concurrency_repeats']}); per request = median tok/s one client sees.",
        "",
        _table(
            [
                "clients",
                "plain tok/s",
                "spec tok/s",
                "speedup",
                "plain per request",
                "spec per request",
            ],
            [
                [
                    k,
                    _f(v["plain"]["tok_s"], ".1f"),
                    _f(v["spec"]["tok_s"], ".1f"),
                    _f(v["speedup"], ".2f") + "x",
                    _f(v["plain"]["per_request_tok_s"], ".1f"),
                    _f(v["spec"]["per_request_tok_s"], ".1f"),
                ]
                for k, v in conc["points"].items()
            ],
        ),
    ]
    wire = r["wire"]
    rows = []
    for t in TEMPS:
        for g in [0, *s["gammas"]]:
            sp, de = wire.get(f"{g}@{t}@sparse"), wire.get(f"{g}@{t}@dense")
            if sp and de:
                rows.append(
                    [
                        _t(t),
                        str(g),
                        _f(sp["wire_bytes_per_token"], ".0f"),
                        _f(de["wire_bytes_per_token"], ".0f"),
                        _f(de["wire_bytes_per_token"] / sp["wire_bytes_per_token"], ".0f") + "x",
                        _f(sp["tok_s"], ".1f"),
                        _f(de["tok_s"], ".1f"),
                    ]
                )
    out += [
        "",
        "## Wire bytes per generated token",
        "",
        "Serialized request and response bytes between the orchestrator and both services "
        "(sparse: top-k q and p_i(x_i) only, the default; dense: full q and full p back). "
        f"{s['dense_prompts']} prompt(s), one run each.",
        "",
        _table(
            [
                "sampling",
                "gamma",
                "sparse B/token",
                "dense B/token",
                "dense / sparse",
                "sparse tok/s",
                "dense tok/s",
            ],
            rows,
        ),
    ]
    if r.get("plots"):
        out += ["", "## Plots", ""] + [f"![{p}]({p})" for p in r["plots"]]
    return "\n".join(out) + "\n"


def summary(r: dict) -> str:
    lines = []
    for t in TEMPS:
        lines.append(f"\n{_t(t)} (best gamma {r['best_gamma'][t]})")
        lines.append(
            f"  {'configuration':58s} {'gamma':>5s} {'tok/s':>8s} {'speedup':>8s} "
            f"{'theory':>7s} {'%':>5s}"
        )
        for row in throughput_rows(r, t):
            name, g, toks, sp, th, frac = row[:6]
            lines.append(f"  {name:58s} {g:>5s} {toks:>8s} {sp:>8s} {th:>7s} {frac:>5s}")
    return "\n".join(lines)
