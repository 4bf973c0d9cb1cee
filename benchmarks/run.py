"""Plain decoding, speculative decoding through the services, and Hugging Face
assisted generation, measured side by side in one run.

  python -m benchmarks.run [--quick] [--out results/<timestamp>]
      [--draft DIR] [--target DIR] [--device cpu|cuda] [--threads 2]

Same pair, same prompts, same sampling settings (greedy and temperature 1,
no top-k / top-p) everywhere; every configuration is repeated and the median
over repeats is reported (repeats are interleaved across configurations, so a
slow spell of the machine hits all of them alike). In order:

1. ``benchmarks.analyze`` on the pair: alpha, c, predicted speedups;
2. in-process Hugging Face ``generate``: plain, and assisted generation
   (``assistant_model=draft``) with its defaults and with a fixed gamma;
3. through the services (draft, target, orchestrator as child processes):
   plain target decoding (gamma = 0) and gamma 1..8, with the per-step time
   breakdown from the /metrics deltas; dense vs sparse wire bytes;
4. a second orchestrator reaching draft and target through
   ``specdec.local.proxy``: speedup versus added round-trip time;
5. throughput versus number of concurrent clients.

Writes results.json, results.md and PNG plots into the output folder and
prints a summary. ``--quick`` (fewer tokens, prompts, repeats and points)
takes a minute or two; it is what the smoke test runs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.local.proxy import ProxyGroup
from specdec.sampling import expected_speedup, expected_tokens_per_step

from . import analyze as analyze_mod
from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    REPO,
    Client,
    add_into,
    delta,
    info_rtt_ms,
    load_prompts,
    machine_info,
    pick,
    scrape,
    start_services,
)

TEMPERATURES = (0.0, 1.0)


@dataclass
class Plan:
    prompts: list[str]
    max_new_tokens: int = 64
    repeats: int = 3
    gammas: list[int] = field(default_factory=lambda: list(range(1, 9)))
    rtts_ms: list[float] = field(default_factory=lambda: [0.0, 1.0, 2.0, 5.0, 10.0])
    rtt_prompts: int = 2
    rtt_repeats: int = 3
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    concurrency_requests: int = 1  # requests each client makes, one after the other
    concurrency_repeats: int = 3
    dense_prompts: int = 2
    analyze_tokens: int = 64
    analyze_rounds: int = 5
    analyze_steps: int = 60
    hf_fixed_gamma: bool = True
    wide_sweep: bool = False  # T=1 again with the wire_top_k that keeps alpha (--wide-top-k)

    @classmethod
    def make(cls, prompts: list[str], quick: bool, max_new_tokens: int | None) -> Plan:
        if not quick:
            return cls(prompts, max_new_tokens or 64)
        return cls(
            prompts[:3],
            max_new_tokens or 12,
            repeats=1,
            gammas=[1, 2, 4],
            rtts_ms=[0.0, 2.0],
            rtt_prompts=2,
            rtt_repeats=1,
            concurrency=[1, 2],
            concurrency_requests=1,
            concurrency_repeats=1,
            dense_prompts=1,
            analyze_tokens=12,
            analyze_rounds=1,
            analyze_steps=10,
            hf_fixed_gamma=False,
        )


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- 2. Hugging Face in-process ----------------------------------------------------------
def _pad_id(model) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    return 0 if pad is None else int(pad)


@torch.inference_mode()
def hf_generate(target, ids, max_new_tokens: int, temperature: float, seed: int, assistant=None):
    kw = {"max_new_tokens": max_new_tokens, "pad_token_id": _pad_id(target)}
    if temperature == 0:
        kw["do_sample"] = False
    else:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    if assistant is not None:
        kw["assistant_model"] = assistant
    torch.manual_seed(seed)
    device = ids.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out.shape[1] - ids.shape[1], time.perf_counter() - t0


def hf_benchmark(tok, draft, target, plan: Plan, fixed_gamma: int) -> dict:
    """tok/s of plain and assisted ``generate``, median over repeats, per temperature."""
    device = next(target.parameters()).device
    ids = [tok(p, return_tensors="pt")["input_ids"].to(device) for p in plan.prompts]
    cfg = draft.generation_config
    defaults = {
        "num_assistant_tokens": cfg.num_assistant_tokens,
        "num_assistant_tokens_schedule": cfg.num_assistant_tokens_schedule,
        "assistant_confidence_threshold": cfg.assistant_confidence_threshold,
    }

    def set_assistant(fixed: bool) -> None:
        if fixed:
            cfg.num_assistant_tokens = fixed_gamma
            cfg.num_assistant_tokens_schedule = "constant"
            cfg.assistant_confidence_threshold = 0.0
        else:
            for k, v in defaults.items():
                setattr(cfg, k, v)

    modes = ["hf_plain", "hf_assisted"] + (["hf_assisted_fixed"] if plan.hf_fixed_gamma else [])
    configs = [(m, t) for t in TEMPERATURES for m in modes]
    runs: dict[str, list[dict]] = {f"{m}@{t:g}": [] for m, t in configs}
    # Warm-up: one short call of each kind.
    hf_generate(target, ids[0], 4, 0.0, 0)
    hf_generate(target, ids[0], 4, 0.0, 0, assistant=draft)
    for r in range(plan.repeats):
        for i in range(len(configs)):
            mode, t = configs[(i + r) % len(configs)]
            set_assistant(mode == "hf_assisted_fixed")
            tokens = secs = 0.0
            for j, x in enumerate(ids):
                n, dt = hf_generate(
                    target,
                    x,
                    plan.max_new_tokens,
                    t,
                    seed=1000 * r + j,
                    assistant=draft if mode != "hf_plain" else None,
                )
                tokens += n
                secs += dt
            runs[f"{mode}@{t:g}"].append({"tokens": tokens, "seconds": secs})
    set_assistant(False)
    out = {}
    for mode, t in configs:
        rs = runs[f"{mode}@{t:g}"]
        out[f"{mode}@{t:g}"] = {
            "mode": mode,
            "temperature": t,
            "tok_s": median([x["tokens"] / x["seconds"] for x in rs]),
            "tok_s_runs": [x["tokens"] / x["seconds"] for x in rs],
            "tokens": median([x["tokens"] for x in rs]),
        }
    return {
        "results": out,
        "assistant_defaults": {k: v for k, v in defaults.items()},
        "fixed_gamma": fixed_gamma if plan.hf_fixed_gamma else None,
    }


# ---- 3. through the services -------------------------------------------------------------
class Scraper:
    """Metric deltas of the three services around a measured run."""

    def __init__(self, ports: dict[str, int]) -> None:
        self.ports = ports

    def snapshot(self) -> dict[str, dict]:
        return {role: scrape(port) for role, port in self.ports.items()}

    @staticmethod
    def diff(after: dict, before: dict) -> dict:
        return {role: delta(after[role], before[role]) for role in after}


def run_set(
    client: Client,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    gamma: int,
    repeat: int,
    dense: bool = False,
) -> dict:
    """The prompts one after the other; totals over them."""
    total: dict[str, float] = {}
    for j, prompt in enumerate(prompts):
        r = client.generate(prompt, max_new_tokens, temperature, gamma, 1000 * repeat + j, dense)
        for k, v in r.items():
            if isinstance(v, (int, float)):
                total[k] = total.get(k, 0.0) + v
    total["tok_s"] = total["tokens"] / total["wall_s"]
    return total


def breakdown(m: dict, steps: float, tokens: float, wall_s: float) -> dict:
    """Milliseconds per step (and per token) of each stage, from metric deltas.

    Client-side stage times come from the orchestrator; server-side RPC and
    forward times from the services. network = stage - server RPC time
    (loopback, gRPC, serialization and the orchestrator's handling of the
    messages); service = RPC time - forward time (validation, sampling,
    protobuf building, the hop to the forward thread).
    """
    if not steps:
        return {}
    o, d, t = m["orchestrator"], m["draft"], m["target"]
    stage = "specdec_step_stage_duration_seconds_sum"
    rpc = "specdec_rpc_duration_seconds_sum"
    fwd = "specdec_model_forward_duration_seconds_sum"
    propose = pick(o, stage, stage="propose")
    verify = pick(o, stage, stage="verify")
    rollback = pick(o, stage, stage="rollback")
    orch = pick(o, stage, stage="orchestrator")
    d_rpc = pick(d, rpc, method="Propose")
    d_open = pick(d, rpc, method="OpenSession")
    # Prefill-kind forwards also happen inside Propose (after a full accept, two tokens are fed);
    # the prompt's prefill is at most the OpenSession RPC time.
    d_fwd = pick(d, fwd, kind="propose") + max(0.0, pick(d, fwd, kind="prefill") - d_open)
    t_rpc = pick(t, rpc, method="Verify")
    t_open = pick(t, rpc, method="OpenSession")
    t_fwd = (
        pick(t, fwd, kind="verify")
        + pick(t, fwd, kind="decode")
        + max(0.0, pick(t, fwd, kind="prefill") - t_open)
    )
    parts = {
        "draft_forward": d_fwd,
        "draft_service": max(0.0, d_rpc - d_fwd),
        "draft_network": max(0.0, propose - d_rpc),
        "target_forward": t_fwd,
        "target_service": max(0.0, t_rpc - t_fwd),
        "target_network": max(0.0, verify - t_rpc),
        "rollback": rollback,
        "orchestrator": orch,
    }
    in_steps = propose + verify + rollback + orch
    per_step = {k: round(v / steps * 1e3, 4) for k, v in parts.items()}
    per_step["step_total"] = round(in_steps / steps * 1e3, 4)
    return {
        "ms_per_step": per_step,
        "ms_per_token": {k: round(v / tokens * 1e3, 4) for k, v in parts.items()}
        | {
            # Outside the steps: prefill (OpenSession), stream set-up, the client.
            "outside_steps": round(max(0.0, wall_s - in_steps) / tokens * 1e3, 4),
            "total": round(wall_s / tokens * 1e3, 4),
        },
        "round_trips_per_token": round(
            pick(o, "specdec_round_trips_total") / tokens if tokens else 0.0, 4
        ),
        "wire_bytes_per_token": round(pick(o, "specdec_wire_bytes_total") / tokens, 2),
    }


def services_sweep(
    services,
    plan: Plan,
    address: str | None = None,
    metrics_port: int | None = None,
    temperatures: tuple[float, ...] = TEMPERATURES,
) -> dict:
    """gamma 0 (plain target decoding) and gamma 1..8 at each temperature, through
    the orchestrator at ``address`` (default: the main one)."""
    client = Client(address or services.address("orchestrator"))
    scraper = Scraper(
        {
            "orchestrator": metrics_port or services.metrics_port("orchestrator"),
            "draft": services.metrics_port("draft"),
            "target": services.metrics_port("target"),
        }
    )
    configs = [(t, g) for t in temperatures for g in [0, *plan.gammas]]
    # Warm-up: every kind of call once.
    for t in temperatures:
        for g in (0, max(plan.gammas)):
            client.generate(plan.prompts[0], 8, t, g, 0)
    runs: dict[str, list[dict]] = {f"{g}@{t:g}": [] for t, g in configs}
    metrics: dict[str, dict] = {f"{g}@{t:g}": {} for t, g in configs}
    for r in range(plan.repeats):
        for i in range(len(configs)):
            t, g = configs[(i + r) % len(configs)]
            key = f"{g}@{t:g}"
            before = scraper.snapshot()
            res = run_set(client, plan.prompts, plan.max_new_tokens, t, g, r)
            d = Scraper.diff(scraper.snapshot(), before)
            runs[key].append(res)
            for role, samples in d.items():
                add_into(metrics[key].setdefault(role, {}), samples)
        log(f"  services repeat {r + 1}/{plan.repeats} done")
    client.close()
    out = {}
    for t, g in configs:
        key = f"{g}@{t:g}"
        rs = runs[key]
        tot = {k: sum(x[k] for x in rs) for k in rs[0] if k != "tok_s"}
        steps = tot["steps"]
        out[key] = {
            "gamma": g,
            "temperature": t,
            "tok_s": median([x["tok_s"] for x in rs]),
            "tok_s_runs": [round(x["tok_s"], 3) for x in rs],
            "tokens_per_run": median([x["tokens"] for x in rs]),
            "steps": steps,
            "tokens_per_step": (tot["accepted"] + steps) / steps if steps else 0.0,
            "acceptance": tot["accepted"] / tot["drafted"] if tot["drafted"] else None,
            "ttft_ms": tot["ttft_s"] / len(rs) / len(plan.prompts) * 1e3,
            "wire_bytes_per_token": tot["wire_bytes"] / tot["tokens"],
            "round_trips_per_token": tot["round_trips"] / tot["tokens"],
            "fallback_steps": tot["fallback_steps"],
            "breakdown": breakdown(metrics[key], steps, tot["tokens"], tot["wall_s"]),
        }
    return out


def dense_sweep(services, plan: Plan) -> dict:
    """Wire bytes per token and tok/s with dense q (and dense p back), vs the sparse default."""
    client = Client(services.address("orchestrator"))
    prompts = plan.prompts[: plan.dense_prompts]
    out = {}
    for t in TEMPERATURES:
        for g in [0, *plan.gammas]:
            for dense in (False, True):
                res = run_set(client, prompts, plan.max_new_tokens, t, g, 0, dense=dense)
                out[f"{g}@{t:g}@{'dense' if dense else 'sparse'}"] = {
                    "gamma": g,
                    "temperature": t,
                    "dense": dense,
                    "wire_bytes_per_token": res["wire_bytes"] / res["tokens"],
                    "tok_s": res["tok_s"],
                }
    client.close()
    return out


def rtt_sweep(services, plan: Plan, gammas: dict[float, int]) -> dict:
    """Added RTT between the orchestrator and both services, via delay proxies."""
    proxies = ProxyGroup()
    try:
        d_addr = proxies.add(services.address("draft"))
        t_addr = proxies.add(services.address("target"))
        address, _ = services.start_orchestrator("orchestrator-proxied", d_addr, t_addr)
        client = Client(address)
        prompts = plan.prompts[: plan.rtt_prompts]
        for t in TEMPERATURES:  # warm-up through the proxies
            client.generate(prompts[0], 8, t, gammas[t], 0)
        out = {}
        for rtt in plan.rtts_ms:
            proxies.set_rtt_ms(rtt)
            measured = info_rtt_ms(d_addr)
            configs = [(t, g) for t in TEMPERATURES for g in (0, gammas[t])]
            runs: dict[str, list[float]] = {f"{g}@{t:g}": [] for t, g in configs}
            for r in range(plan.rtt_repeats):
                for i in range(len(configs)):
                    t, g = configs[(i + r) % len(configs)]
                    res = run_set(client, prompts, plan.max_new_tokens, t, g, r)
                    runs[f"{g}@{t:g}"].append(res["tok_s"])
            row = {"rtt_ms": rtt, "info_call_ms": round(measured, 3)}
            for t in TEMPERATURES:
                plain = median(runs[f"0@{t:g}"])
                spec = median(runs[f"{gammas[t]}@{t:g}"])
                row[f"T{t:g}"] = {
                    "gamma": gammas[t],
                    "plain_tok_s": plain,
                    "spec_tok_s": spec,
                    "speedup": spec / plain,
                }
            out[f"{rtt:g}"] = row
            log(
                f"  RTT +{rtt:g} ms: "
                + ", ".join(f"T={t:g} {row[f'T{t:g}']['speedup']:.2f}x" for t in TEMPERATURES)
            )
        client.close()
        return {"proxied_orchestrator": address, "points": out}
    finally:
        services.stop_extra()
        proxies.close()


def concurrency_sweep(services, plan: Plan, gamma: int, temperature: float = 1.0) -> dict:
    """Aggregate tok/s with N clients generating at once (each its own channel)."""
    address = services.address("orchestrator")
    out = {}
    for n in plan.concurrency:
        modes = {"plain": 0, "spec": gamma}
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(plan.concurrency_repeats):
            for m, g in modes.items():
                results: list[dict] = []
                lock = threading.Lock()

                def worker(k: int, g=g, results=results, lock=lock, r=r) -> None:
                    c = Client(address)
                    try:
                        for q in range(plan.concurrency_requests):
                            p = plan.prompts[(k + q) % len(plan.prompts)]
                            res = c.generate(
                                p, plan.max_new_tokens, temperature, g, 1000 * r + 10 * k + q
                            )
                            with lock:
                                results.append(res)
                    finally:
                        c.close()

                threads = [threading.Thread(target=worker, args=(k,)) for k in range(n)]
                t0 = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                wall = time.perf_counter() - t0
                tokens = sum(x["tokens"] for x in results)
                runs[m].append(
                    {
                        "tok_s": tokens / wall,
                        "per_request_tok_s": median([x["tokens"] / x["wall_s"] for x in results]),
                        "requests": len(results),
                    }
                )
        row = {"clients": n}
        for m in modes:
            row[m] = {
                "gamma": modes[m],
                "tok_s": median([x["tok_s"] for x in runs[m]]),
                "per_request_tok_s": median([x["per_request_tok_s"] for x in runs[m]]),
            }
        row["speedup"] = row["spec"]["tok_s"] / row["plain"]["tok_s"]
        out[str(n)] = row
        log(
            f"  {n} client(s): plain {row['plain']['tok_s']:.1f} tok/s, "
            f"spec {row['spec']['tok_s']:.1f} tok/s"
        )
    return {"temperature": temperature, "gamma": gamma, "points": out}


# ---- putting it together -------------------------------------------------------------------
def _theory(sweep: dict, alphas: dict[float, float], c: float, verify: dict) -> None:
    """Speedup over the sweep's own plain row, and the formula's value, row by row."""
    for t, a in alphas.items():
        if f"0@{t:g}" not in sweep:
            continue
        plain = sweep[f"0@{t:g}"]["tok_s"]
        for v in sweep.values():
            if v["temperature"] != t:
                continue
            g = v["gamma"]
            v["speedup"] = v["tok_s"] / plain
            if not g:
                continue
            e = expected_tokens_per_step(a, g)
            v["alpha"] = a
            v["expected_tokens_per_step"] = e
            v["theoretical_speedup"] = expected_speedup(a, g, c)
            v["theoretical_speedup_verify_cost"] = e / (g * c + verify.get(str(g), 1.0))
            v["fraction_of_theoretical"] = v["speedup"] / v["theoretical_speedup"]


def _best(sweep: dict, t: float) -> int:
    spec = [v for v in sweep.values() if v["temperature"] == t and v["gamma"] > 0]
    return max(spec, key=lambda v: v["tok_s"])["gamma"]


def derive(results: dict) -> None:
    """Speedups, theoretical values and the best gamma, from the measured numbers."""
    sweep = results["services"]
    an = results["analysis"]
    c, verify = an["cost"]["c"], an["cost"]["verify_cost_ratio"]
    _theory(sweep, {0.0: an["quality"]["greedy_agreement"], 1.0: an["alpha_used"]}, c, verify)
    results["best_gamma"] = {f"{t:g}": _best(sweep, t) for t in TEMPERATURES}
    wide = results.get("services_wide")
    if wide:
        k = str(wide["wire_top_k"])
        alpha_k = an["quality"]["alpha_by_wire_top_k"].get(k, an["quality"]["alpha"])
        _theory(wide["rows"], {1.0: alpha_k}, c, verify)
        wide["best_gamma"] = _best(wide["rows"], 1.0)
    hf = results.get("hf", {}).get("results", {})
    for t in TEMPERATURES:
        base = hf.get(f"hf_plain@{t:g}")
        for v in hf.values():
            if v["temperature"] == t and base:
                v["speedup_vs_hf_plain"] = v["tok_s"] / base["tok_s"]
                v["speedup_vs_services_plain"] = v["tok_s"] / sweep[f"0@{t:g}"]["tok_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    ap.add_argument("--out", help="results folder (default results/<timestamp>)")
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--prompts", help="a JSON list of prompts or one prompt per line")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (services and in-process)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads of each service and of the in-process runs",
    )
    ap.add_argument(
        "--draft-threads",
        type=int,
        help="torch threads of the draft service only (default: --threads)",
    )
    ap.add_argument("--max-new-tokens", type=int, help="tokens per request (64; --quick 12)")
    ap.add_argument("--repeats", type=int, help="repeats per configuration (3; --quick 1)")
    ap.add_argument(
        "--wide-top-k",
        action="store_true",
        help="also sweep T=1 through an orchestrator with the wire_top_k that keeps alpha "
        "within 0.01 of the untruncated q (about 4 more minutes)",
    )
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)

    for path in (args.draft, args.target):
        if not Path(path).exists():
            print(f"error: model directory {path} does not exist", file=sys.stderr)
            return 2
    plan = Plan.make(load_prompts(args.prompts), args.quick, args.max_new_tokens)
    if args.repeats:
        plan.repeats = args.repeats
    plan.wide_sweep = args.wide_top_k
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else REPO / "results" / stamp
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict = {
        "machine": machine_info(args.device),
        "settings": {
            "quick": args.quick,
            "device": args.device,
            "dtype": args.dtype,
            "torch_threads": args.threads,
            "draft_torch_threads": args.draft_threads or args.threads,
            "prompts": plan.prompts,
        }
        | {k: v for k, v in asdict(plan).items() if k != "prompts"},
    }

    log(f"1/5 analyzing the pair ({len(plan.prompts)} prompts)")
    pair = analyze_mod.load_pair(args.draft, args.target, args.device, args.dtype)
    an = analyze_mod.analyze(
        args.draft,
        args.target,
        plan.prompts,
        1.0,
        plan.analyze_tokens,
        args.threads,
        args.device,
        args.dtype,
        plan.analyze_rounds,
        plan.analyze_steps,
        pair=pair,
    )
    results["analysis"] = an
    results["models"] = {"draft": an["draft"], "target": an["target"]}
    log(
        f"  alpha {an['alpha_used']} (T=1, top-{an['quality']['wire_top_k']}), greedy agreement "
        f"{an['quality']['greedy_agreement']}, c {an['cost']['c']}, "
        f"recommended gamma {an['recommended_gamma']}"
    )

    log("2/5 Hugging Face generate in-process (plain and assisted)")
    results["hf"] = hf_benchmark(*pair, plan, fixed_gamma=an["recommended_gamma"])
    del pair
    gc.collect()

    log("3/5 services: plain (gamma 0) and gamma " + ",".join(map(str, plan.gammas)))
    services = start_services(
        out, args.draft, args.target, args.device, args.dtype, args.threads, args.draft_threads
    )
    try:
        results["services"] = services_sweep(services, plan)
        k = an["recommended_wire_top_k"]
        vocab = an["target"]["vocab_size"] or 0
        if plan.wide_sweep and k != an["quality"]["wire_top_k"] and k < vocab:
            log(
                f"  T=1 again through an orchestrator with wire_top_k {k} (alpha "
                f"{an['quality']['alpha_by_wire_top_k'][str(k)]} instead of {an['alpha_used']})"
            )
            address, mport = services.start_orchestrator(
                "orchestrator-wide",
                services.address("draft"),
                services.address("target"),
                {"orchestrator.wire_top_k": k},
            )
            rows = services_sweep(services, plan, address, mport, temperatures=(1.0,))
            services.stop_extra()
            results["services_wide"] = {"wire_top_k": k, "rows": rows}
        derive(results)
        best = {float(t): g for t, g in results["best_gamma"].items()}
        log(f"  best gamma: {results['best_gamma']}; dense vs sparse wire")
        results["wire"] = dense_sweep(services, plan)
        log("4/5 added round-trip time " + ",".join(f"{x:g}" for x in plan.rtts_ms) + " ms")
        results["rtt"] = rtt_sweep(services, plan, best)
        log("5/5 concurrency " + ",".join(map(str, plan.concurrency)))
        results["concurrency"] = concurrency_sweep(services, plan, best[1.0])
    finally:
        services.stop()
    results["machine"]["load_average_end"] = list(__import__("os").getloadavg())
    results["seconds"] = round(time.perf_counter() - started, 1)

    from .report import markdown, summary

    (out / "results.json").write_text(json.dumps(results, indent=2, default=float))
    if not args.no_plots:
        from .plots import make_plots

        results["plots"] = make_plots(results, out)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=float))
    (out / "results.md").write_text(markdown(results))
    print(summary(results))
    log(f"done in {results['seconds']:.0f} s: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
