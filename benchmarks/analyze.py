"""Analyze a draft/target pair: acceptance rate, cost ratio, predicted speedup.

  python -m benchmarks.analyze --draft DIR --target DIR [--prompts FILE]
      [--temperature 1.0] [--new-tokens 64] [--threads 2] [--json OUT]

* alpha = E[sum_x min(p(x), q(x))] (1 - total variation between the target's
  p and the draft's q), per position along the target's own continuation of
  each prompt (sampled at the temperature) and overall; also with q truncated
  to the wire's top-k entries, which is the proposal the services really use;
* greedy agreement = fraction of positions where argmax p == argmax q, along
  the target's greedy continuation (alpha of greedy decoding);
* c = (time of one draft decode step with KV cache) / (time of one target
  decode step), measured in-process with ``specdec.runtime.ragged.RaggedRunner``: median
  of many steps after warm-up, draft and target interleaved;
* v(g) = (time of a target forward over g + 1 tokens) / (one decode step): the
  verify pass is not free on a CPU;
* the same costs as a sequential step meets them (``measure_cost_in_step``,
  ``cost["in_step"]``): gamma draft steps, each timed, then the verify pass,
  repeated, so that every draft step follows a target pass as it does in a
  step. On one machine the target's pass evicts the draft's weights and code
  from the shared caches, and the first draft step after it takes about twice
  a warm one; c_step(g) is the draft steps' total over g target decode steps,
  v_step(g) the verify pass after them. On separate machines the draft keeps
  its own caches: c holds there;
* both with the linear layers as the services run them: packed for oneDNN
  from the pass size each model's calibration picks
  (``specdec.runtime.packed_linear``; ``--stock-linear`` measures torch's own);
* predicted speedup per gamma from ``specdec.sampling.expected_speedup`` (the
  paper's formula) and, for reference, with the measured verify cost v(g).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from specdec.config import OrchestratorConfig
from specdec.runtime import packed_linear
from specdec.runtime.loading import load_model, load_tokenizer, tokenizer_fingerprint
from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV
from specdec.sampling import (
    SamplingParams,
    acceptance_rate,
    expected_speedup,
    expected_tokens_per_step,
    probs_from_logits,
    sparse_q,
)

from .common import DEFAULT_DRAFT, DEFAULT_TARGET, load_prompts, model_summary

GAMMAS = tuple(range(1, 9))
WIRE_TOP_K = OrchestratorConfig().wire_top_k  # the orchestrator's default
WIRE_KS = (32, 64, 128, 256, 512, 1024)  # alpha is also reported for these truncations


def load_pair(draft_dir: str, target_dir: str, device: str = "cpu", dtype: str = "float32"):
    """(tokenizer, draft, target), refusing a pair whose tokenizers differ."""
    tok = load_tokenizer(str(target_dir))
    if tokenizer_fingerprint(load_tokenizer(str(draft_dir))) != tokenizer_fingerprint(tok):
        raise SystemExit("draft and target tokenizers differ; they cannot be paired")
    draft = load_model(str(draft_dir), device, dtype)
    target = load_model(str(target_dir), device, dtype)
    return tok, draft, target


def _encode(tokenizer, prompt: str, device) -> torch.Tensor:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    return ids.to(device)


def _continue(model, ids: torch.Tensor, new_tokens: int, params: SamplingParams, seed: int):
    """The model's own continuation of ``ids`` ([1, n]) -> [1, n + m]."""
    torch.manual_seed(seed)
    kw = {"do_sample": False}
    if not params.greedy:
        kw = {"do_sample": True, "temperature": params.temperature, "top_k": 0, "top_p": 1.0}
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        pad_token_id=pad if pad is not None else 0,
        **kw,
    )


def _wire_q(logits: torch.Tensor, params: SamplingParams, k: int) -> torch.Tensor:
    """q as the draft service sends it (``sparse_q``: k entries at most, tail spread):
    logits [m, vocab] -> [m, vocab]."""
    return torch.stack([sparse_q(row, params, k, 0.0).dense(dtype=torch.float32) for row in logits])


@torch.inference_mode()
def measure_alpha(
    tokenizer, draft, target, prompts: list[str], temperature: float, new_tokens: int, seed: int = 0
) -> dict:
    """alpha at ``temperature`` and greedy agreement, per position and overall."""
    device = next(target.parameters()).device
    sample_params = SamplingParams(temperature=temperature)
    greedy = SamplingParams(temperature=0.0)
    by_pos_t: list[list[float]] = []
    by_pos_wire: list[list[float]] = []
    by_k: dict[int, list[float]] = {k: [] for k in WIRE_KS}
    by_pos_g: list[list[float]] = []
    for i, prompt in enumerate(prompts):
        ids = _encode(tokenizer, prompt, device)
        n = ids.shape[1]
        runs = [(greedy, by_pos_g, None)]
        if not sample_params.greedy:
            runs.append((sample_params, by_pos_t, by_pos_wire))
        for params, out, out_wire in runs:
            seq = _continue(target, ids, new_tokens, params, seed + i)
            if seq.shape[1] <= n:
                continue
            lt = target(input_ids=seq).logits[0, n - 1 : -1].float().cpu()  # [m, vocab]
            ld = draft(input_ids=seq).logits[0, n - 1 : -1].float().cpu()
            if params.greedy:
                out.append((lt.argmax(-1) == ld.argmax(-1)).float().tolist())
                continue
            p = probs_from_logits(lt, params)
            out.append(acceptance_rate(p, probs_from_logits(ld, params)).tolist())
            out_wire.append(acceptance_rate(p, _wire_q(ld, params, WIRE_TOP_K)).tolist())
            for k in WIRE_KS:
                by_k[k] += acceptance_rate(p, _wire_q(ld, params, k)).tolist()

    def per_position(rows: list[list[float]]) -> list[float]:
        width = max((len(r) for r in rows), default=0)
        cols = [[r[j] for r in rows if j < len(r)] for j in range(width)]
        return [round(statistics.fmean(c), 4) for c in cols]

    def overall(rows: list[list[float]]) -> float | None:
        flat = [x for r in rows for x in r]
        return round(statistics.fmean(flat), 4) if flat else None

    return {
        "temperature": temperature,
        "positions": sum(len(r) for r in (by_pos_t or by_pos_g)),
        "alpha": overall(by_pos_t) if by_pos_t else overall(by_pos_g),
        "alpha_by_position": per_position(by_pos_t) if by_pos_t else per_position(by_pos_g),
        "alpha_wire_top_k": overall(by_pos_wire) if by_pos_wire else overall(by_pos_g),
        "wire_top_k": WIRE_TOP_K,
        # alpha when q is truncated to its k most likely entries (the wire_top_k setting)
        "alpha_by_wire_top_k": {
            str(k): round(statistics.fmean(v), 4) for k, v in by_k.items() if v
        },
        "greedy_agreement": overall(by_pos_g),
        "greedy_agreement_by_position": per_position(by_pos_g),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step_times(model, prompt_ids: list[int], steps: int, warmup: int) -> list[float]:
    """Seconds of each single-token decode step with KV cache (after ``warmup`` steps)."""
    device = next(model.parameters()).device
    runner = RaggedRunner(model)
    kv = SessionKV()
    (logits,) = runner.forward([Feed(kv, prompt_ids, 1)])
    tok = int(logits[-1].argmax())
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        (logits,) = runner.forward([Feed(kv, [tok], 1)])
        _sync(device)
        dt = time.perf_counter() - t0
        tok = int(logits[-1].argmax())
        if i >= warmup:
            times.append(dt)
    return times


def forward_times(model, prompt_ids: list[int], width: int, repeats: int) -> float:
    """Median seconds of one forward over ``width`` new tokens with a cached prefix."""
    device = next(model.parameters()).device
    runner = RaggedRunner(model)
    kv = SessionKV()
    runner.forward([Feed(kv, prompt_ids, 0)])
    base = kv.length
    feed = prompt_ids[-width:] if len(prompt_ids) >= width else (prompt_ids * width)[:width]
    times = []
    for i in range(repeats + 3):
        _sync(device)
        t0 = time.perf_counter()
        runner.forward([Feed(kv, feed, width)])
        _sync(device)
        dt = time.perf_counter() - t0
        kv.truncate(base)
        if i >= 3:
            times.append(dt)
    return statistics.median(times)


@torch.inference_mode()
def measure_cost(
    tokenizer, draft, target, prompts: list[str], rounds: int, steps: int, warmup: int
) -> dict:
    """c = draft decode step / target decode step (medians), and the verify cost v(g)."""
    td, tt = [], []
    for r in range(rounds):
        ids = tokenizer(prompts[r % len(prompts)])["input_ids"]
        td += decode_step_times(draft, ids, steps, warmup)
        tt += decode_step_times(target, ids, steps, warmup)
    t_d, t_t = statistics.median(td), statistics.median(tt)
    ids = tokenizer(prompts[0])["input_ids"]
    one = forward_times(target, ids, 1, max(10, steps // 2))
    verify = {
        str(g): round(forward_times(target, ids, g + 1, max(10, steps // 2)) / one, 3)
        for g in GAMMAS
    }
    return {
        "draft_step_ms": round(t_d * 1e3, 4),
        "target_step_ms": round(t_t * 1e3, 4),
        "draft_step_ms_iqr": _iqr_ms(td),
        "target_step_ms_iqr": _iqr_ms(tt),
        "c": round(t_d / t_t, 4),
        "rounds": rounds,
        "steps_per_round": steps,
        "warmup_steps": warmup,
        "verify_cost_ratio": verify,
    }


@torch.inference_mode()
def measure_cost_in_step(tokenizer, draft, target, prompt: str, repeats: int) -> dict:
    """c and v(g) as a sequential step meets them, on one machine: for each gamma, g
    draft decode steps (each timed) then a verify pass over g + 1 tokens, in turn,
    both caches rolled back after each. Relative to a target decode step timed warm
    (back to back, as plain decoding runs): ``c_step`` = the g draft steps / (g
    decode steps), ``v_step`` = the verify pass / one decode step (medians), and
    ``draft_step_ms_by_position`` at the largest gamma."""
    ids = tokenizer(prompt)["input_ids"]
    one = forward_times(target, ids, 1, repeats)
    rd, rt = RaggedRunner(draft), RaggedRunner(target)
    kd, kt = SessionKV(), SessionKV()
    rd.forward([Feed(kd, ids, 0)])
    rt.forward([Feed(kt, ids, 0)])
    base_d, base_t = kd.length, kt.length
    device = next(target.parameters()).device
    c_step, v_step = {}, {}
    for g in GAMMAS:
        feed = (ids * (g + 1))[: g + 1]
        drafts, verifies, positions = [], [], [[] for _ in range(g)]
        for i in range(repeats + 3):
            kd.truncate(base_d)
            spent = 0.0
            for j in range(g):
                _sync(device)
                t0 = time.perf_counter()
                rd.forward([Feed(kd, [ids[j % len(ids)]], 1)])
                _sync(device)
                dt = time.perf_counter() - t0
                spent += dt
                if i >= 3:
                    positions[j].append(dt)
            kt.truncate(base_t)
            _sync(device)
            t0 = time.perf_counter()
            rt.forward([Feed(kt, feed, g + 1)])
            _sync(device)
            if i >= 3:
                drafts.append(spent)
                verifies.append(time.perf_counter() - t0)
        c_step[str(g)] = round(statistics.median(drafts) / (g * one), 4)
        v_step[str(g)] = round(statistics.median(verifies) / one, 3)
    return {
        "target_step_ms": round(one * 1e3, 4),
        "c_step": c_step,
        "v_step": v_step,
        # positions: the largest gamma's, the loop's last
        "draft_step_ms_by_position": [round(statistics.median(x) * 1e3, 4) for x in positions],
        "repeats": repeats,
    }


def _iqr_ms(xs: list[float]) -> list[float]:
    q = statistics.quantiles(xs, n=4)
    return [round(q[0] * 1e3, 4), round(q[2] * 1e3, 4)]


def predictions(alpha: float, alpha_greedy: float, c: float, verify: dict) -> list[dict]:
    rows = []
    for g in GAMMAS:
        v = verify.get(str(g), 1.0)
        e_t = expected_tokens_per_step(alpha, g)
        e_g = expected_tokens_per_step(alpha_greedy, g)
        rows.append(
            {
                "gamma": g,
                "tokens_per_step": round(e_t, 4),
                "speedup": round(expected_speedup(alpha, g, c), 4),
                "tokens_per_step_greedy": round(e_g, 4),
                "speedup_greedy": round(expected_speedup(alpha_greedy, g, c), 4),
                # Same, with the verify pass costing v(g) decode steps instead of 1.
                "speedup_verify_cost": round(e_t / (g * c + v), 4),
                "speedup_greedy_verify_cost": round(e_g / (g * c + v), 4),
            }
        )
    return rows


def analyze(
    draft_dir: str,
    target_dir: str,
    prompts: list[str],
    temperature: float = 1.0,
    new_tokens: int = 64,
    threads: int = 2,
    device: str = "cpu",
    dtype: str = "float32",
    rounds: int = 5,
    steps: int = 60,
    warmup: int = 10,
    pair=None,
    packed: bool = True,
) -> dict:
    """Everything above as one dict. ``pair`` = (tokenizer, draft, target) reuses loaded models."""
    if threads:
        torch.set_num_threads(threads)
    tok, draft, target = (
        pair if pair is not None else load_pair(draft_dir, target_dir, device, dtype)
    )
    t0 = time.perf_counter()
    quality = measure_alpha(tok, draft, target, prompts, temperature, new_tokens)
    packed_from = {}
    if packed:
        packed_from = {"draft": packed_linear.pack_model(draft)[0]}
        packed_from["target"] = packed_linear.pack_model(target)[0]
    try:
        cost = measure_cost(tok, draft, target, prompts, rounds, steps, warmup)
        cost["in_step"] = measure_cost_in_step(tok, draft, target, prompts[0], max(10, steps // 2))
    finally:
        for m in (draft, target):
            packed_linear.uninstall(m)
    cost["packed_linear_min_rows"] = packed_from
    alpha = quality["alpha_wire_top_k"]
    rows = predictions(alpha, quality["greedy_agreement"], cost["c"], cost["verify_cost_ratio"])
    # The smallest wire_top_k that keeps alpha within 0.01 of the untruncated q.
    full = quality["alpha"]
    wide = next(
        (int(k) for k, a in quality["alpha_by_wire_top_k"].items() if a >= full - 0.01),
        max(WIRE_KS),
    )
    best = max(rows, key=lambda r: r["speedup"])
    best_greedy = max(rows, key=lambda r: r["speedup_greedy"])
    return {
        "draft": model_summary(draft, draft_dir),
        "target": model_summary(target, target_dir),
        "device": device,
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "quality": quality,
        "cost": cost,
        # The predictions use alpha with the wire's top-k truncation (what the services do).
        "alpha_used": alpha,
        "predicted": rows,
        "recommended_gamma": best["gamma"],
        "recommended_wire_top_k": wide,
        "recommended_gamma_greedy": best_greedy["gamma"],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def report(a: dict) -> str:
    q, c = a["quality"], a["cost"]
    lines = [
        f"draft  {a['draft']['path']}: {a['draft']['parameters'] / 1e6:.2f} M parameters",
        f"target {a['target']['path']}: {a['target']['parameters'] / 1e6:.2f} M parameters",
        f"{a['prompts']} prompts x {a['new_tokens']} tokens, {a['device']} {a['dtype']}, "
        f"{a['torch_threads']} torch threads",
        f"alpha at T={q['temperature']:g}: {q['alpha']}  (q truncated to top-{q['wire_top_k']}: "
        f"{q['alpha_wire_top_k']})   greedy agreement: {q['greedy_agreement']}",
        "alpha by wire_top_k: "
        + " ".join(f"{k}:{v:.3f}" for k, v in q.get("alpha_by_wire_top_k", {}).items())
        + f"  (recommended wire_top_k {a['recommended_wire_top_k']})",
        "alpha by position: " + " ".join(f"{x:.2f}" for x in q["alpha_by_position"][:16]) + " ...",
        f"draft step {c['draft_step_ms']:.3f} ms, target step {c['target_step_ms']:.3f} ms, "
        f"c = {c['c']:.4f}",
        "verify cost v(g) (target forward over g+1 tokens / one decode step): "
        + " ".join(f"{g}:{v:.2f}" for g, v in c["verify_cost_ratio"].items()),
        "as a step meets them (each draft step after a target pass): c_step(g) "
        + " ".join(f"{g}:{v:.3f}" for g, v in c["in_step"]["c_step"].items())
        + "; v_step(g) "
        + " ".join(f"{g}:{v:.2f}" for g, v in c["in_step"]["v_step"].items())
        + "; draft step by position (ms) "
        + " ".join(f"{x:.3f}" for x in c["in_step"]["draft_step_ms_by_position"]),
        "",
        "gamma  E[tokens/step]  speedup   | greedy: E[tokens/step]  speedup | with v(g): T  greedy",
    ]
    for r in a["predicted"]:
        lines.append(
            f"{r['gamma']:5d}  {r['tokens_per_step']:14.3f}  {r['speedup']:7.3f}x  |"
            f"         {r['tokens_per_step_greedy']:14.3f}  {r['speedup_greedy']:7.3f}x |"
            f"    {r['speedup_verify_cost']:.3f}x  {r['speedup_greedy_verify_cost']:.3f}x"
        )
    lines.append(
        f"recommended gamma: {a['recommended_gamma']} at T={q['temperature']:g}, "
        f"{a['recommended_gamma_greedy']} greedy"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.analyze", description=__doc__)
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--prompts", help="a JSON list of prompts or one prompt per line")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=int, default=64, help="continuation length per prompt")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (0 = default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (draft, target each)")
    ap.add_argument("--steps", type=int, default=60, help="timed decode steps per round")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument(
        "--stock-linear", action="store_true", help="time torch's own linear, not oneDNN's"
    )
    args = ap.parse_args(argv)
    result = analyze(
        args.draft,
        args.target,
        load_prompts(args.prompts),
        args.temperature,
        args.new_tokens,
        args.threads,
        args.device,
        args.dtype,
        args.rounds,
        args.steps,
        packed=not args.stock_linear,
    )
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
