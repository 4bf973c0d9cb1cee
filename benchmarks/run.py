"""specdec against what a user would pick instead, side by side in one run.

  python -m benchmarks.run [--quick] [--out results/<timestamp>] [--draft DIR] [--target DIR]
      [--sections analysis,hf,services,pinned,head_to_head,inprocess,rtt,concurrency,wire,settings]

Same pair, prompts and sampling settings (greedy, and temperature 1 without
top-k/top-p) everywhere; every configuration is repeated and the median over
repeats is reported; repeats are interleaved across configurations, so a slow
spell of the machine hits all of them alike. Sections, in order:

1. ``analysis``: the pair in-process: alpha, c, v(g) and the cost-model bound.
2. ``hf``: transformers in-process: plain ``generate()`` and assisted generation
   (``assistant_model=draft``, fixed k and its defaults), on both cores and on
   one core (what a user with only the target's machine gets); and, for
   reference, the same with the services' oneDNN-packed linear layers
   (``specdec.runtime.packed_linear``), which stock transformers does not use.
3. ``services``: the three services sharing the machine's cores (the default
   deployment here): plain decoding through the target service (gamma 0),
   sequential and overlapped specdec at every gamma, and adaptive; with the
   per-step breakdown (forward passes vs everything else).
4. ``pinned``: the same with each service on its own core (the draft and the
   orchestrator on one, the target on the other), standing for separate machines.
4b. ``head_to_head``: issue 15's and issue 10's comparisons with transformers
   again, both sides in the same rounds (``benchmarks.head_to_head``): the
   sections above run minutes apart, and this VM's speed can move between them.
   Its shared part also measures an orchestrator with both models in its process
   (``orchestrator.local_models``), with issue 15's goals as "15, one process".
5. ``inprocess``: the engine with draft and target in one process (no network),
   the reference for what the network and gRPC cost.
6. ``rtt``: added network round-trip time through the delay proxy (pinned).
7. ``concurrency``: 1-32 clients at once: plain batched decoding and specdec, in
   rounds (each client sends its requests, the round ends with the slowest) and
   sustained (back to back; tokens streamed inside a window).
8. ``wire``: bytes on the wire per token and acceptance by q's shape, the shapes'
   rounds interleaved; a tiny random model with a 151,936-token vocabulary.
9. ``settings``: the thread and affinity settings tried, and their effect.

Writes results.json, results.md and PNG plots into the output folder and
prints a summary. Benchmarks are programs, not tests: they print and save.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.local.proxy import ProxyGroup
from specdec.local.stack import nice_process
from specdec.runtime import packed_linear

from . import analyze as analyze_mod
from .common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    REPO,
    Client,
    info_rtt_ms,
    load_prompts,
    machine_info,
    rotated_rounds,
    start_services,
)

TEMPERATURES = (0.0, 1.0)
SECTIONS = (
    "analysis",
    "hf",
    "services",
    "pinned",
    "head_to_head",
    "inprocess",
    "rtt",
    "concurrency",
    "wire",
    "settings",
)
DRAFT_CORE, TARGET_CORE = 0, 1  # pinned: draft, orchestrator and the client / the target
# Pinned, the orchestrator and this client (the front) share the draft's core at this
# niceness: they take its idle time, and the draft, which on separate machines they
# never delay, runs first ("Where the orchestrator sits" in docs/benchmarks.md).
FRONT_NICE = 10


@dataclass
class Plan:
    prompts: list[str]
    max_new_tokens: int = 64
    repeats: int = 3
    gammas: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6])
    hf_ks: list[int] = field(default_factory=lambda: [2, 3, 4, 5, 6])
    rtts_ms: list[float] = field(default_factory=lambda: [0.0, 2.0, 5.0, 10.0, 20.0])
    rtt_full_sweep_ms: list[float] = field(default_factory=lambda: [0.0, 2.0, 10.0])
    rtt_prompts: int = 3
    rtt_tokens: int = 48
    # Rounds per RTT point and per client count. One full run's rounds move by 10-20%
    # (docs/benchmarks.md, "A full run with paired rounds"); with 2 rounds the held-out
    # best fixed gamma is picked from one round. 4 and 3 add about 8 minutes.
    rtt_repeats: int = 4
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    concurrency_requests: int = 2
    concurrency_repeats: int = 3
    sustained_warm_s: float = 2.0  # per sustained round: not counted, then the window
    sustained_window_s: float = 5.0
    wire_ks: list[int] = field(default_factory=lambda: [64, 256, 1024])
    # head_to_head: transformers and the services in the same rounds (issues 15 and 10)
    h2h_ks: list[int] = field(default_factory=lambda: [3, 4, 5, 6])
    h2h_gammas: list[int] = field(default_factory=lambda: [2, 3, 4, 5])
    h2h_rounds: int = 4
    analyze_tokens: int = 64
    analyze_rounds: int = 5
    analyze_steps: int = 60
    all_settings: bool = True  # quick: only the default and the pinned one

    @classmethod
    def make(cls, prompts: list[str], quick: bool, max_new_tokens: int | None) -> Plan:
        if not quick:
            return cls(prompts[:8], max_new_tokens or 64)
        return cls(
            prompts[:2],
            max_new_tokens or 12,
            repeats=1,
            gammas=[1, 3],
            hf_ks=[3],
            rtts_ms=[0.0, 5.0],
            rtt_full_sweep_ms=[0.0],
            rtt_prompts=1,
            rtt_tokens=12,
            rtt_repeats=1,
            concurrency=[1, 4],
            concurrency_requests=1,
            concurrency_repeats=1,
            sustained_warm_s=0.5,
            sustained_window_s=1.0,
            wire_ks=[64],
            h2h_ks=[3],
            h2h_gammas=[3],
            h2h_rounds=1,
            analyze_tokens=12,
            analyze_rounds=1,
            analyze_steps=10,
            all_settings=False,
        )


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- measuring one set of configurations --------------------------------------------------
def seeded(fields: dict, seed: int) -> dict:
    """A request's fields with ``seed`` added, unless they name a seed (None: unseeded)
    or leave gamma to the orchestrator (``"gamma": None``). The orchestrator chooses
    gamma only for a request with neither gamma nor seed; a seeded one, reproducible,
    takes the default gamma (``orchestrator.gamma``), and an "adaptive" row given a
    seed would measure that instead."""
    if "seed" in fields or ("gamma" in fields and fields["gamma"] is None):
        return dict(fields)
    return {**fields, "seed": seed}


def _run_prompts(client: Client, prompts, max_new_tokens: int, fields: dict, repeat: int):
    """The prompts one after the other; totals over them."""
    total: dict[str, float] = {}
    for j, prompt in enumerate(prompts):
        f = seeded(fields, 1000 * repeat + j)  # the same draws every repeat
        r = client.generate(prompt, max_new_tokens, **f)
        for k, v in r.items():
            if isinstance(v, int | float):
                total[k] = total.get(k, 0.0) + v
    return total


def measure(
    client: Client | dict[str, Client], configs: dict[str, dict], prompts, max_new_tokens, repeats
) -> dict:
    """Each configuration's median tok/s and its totals, repeats interleaved and rotated.
    ``client``: one for every configuration, or each configuration's own (by name)."""
    names = list(configs)
    via = client if isinstance(client, dict) else dict.fromkeys(names, client)
    for name in names[:: max(1, len(names) // 4)]:  # warm every kind of call
        _run_prompts(via[name], prompts[:1], 8, configs[name], 0)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r, name in rotated_rounds(names, repeats):
        runs[name].append(_run_prompts(via[name], prompts, max_new_tokens, configs[name], r))
    return {name: summarize(runs[name], configs[name]) for name in names}


def overhead_ms(total: dict) -> float:
    """Issue 15's orchestration overhead: a step's wall time minus its draft and
    target forward time, ms per step, from the responses' stats summed over runs."""
    fwd = total["draft_forward_s"] + total["target_forward_s"]
    return (total["steps_s"] - fwd) / (total["steps"] or 1) * 1e3


def summarize(rs: list[dict], fields: dict) -> dict:
    tot = {k: sum(x.get(k, 0.0) for x in rs) for k in rs[0]}
    steps = tot["steps"] or 1
    judged = tot.get("judged", 0.0)
    draft_fwd, target_fwd = tot["draft_forward_s"], tot["target_forward_s"]
    return {
        "fields": fields,
        "tok_s": median([x["tokens"] / x["wall_s"] for x in rs]),
        "tok_s_runs": [round(x["tokens"] / x["wall_s"], 2) for x in rs],
        "tokens": tot["tokens"] / len(rs),
        "tokens_per_step": tot["tokens"] / steps,
        "alpha": tot["accepted"] / judged if judged else None,
        "acceptance_rate": tot["accepted"] / tot["drafted"] if tot["drafted"] else None,
        "mean_gamma": tot["gamma_sum"] / steps,
        "overlapped_share": tot["overlapped_steps"] / steps,
        "fallback_steps": tot["fallback_steps"],
        "wire_bytes_per_token": tot["wire_bytes"] / tot["tokens"] if tot["tokens"] else 0.0,
        "ms_per_step": {
            "step": tot["steps_s"] / steps * 1e3,
            "draft_forward": draft_fwd / steps * 1e3,
            "target_forward": target_fwd / steps * 1e3,
            "overhead": overhead_ms(tot),
        },
        # Per generated token: a plain step may be a run of several tokens.
        "overhead_ms_per_token": (tot["steps_s"] - draft_fwd - target_fwd) / tot["tokens"] * 1e3
        if tot["tokens"]
        else 0.0,
        "ms_per_token_outside_steps": (tot["wall_s"] - tot["steps_s"]) / tot["tokens"] * 1e3
        if tot["tokens"]
        else 0.0,
    }


def spec_configs(t: float, gammas: list[int], overlap: bool = True, plain: bool = True) -> dict:
    """plain, sequential and overlapped at every gamma, and adaptive, at temperature t."""
    out: dict[str, dict] = {}
    if plain:
        out[f"plain@{t:g}"] = {"temperature": t, "gamma": 0}
    for g in gammas:
        out[f"seq{g}@{t:g}"] = {"temperature": t, "gamma": g, "overlap": False}
        if overlap:
            out[f"ovl{g}@{t:g}"] = {"temperature": t, "gamma": g, "overlap": True}
    # Adaptive: gamma left unset and no seed (a seeded request keeps a fixed gamma).
    out[f"adaptive@{t:g}"] = {"temperature": t, "gamma": None, "seed": None}
    return out


def best(rows: dict, t: float, prefix: str) -> tuple[str, dict]:
    cands = {k: v for k, v in rows.items() if k.startswith(prefix) and k.endswith(f"@{t:g}")}
    return max(cands.items(), key=lambda kv: kv[1]["tok_s"])


# ---- 2. transformers in-process -----------------------------------------------------------
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
    t0 = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    return out.shape[1] - ids.shape[1], time.perf_counter() - t0


@contextlib.contextmanager
def assistant_k(draft, k: int | None) -> Iterator[None]:
    """Assisted generation drafts a fixed k tokens a step with no confidence threshold
    (k > 0), or with transformers' defaults (None, or k <= 0); the defaults after."""
    cfg = draft.generation_config
    defaults = (
        cfg.num_assistant_tokens,
        cfg.num_assistant_tokens_schedule,
        cfg.assistant_confidence_threshold,
    )
    if k is not None and k > 0:
        cfg.num_assistant_tokens = k
        cfg.num_assistant_tokens_schedule = "constant"
        cfg.assistant_confidence_threshold = 0.0
    try:
        yield
    finally:
        (
            cfg.num_assistant_tokens,
            cfg.num_assistant_tokens_schedule,
            cfg.assistant_confidence_threshold,
        ) = defaults


@contextlib.contextmanager
def torch_on(threads: int, cores: set[int] | None) -> Iterator[None]:
    """This process with ``threads`` torch threads on ``cores`` (None: where it is);
    both as they were after."""
    old_threads, old_cores = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(threads)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        os.sched_setaffinity(0, old_cores)


def hf_benchmark(
    tok, draft, target, plan: Plan, threads: int, cores: set[int] | None, packed: bool = False
) -> dict:
    """tok/s of plain and assisted generate() (fixed k, and its defaults) per temperature;
    with ``packed``, both models' linear layers packed as the services pack them."""
    with torch_on(threads, cores):
        try:
            if packed:
                for m in (draft, target):
                    packed_linear.pack_model(m)
            ids = [tok(p, return_tensors="pt")["input_ids"] for p in plan.prompts]
            modes = [("plain", None)] + [(f"assisted{k}", k) for k in plan.hf_ks]
            modes.append(("default", -1))
            configs = [(m, k, t) for t in TEMPERATURES for m, k in modes]
            runs: dict[str, list[float]] = {f"{m}@{t:g}": [] for m, _, t in configs}
            hf_generate(target, ids[0], 4, 0.0, 0, draft)
            for r in range(plan.repeats):
                for i in range(len(configs)):
                    m, k, t = configs[(i + r) % len(configs)]
                    tokens = secs = 0.0
                    with assistant_k(draft, k):
                        for j, x in enumerate(ids):
                            n, dt = hf_generate(
                                target,
                                x,
                                plan.max_new_tokens,
                                t,
                                1000 * r + j,
                                assistant=None if k is None else draft,
                            )
                            tokens, secs = tokens + n, secs + dt
                    runs[f"{m}@{t:g}"].append(tokens / secs)
        finally:
            for m in (draft, target):
                packed_linear.uninstall(m)
    return {name: {"tok_s": median(v), "tok_s_runs": v} for name, v in runs.items()}


# ---- 3/4. the services --------------------------------------------------------------------
@contextlib.contextmanager
def proxied_services(out: Path, settings: dict[str, dict] | None = None) -> Iterator[tuple]:
    """One draft and one target (one thread each), each behind a delay proxy:
    (stack, proxies, draft's proxied address, target's). Stopped, and this process
    unpinned, on the way out. ``settings``: as ``start_services`` takes them."""
    from .common import DEFAULT_DRAFT, DEFAULT_TARGET, start_services

    stack = start_services(
        out, str(DEFAULT_DRAFT), str(DEFAULT_TARGET), threads=1, draft_threads=1, settings=settings
    )
    proxies = ProxyGroup()
    try:
        pd, pt = proxies.add(stack.address("draft")), proxies.add(stack.address("target"))
        yield stack, proxies, pd, pt
    finally:
        stack.stop()
        proxies.close()
        unpin_self()


def pin_stack(stack, front_nice: int = FRONT_NICE) -> None:
    """Each service on its own core: the draft (with the orchestrator and this client,
    at ``front_nice``) on one, the target on the other."""
    stack.pin("draft", {DRAFT_CORE})
    stack.pin("target", {TARGET_CORE})
    place_front(stack, {DRAFT_CORE}, front_nice)


def place_front(stack, cpus: set[int], niceness: int) -> None:
    """The orchestrator and this client on ``cpus``, at ``niceness``. Lowering a
    niceness needs CAP_SYS_NICE (PermissionError)."""
    stack.pin("orchestrator", cpus, niceness)
    os.sched_setaffinity(0, cpus)
    nice_process(os.getpid(), niceness)


def unpin_self() -> None:
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    _renice(os.getpid())


def unpin_stack(stack) -> None:
    """Every process of ``stack`` (extra orchestrators too) and this one back on every
    core, at niceness 0 where allowed."""
    every = set(range(os.cpu_count() or 1))
    for role in ("draft", "target", "orchestrator"):
        stack.pin(role, every)
    stack.pin_extra(every)
    for proc in [stack.proc("orchestrator"), *stack.extra]:
        _renice(proc.pid)
    unpin_self()


def _renice(pid: int) -> None:
    try:
        nice_process(pid, 0)
    except PermissionError:  # (raised by the front's niceness; lowering needs CAP_SYS_NICE)
        log(f"process {pid} stays at niceness {os.getpriority(os.PRIO_PROCESS, pid)}")


def services_section(stack, plan: Plan, address: str | None = None) -> dict:
    client = Client(address or stack.orchestrator_address)
    configs = {}
    for t in TEMPERATURES:
        configs |= spec_configs(t, plan.gammas)
    rows = measure(client, configs, plan.prompts, plan.max_new_tokens, plan.repeats)
    client.close()
    return rows


def front_on_target_section(stack, plan: Plan, pinned: dict) -> dict:
    """The pinned stack with the orchestrator and this client moved to the target's
    core: sequential and overlapped at the gamma where overlapped did best. With the
    front on the draft's core (``pin_stack``) the orchestrator's and the client's
    work after each verdict competes with a sequential step's drafting, and on the
    target's core with an overlapped step's next verify: each placement slows one of
    the two modes (``benchmarks.placement``; docs/benchmarks.md, "Where the
    orchestrator sits")."""
    place_front(stack, {TARGET_CORE}, FRONT_NICE)
    configs = {}
    for t in TEMPERATURES:
        g = pinned[best(pinned, t, "ovl")[0]]["fields"]["gamma"]
        configs |= {k: v for k, v in spec_configs(t, [g], plain=False).items() if k[0] in "so"}
    client = Client(stack.orchestrator_address)
    rows = measure(client, configs, plan.prompts, plan.max_new_tokens, plan.repeats)
    client.close()
    return rows


# ---- 5. in-process: no network -------------------------------------------------------------
def inprocess_section(draft_dir: str, target_dir: str, plan: Plan, gammas: dict) -> dict:
    """The engine with local ports in this process: the same code minus gRPC and network."""
    sys.path.insert(0, str(REPO))
    from tests.inprocess import in_process

    torch.set_num_threads(1)
    out: dict[str, dict] = {}

    async def scenario():
        async with in_process(draft_dir, target_dir) as system:
            configs = {}
            for t in TEMPERATURES:
                configs[f"plain@{t:g}"] = {"temperature": t, "gamma": 0}
                g = gammas[t]
                configs[f"seq{g}@{t:g}"] = {"temperature": t, "gamma": g, "overlap": False}
            runs: dict[str, list[float]] = {k: [] for k in configs}
            for r in range(plan.repeats):
                for name, fields in configs.items():
                    tokens = secs = 0.0
                    for j, p in enumerate(plan.prompts):
                        t0 = time.perf_counter()
                        ids, _, stats = await system.generate(
                            prompt=p,
                            max_new_tokens=plan.max_new_tokens,
                            seed=1000 * r + j,
                            **fields,
                        )
                        secs += time.perf_counter() - t0
                        tokens += len(ids)
                    runs[name].append(tokens / secs)
            for name, v in runs.items():
                out[name] = {"fields": configs[name], "tok_s": median(v), "tok_s_runs": v}

    asyncio.run(scenario())
    return out


# ---- 6. added round-trip time -----------------------------------------------------------------
# The orchestrator behind the delay proxies runs as on separate machines, as deploy/'s
# gpu overlay configures it: pipelines where the hop is long (``benchmarks.adaptive_check``
# measures the same section's criterion with the same settings).
RTT_SETS = {"orchestrator.pipeline": "true"}


def rtt_section(stack, plan: Plan, best_gamma: dict) -> dict:
    # The delay proxies stand for the network. Made here, after ``pin_stack``, their
    # threads would inherit this process's pin and niceness (the draft's core, 10),
    # and a held chunk would wait for the draft's work: they put themselves on every
    # core at niceness 0 (``FaultProxy``), as the other benchmarks' proxies, made
    # before any pin, always were. ``late_ms``: how late they forwarded.
    proxies = ProxyGroup()
    try:
        d_addr = proxies.add(stack.address("draft"))
        t_addr = proxies.add(stack.address("target"))
        address, _ = stack.start_orchestrator("orchestrator-proxied", d_addr, t_addr, RTT_SETS)
        stack.pin_extra(DRAFT_CORE, FRONT_NICE)
        client = Client(address)
        prompts = plan.prompts[: plan.rtt_prompts]
        out = {}
        for rtt in plan.rtts_ms:
            proxies.set_rtt_ms(rtt)
            configs: dict[str, dict] = {}
            for t in TEMPERATURES:
                if rtt in plan.rtt_full_sweep_ms:
                    configs |= spec_configs(t, plan.gammas)
                else:
                    g = best_gamma[t]
                    configs |= spec_configs(t, [g])
            proxies.lateness_ms()  # (from here)
            rows = measure(client, configs, prompts, plan.rtt_tokens, plan.rtt_repeats)
            out[f"{rtt:g}"] = {
                "rtt_ms": rtt,
                "late_ms": proxies.lateness_ms(),  # the emulation's own error, per hop
                "info_call_ms": info_rtt_ms(d_addr),
                "rows": rows,
            }
            log(
                f"  RTT +{rtt:g} ms: "
                + ", ".join(
                    f"T={t:g} plain {rows[f'plain@{t:g}']['tok_s']:.0f} "
                    f"adaptive {rows[f'adaptive@{t:g}']['tok_s']:.0f} tok/s"
                    for t in TEMPERATURES
                )
            )
        client.close()
        return out
    finally:
        stack.stop_extra()
        proxies.close()


# ---- 7. concurrent clients ------------------------------------------------------------------
def clients_round(
    address: str, n: int, fields: dict, prompts, requests: int, max_new_tokens: int, r: int
) -> tuple[float, list[float]]:
    """n clients at once, each sending ``requests`` requests one after the other:
    (aggregate tok/s, every request's latency). Seeded per client and request
    (``seeded``)."""
    latencies: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(n)

    def client_loop(i: int) -> int:
        c = Client(address)
        barrier.wait()
        tokens = 0
        for k in range(requests):
            f = seeded(fields, 10_000 * r + 100 * i + k)
            res = c.generate(prompts[(i + k) % len(prompts)], max_new_tokens, **f)
            tokens += res["tokens"]
            with lock:
                latencies.append(res["wall_s"])
        c.close()
        return tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        tokens = sum(pool.map(client_loop, range(n)))
    return tokens / (time.perf_counter() - t0), latencies


def sustained_round(
    address: str,
    n: int,
    fields: dict,
    prompts,
    max_new_tokens: int,
    warm_s: float,
    window_s: float,
    r: int,
) -> float:
    """n clients sending requests back to back for warm_s + window_s seconds (each
    finishes the request it is in): tokens streamed inside the window per second.
    Seeded per round, client and request unless ``fields`` has a seed."""
    start = time.perf_counter() + 0.2  # every client's channel is up by then
    lo, hi = start + warm_s, start + warm_s + window_s
    counted = [0] * n

    def client(i: int) -> None:
        c = Client(address)
        while time.perf_counter() < start:
            time.sleep(0.001)
        k = 0
        while time.perf_counter() < hi:
            f = seeded(fields, 1_000_000 * r + 1000 * i + k)
            for tokens in c.stream(prompts[(i + k) % len(prompts)], max_new_tokens, **f):
                if lo <= time.perf_counter() < hi:
                    counted[i] += tokens
            k += 1
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counted) / window_s


def sustained_side_by_side(
    addresses: dict[str, str],
    clients: list[int],
    modes: dict[str, dict],
    prompts,
    max_new_tokens: int,
    repeats: int,
    warm_s: float,
    window_s: float,
) -> dict[str, list[float]]:
    """Sustained rounds (``sustained_round``) against two or more stacks (arm ->
    orchestrator address): for each client count and mode, ``repeats`` rounds per arm,
    the arms' order alternating round by round. {"<n> clients, <mode>, <arm>": tok/s}."""
    arms = list(addresses)
    rates: dict[str, list[float]] = {}
    for n in clients:
        for mode, fields in modes.items():
            for r in range(repeats):
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    rate = sustained_round(
                        addresses[arm], n, fields, prompts, max_new_tokens, warm_s, window_s, r
                    )
                    rates.setdefault(f"{n} clients, {mode}, {arm}", []).append(rate)
            key = f"{n} clients, {mode}"
            print(key + ": " + ", ".join(f"{a} {rates[f'{key}, {a}']}" for a in arms), flush=True)
    return rates


# The modes compared under concurrent load (T=1): here and in benchmarks.sustained.
CONCURRENCY_MODES = {
    "plain": {"temperature": 1.0, "gamma": 0},
    "adaptive": {"temperature": 1.0, "gamma": None, "seed": None},
    "seq4": {"temperature": 1.0, "gamma": 4, "overlap": False},
}


def concurrency_section(stack, plan: Plan) -> dict:
    address = stack.orchestrator_address
    modes = CONCURRENCY_MODES
    out = {}
    names = list(modes)
    for n in plan.concurrency:
        agg: dict[str, list[float]] = {m: [] for m in names}
        lat: dict[str, list[float]] = {m: [] for m in names}
        for r, mode in rotated_rounds(names, plan.concurrency_repeats):
            tok_s, latencies = clients_round(
                address, n, modes[mode], plan.prompts, plan.concurrency_requests,
                plan.max_new_tokens, r,
            )  # fmt: skip
            agg[mode].append(tok_s)
            lat[mode].append(median(latencies))
        # The same modes under sustained load: back to back, counted in a window
        # (no round waiting for its slowest client; benchmarks.sustained).
        held: dict[str, list[float]] = {m: [] for m in names}
        for r, mode in rotated_rounds(names, plan.concurrency_repeats):
            held[mode].append(
                sustained_round(
                    address,
                    n,
                    modes[mode],
                    plan.prompts,
                    plan.max_new_tokens,
                    plan.sustained_warm_s,
                    plan.sustained_window_s,
                    r,
                )  # fmt: skip
            )
        row = {
            m: {
                "tok_s": median(agg[m]),
                "p50_latency_s": median(lat[m]),
                "runs": agg[m],
                "sustained_tok_s": median(held[m]),
                "sustained_runs": held[m],
            }
            for m in names
        }
        out[str(n)] = row
        log(
            f"  {n} clients: "
            + ", ".join(
                f"{m} {v['tok_s']:.0f} tok/s p50 {v['p50_latency_s']:.2f} s"
                f" (sustained {v['sustained_tok_s']:.0f})"
                for m, v in row.items()
            )
        )
    return out


# ---- 8. the wire -----------------------------------------------------------------------------
def wire_section(stack, plan: Plan, gamma: int) -> dict:
    """T=1 at gamma through orchestrators with other q shapes: bytes/token and alpha.
    Every shape's orchestrator runs at once and the rounds interleave them (the order
    rotating), so that a slow spell of the machine does not favour one shape."""
    shapes = {f"top{k}": {"orchestrator.wire_top_k": k} for k in plan.wire_ks}
    shapes["top1024_eps0.01"] = {"orchestrator.wire_top_k": 1024, "orchestrator.wire_eps": 0.01}
    shapes["hidden"] = {"orchestrator.wire_hidden": True}  # q as the draft's hidden states
    spec = {"temperature": 1.0, "gamma": gamma, "overlap": False}
    modes = {"spec": spec, "dense": {**spec, "dense": True}}
    clients, configs = {}, {}
    for name, sets in shapes.items():
        address, _ = stack.start_orchestrator(
            f"orchestrator-{name}", stack.address("draft"), stack.address("target"), sets
        )
        client = Client(address)
        for mode, fields in modes.items():
            clients[f"{name}|{mode}"], configs[f"{name}|{mode}"] = client, fields
    try:
        rows = measure(
            clients, configs, plan.prompts, plan.max_new_tokens, max(1, plan.repeats - 1)
        )
    finally:
        for client in set(clients.values()):
            client.close()
        stack.stop_extra()
    out = {}
    for name, sets in shapes.items():
        out[name] = {"settings": sets, "rows": {m: rows[f"{name}|{m}"] for m in modes}}
        spec_row = out[name]["rows"]["spec"]
        log(
            f"  {name}: {spec_row['tok_s']:.0f} tok/s, "
            f"{spec_row['wire_bytes_per_token']:.0f} B/token, alpha {spec_row['alpha']}"
        )
    return out


def large_vocab_wire(out: Path, plan: Plan, gamma: int) -> dict:
    """Bytes per token at T=1 on a tiny random pair with Qwen2.5's 151,936-token vocabulary:
    q as lists (the default top-k) and as hidden states (``specdec.hidden_q``)."""
    sys.path.insert(0, str(REPO))
    from specdec.local.stack import local_stack
    from tests.tiny import build_large_vocab_pair

    rows = {}
    with tempfile.TemporaryDirectory(prefix="specdec-bench-vocab-") as models:
        draft, target = build_large_vocab_pair(Path(models))
        with local_stack(
            out / "large-vocab",
            draft,
            target,
            log_dir=out / "logs" / "large-vocab",
            draft__hidden_q=True,
            target__draft_head=str(draft),
            orchestrator__wire_hidden=False,
        ) as st:
            hidden, _ = st.start_orchestrator(
                "orchestrator-hidden",
                st.address("draft"),
                st.address("target"),
                {"orchestrator.wire_hidden": True},
            )
            prompts = [[3, 1000, 70_000, 151_000, 42]]
            for wire, address in (("", st.orchestrator_address), (" hidden", hidden)):
                client = Client(address)
                for g in (1, gamma):
                    res = [
                        client.generate(
                            prompts[0], plan.max_new_tokens, temperature=1.0, gamma=g, seed=s
                        )
                        for s in range(3)
                    ]
                    tokens = sum(r["tokens"] for r in res)
                    judged = max(1, sum(r["judged"] for r in res))
                    rows[f"{g}{wire}"] = {
                        "wire_bytes_per_token": sum(r["wire_bytes"] for r in res) / tokens,
                        "alpha": sum(r["accepted"] for r in res) / judged,
                    }
                client.close()
    return {"vocab": 151_936, "rows": rows}


# ---- 9. thread and affinity settings -----------------------------------------------------------
SETTINGS = {
    "target 1 thread, 2 for plain passes, draft 1 (default)": {
        "threads": 1,
        "draft_threads": 1,
        "plain_threads": 2,
        "pin": False,
    },
    "target 1 thread, draft 1": {
        "threads": 1,
        "draft_threads": 1,
        "plain_threads": 0,
        "pin": False,
    },
    "target 2 threads, draft 1": {
        "threads": 2,
        "draft_threads": 1,
        "plain_threads": 0,
        "pin": False,
    },
    "target 2 threads, draft 2": {
        "threads": 2,
        "draft_threads": 2,
        "plain_threads": 0,
        "pin": False,
    },
    "pinned: target 1 thread on core 1, draft 1 on core 0": {
        "threads": 1,
        "draft_threads": 1,
        "plain_threads": 0,
        "pin": True,
    },
}


def settings_section(out: Path, args, plan: Plan) -> dict:
    results = {}
    for name, s in SETTINGS.items():
        if not (plan.all_settings or name.startswith("pinned") or name.endswith("(default)")):
            continue
        folder = out / "settings" / name.split(":")[0].replace(" ", "-").replace(",", "")
        folder.mkdir(parents=True, exist_ok=True)
        stack = start_services(folder, args.draft, args.target, threads=s["threads"],
                               draft_threads=s["draft_threads"],
                               plain_threads=s["plain_threads"])  # fmt: skip
        try:
            if s["pin"]:
                pin_stack(stack)
            client = Client(stack.orchestrator_address)
            configs = {
                "plain@0": {"temperature": 0.0, "gamma": 0},
                "seq4@0": {"temperature": 0.0, "gamma": 4, "overlap": False},
            }
            results[name] = measure(
                client, configs, plan.prompts, plan.max_new_tokens, plan.repeats
            )
            client.close()
        finally:
            unpin_self()
            stack.stop()
        log(
            f"  {name}: plain {results[name]['plain@0']['tok_s']:.1f}, "
            f"gamma 4 {results[name]['seq4@0']['tok_s']:.1f} tok/s"
        )
    return results


# ---- the run -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a 3-5 minute version (the smoke test)")
    ap.add_argument("--out", help="output folder (default results/<timestamp>)")
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--prompts", help="a JSON list of prompts or one prompt per line")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--before",
        help="JSON {label: {part: ms per step}}: an earlier release's step breakdown, "
        "measured on this machine, drawn beside this run's",
    )
    ap.add_argument(
        "--replot", metavar="DIR", help="only redo the report and plots of DIR/results.json"
    )
    args = ap.parse_args(argv)
    before = json.loads(Path(args.before).read_text()) if args.before else None
    if args.replot:
        return replot(Path(args.replot), before)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections: {sorted(unknown)}")
    plan = Plan.make(load_prompts(args.prompts), args.quick, args.max_new_tokens)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else REPO / "results" / stamp
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict = {
        "plan": asdict(plan) | {"quick": args.quick},
        "machine": machine_info("cpu"),
        "sections": sections,
        "front_nice": FRONT_NICE,  # pinned: the orchestrator's and the client's niceness
    }
    if before:
        results["before"] = before
    log(f"load average at start: {results['machine']['load_average']}")

    def save() -> None:
        results["seconds"] = round(time.perf_counter() - started, 1)
        results["machine"]["load_average_end"] = list(os.getloadavg())
        (out / "results.json").write_text(json.dumps(results, indent=2, default=float))

    torch.set_num_threads(2)
    pair = analyze_mod.load_pair(args.draft, args.target)
    if "analysis" in sections:
        log("analysis: alpha, c and v(g) in-process")
        results["analysis"] = analyze_mod.analyze(
            args.draft, args.target, plan.prompts, 1.0, plan.analyze_tokens, 1, "cpu", "float32",
            plan.analyze_rounds, plan.analyze_steps, pair=pair,
        )  # fmt: skip
        save()
    if "hf" in sections:
        log("transformers in-process: both cores (2 threads), then the target's core (1 thread)")
        results["hf"] = {
            "shared": hf_benchmark(*pair, plan, threads=2, cores=None),
            "target_core": hf_benchmark(*pair, plan, threads=1, cores={TARGET_CORE}),
            # For reference: what the services' packed linear layers do for transformers.
            "shared_packed": hf_benchmark(*pair, plan, threads=2, cores=None, packed=True),
            "target_core_packed": hf_benchmark(
                *pair, plan, threads=1, cores={TARGET_CORE}, packed=True
            ),
        }
        save()
    del pair
    gc.collect()

    best_gamma = {0.0: 4, 1.0: 4}
    if {"services", "concurrency", "wire"} & set(sections):
        log("services on shared cores: plain, sequential and overlapped gamma 1-6, adaptive")
        # Both services hold the draft's output layer for the wire section's hidden-state
        # wire; every orchestrator but that section's sends lists (wire_hidden false).
        # On shared cores, adaptive requests decode plain from 3 requests at once, as
        # configs/default.yaml (the local deployment on these cores) sets.
        hidden = {
            "draft": {"hidden_q": True},
            "target": {"draft_head": str(args.draft)},
            "orchestrator": {"wire_hidden": False, "adaptive_speculate_max_requests": 2},
        }
        stack = start_services(
            out / "shared", args.draft, args.target, threads=1, draft_threads=1, settings=hidden
        )
        try:
            if "services" in sections:
                results["services"] = services_section(stack, plan)
                for t in TEMPERATURES:
                    name, _ = best(results["services"], t, "seq")
                    best_gamma[t] = results["services"][name]["fields"]["gamma"]
                save()
            if "concurrency" in sections:
                log("concurrent clients " + ",".join(map(str, plan.concurrency)))
                results["concurrency"] = concurrency_section(stack, plan)
                save()
            if "wire" in sections:
                log("wire: q's shape against bytes and acceptance (T=1)")
                results["wire"] = wire_section(stack, plan, best_gamma[1.0])
                save()
        finally:
            stack.stop()
        if "wire" in sections:
            results["wire_large_vocab"] = large_vocab_wire(out, plan, best_gamma[1.0])
            save()
    if {"pinned", "rtt"} & set(sections):
        log("services pinned (standing for separate machines)")
        stack = start_services(out / "pinned", args.draft, args.target, threads=1, draft_threads=1)
        try:
            pin_stack(stack)
            if "pinned" in sections:
                results["pinned"] = services_section(stack, plan)
                save()
                log("pinned, the orchestrator and the client on the target's core")
                results["pinned_front_target"] = front_on_target_section(
                    stack, plan, results["pinned"]
                )
                pin_stack(stack)
                save()
            if "rtt" in sections:
                pinned = results.get("pinned", {})
                gammas = {
                    t: pinned[best(pinned, t, "ovl")[0]]["fields"]["gamma"] if pinned else 4
                    for t in TEMPERATURES
                }
                log("added round-trip time " + ",".join(f"{x:g}" for x in plan.rtts_ms) + " ms")
                results["rtt"] = rtt_section(stack, plan, gammas)
                save()
        finally:
            unpin_self()
            stack.stop()
    if "head_to_head" in sections:
        log("head to head: transformers and the services in the same rounds, shared and pinned")
        results["head_to_head"] = head_to_head_section(out, args, plan)
        save()
    if "inprocess" in sections:
        log("in-process engine (no network)")
        results["inprocess"] = inprocess_section(args.draft, args.target, plan, best_gamma)
        save()
    if "settings" in sections:
        log("thread and affinity settings")
        results["settings"] = settings_section(out, args, plan)
        save()

    report(results, out, plots=not args.no_plots, save=save)
    log(f"done in {results['seconds']:.0f} s: {out}")
    return 0


def head_to_head_section(out: Path, args, plan: Plan) -> dict:
    """``benchmarks.head_to_head`` on a stack of its own: issue 15's and issue 10's
    ratios to transformers, each from rounds that interleave both sides."""
    from . import head_to_head

    pair = analyze_mod.load_pair(args.draft, args.target)
    c = head_to_head.Choices(
        plan.prompts, plan.max_new_tokens, plan.h2h_rounds, plan.h2h_ks, plan.h2h_gammas,
        list(TEMPERATURES),
    )  # fmt: skip
    hf = head_to_head.Transformers(pair, plan.prompts, plan.max_new_tokens)
    stack = start_services(
        out / "head_to_head", args.draft, args.target, threads=1, draft_threads=1
    )
    try:
        return head_to_head.run_parts(stack, hf, ["shared", "pinned"], c, one_process=True)
    finally:
        stack.stop()


def report(results: dict, out: Path, plots: bool, save) -> None:
    """Derived numbers and criteria, the plots, results.md and the summary."""
    from .report import derive, markdown, summary

    derive(results)
    save()
    if plots:
        from .plots import make_plots

        results["plots"] = make_plots(results, out)
        save()
    (out / "results.md").write_text(markdown(results))
    print(summary(results))


def replot(out: Path, before: dict | None) -> int:
    """The report and plots again, from a finished run's results.json."""
    path = out / "results.json"
    results = json.loads(path.read_text())
    if before:
        results["before"] = before
    report(results, out, plots=True,
           save=lambda: path.write_text(json.dumps(results, indent=2, default=float)))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
