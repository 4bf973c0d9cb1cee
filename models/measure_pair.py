#!/usr/bin/env python
"""Measure a draft/target pair for speculative decoding on held-out text.

  .venv/bin/python models/measure_pair.py --dir models/demo

Loads ``DIR/target`` and ``DIR/draft`` with AutoModelForCausalLM /
AutoTokenizer (float32, CPU) and measures on the held-out END of every book
(see train_demo.load_corpus):

* val perplexity of each model (non-overlapping windows of ``--seq-len``);
* alpha = E[sum_x min(p(x), q(x))] at temperature 1 (p = target, q = draft),
  overall and per position (by position in the context window, and quantiles
  of the per-position values), also at temperature 0.8 for reference;
* greedy agreement = fraction of positions where argmax p == argmax q;
* cost ratio c = (time of one draft decode step with KV cache) /
  (time of one target decode step), float32, batch 1;
* expected speedup per gamma (1..8): (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma*c + 1)).

Results go to DIR/metrics.json (the "training" section written by
train_demo.py is kept) and DIR/MODEL_CARD.md is (re)generated.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def load_pair(d: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tt = AutoTokenizer.from_pretrained(os.path.join(d, "target"))
    td = AutoTokenizer.from_pretrained(os.path.join(d, "draft"))
    if tt.get_vocab() != td.get_vocab():
        raise SystemExit("draft and target tokenizers differ")
    target = AutoModelForCausalLM.from_pretrained(
        os.path.join(d, "target"), dtype=torch.float32
    ).eval()
    draft = AutoModelForCausalLM.from_pretrained(
        os.path.join(d, "draft"), dtype=torch.float32
    ).eval()
    return tt, target, draft


def held_out_ids(tokenizer):
    sys.path.insert(0, HERE)
    import train_demo

    hp = train_demo.HP()
    _, val_docs = train_demo.load_corpus(hp)
    return train_demo.encode_docs(tokenizer, val_docs), val_docs


def quality(target, draft, val, seq_len: int, max_windows: int, batch: int = 8):
    """Perplexities, alpha (T=1 and T=0.8) and greedy agreement over the val stream."""
    import torch
    import torch.nn.functional as F

    n = min(max_windows, (len(val) - 1) // seq_len)
    x = torch.stack([val[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    inp, lab = x[:, :-1], x[:, 1:]
    nll_t = nll_d = 0.0
    alpha_pos = []  # [n, seq_len] alpha at T=1
    alpha08 = []
    agree = []
    with torch.no_grad():
        for i in range(0, n, batch):
            lt = target(input_ids=inp[i : i + batch]).logits.float()
            ld = draft(input_ids=inp[i : i + batch]).logits.float()
            y = lab[i : i + batch]
            nll_t += F.cross_entropy(
                lt.reshape(-1, lt.size(-1)), y.reshape(-1), reduction="sum"
            ).item()
            nll_d += F.cross_entropy(
                ld.reshape(-1, ld.size(-1)), y.reshape(-1), reduction="sum"
            ).item()
            p, q = lt.softmax(-1), ld.softmax(-1)
            alpha_pos.append(torch.minimum(p, q).sum(-1))
            p8, q8 = (lt / 0.8).softmax(-1), (ld / 0.8).softmax(-1)
            alpha08.append(torch.minimum(p8, q8).sum(-1))
            agree.append((lt.argmax(-1) == ld.argmax(-1)).float())
    a = torch.cat(alpha_pos)  # [n, seq_len]
    a08 = torch.cat(alpha08)
    g = torch.cat(agree)
    ntok = a.numel()
    buckets = [(0, 8), (8, 32), (32, 64), (64, 128), (128, seq_len)]
    by_pos = {
        f"{lo}-{hi - 1}": round(a[:, lo:hi].mean().item(), 4) for lo, hi in buckets if lo < seq_len
    }
    flat = a.flatten().sort().values
    quant = {
        f"p{int(qq * 100):02d}": round(flat[int(qq * (len(flat) - 1))].item(), 4)
        for qq in (0.1, 0.25, 0.5, 0.75, 0.9)
    }
    return {
        "positions": ntok,
        "windows": n,
        "seq_len": seq_len,
        "target_val_ppl": round(math.exp(nll_t / ntok), 2),
        "draft_val_ppl": round(math.exp(nll_d / ntok), 2),
        "alpha_t1": round(a.mean().item(), 4),
        "alpha_t1_by_position_in_window": by_pos,
        "alpha_t1_quantiles_over_positions": quant,
        "alpha_t1_per_window_min": round(a.mean(1).min().item(), 4),
        "alpha_t1_per_window_max": round(a.mean(1).max().item(), 4),
        "alpha_t0.8": round(a08.mean().item(), 4),
        "greedy_agreement": round(g.mean().item(), 4),
    }


def _cache_kw(model) -> str:
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def decode_step_time(model, prompt, steps: int):
    """Median seconds of one single-token decode step with KV cache (batch 1)."""
    import torch

    times = []
    kw = _cache_kw(model)
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        past = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        tok = out.logits[:, -1:].argmax(-1)
        for i in range(steps + 5):
            t0 = time.perf_counter()
            out = model(input_ids=tok, use_cache=True, **{kw: past})
            past = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
            tok = out.logits[:, -1:].argmax(-1)
            dt = time.perf_counter() - t0
            if i >= 5:
                times.append(dt)
    return statistics.median(times)


def cost_ratio(target, draft, val, rounds: int = 5, steps: int = 60, prompt_len: int = 64):
    """Interleave draft/target timing rounds (the CPU may be shared)."""
    tts, tds = [], []
    for r in range(rounds):
        prompt = val[r * 997 : r * 997 + prompt_len].unsqueeze(0)
        tds.append(decode_step_time(draft, prompt, steps))
        tts.append(decode_step_time(target, prompt, steps))
    t_t, t_d = statistics.median(tts), statistics.median(tds)
    return {
        "target_step_ms": round(t_t * 1e3, 3),
        "draft_step_ms": round(t_d * 1e3, 3),
        "c": round(t_d / t_t, 4),
        "prompt_len": prompt_len,
        "steps_per_round": steps,
        "rounds": rounds,
    }


def speedups(alpha: float, c: float, gammas=range(1, 9)):
    rows = []
    for g in gammas:
        exp_tokens = (g + 1.0) if alpha >= 1.0 else (1 - alpha ** (g + 1)) / (1 - alpha)
        rows.append(
            {
                "gamma": g,
                "expected_tokens_per_target_call": round(exp_tokens, 3),
                "speedup": round(exp_tokens / (g * c + 1), 3),
            }
        )
    return rows


def samples(tokenizer, target, draft, val_docs, seed: int = 0):
    import torch

    prompts = [
        "It is a truth universally acknowledged, that",
        '"My dear Elizabeth," said her mother,',
        " ".join(val_docs[3].split("\n\n")[2].split()[:12]),
    ]  # held-out Emma text
    out = []
    for i, pr in enumerate(prompts):
        ids = tokenizer(pr, return_tensors="pt")
        torch.manual_seed(seed + i)
        with torch.no_grad():
            g = target.generate(
                **ids, do_sample=False, max_new_tokens=80, pad_token_id=tokenizer.eos_token_id
            )
            s = target.generate(
                **ids,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=80,
                pad_token_id=tokenizer.eos_token_id,
            )
            dg = draft.generate(
                **ids, do_sample=False, max_new_tokens=40, pad_token_id=tokenizer.eos_token_id
            )
        n = ids["input_ids"].shape[1]
        out.append(
            {
                "prompt": pr,
                "target_greedy": tokenizer.decode(g[0, n:], skip_special_tokens=True),
                "target_sampled_t1": tokenizer.decode(s[0, n:], skip_special_tokens=True),
                "draft_greedy": tokenizer.decode(dg[0, n:], skip_special_tokens=True),
            }
        )
    return out


def dir_sizes(d: str):
    rows = []
    for root, _, files in os.walk(d):
        for f in sorted(files):
            p = os.path.join(root, f)
            rows.append((os.path.relpath(p, d), os.path.getsize(p)))
    return sorted(rows)


def _fmt_cfg(cfg) -> str:
    return (
        f"LlamaForCausalLM, {cfg['num_hidden_layers']} layer(s), hidden {cfg['hidden_size']}, "
        f"MLP {cfg['intermediate_size']}, {cfg['num_attention_heads']} heads "
        f"(kv {cfg['num_key_value_heads']}), vocab {cfg['vocab_size']}, "
        f"tied embeddings: {cfg.get('tie_word_embeddings')}, RoPE theta "
        f"{cfg.get('rope_theta', (cfg.get('rope_parameters') or {}).get('rope_theta'))}"
    )


def _first_run(tr: dict) -> dict:
    while tr.get("resumed_from"):
        tr = tr["resumed_from"]
    return tr


def write_card(d: str, metrics: dict):
    tr = metrics.get("training", {})
    m = metrics["measurement"]
    q, cr = m["quality"], m["cost"]
    hp = tr.get("hyperparameters", {})
    with open(os.path.join(d, "target", "config.json")) as f:
        tcfg = json.load(f)
    with open(os.path.join(d, "draft", "config.json")) as f:
        dcfg = json.load(f)

    hw = tr.get("hardware", {})
    L = []
    L.append("# specdec demo draft/target pair (Jane Austen)\n")
    L.append(
        "A tiny Llama-family **target** model and a much cheaper **draft** model, trained from "
        "scratch by `models/train_demo.py` on Jane Austen's six novels, for demonstrating and "
        "testing distributed speculative decoding. They share one byte-level BPE tokenizer "
        "(identical files in `target/` and `draft/`). These are toy models: the text is "
        "Austen-flavoured but not coherent.\n"
    )
    L.append("## Rebuild (one line)\n")
    L.append(
        "```\napt-get install -y r-cran-janeaustenr && .venv/bin/python models/train_demo.py "
        f"--budget-minutes {_first_run(tr).get('budget_minutes', 50):g} --out models/demo\n```\n"
    )
    L.append(
        "Re-measure only: `.venv/bin/python models/measure_pair.py --dir models/demo`. "
        "Training is time-budgeted (seeds are fixed, but the number of optimiser steps depends "
        "on machine speed), so a rebuild gives a statistically similar, not bit-identical, pair.\n"
    )
    L.append("## Corpus and licence\n")
    L.append(
        "* Text: *Sense and Sensibility*, *Pride and Prejudice*, *Mansfield Park*, *Emma*, "
        "*Northanger Abbey*, *Persuasion* (public domain), as packaged in the R package "
        "`janeaustenr` (Julia Silge, MIT licence; Debian package `r-cran-janeaustenr`, read "
        "from `/usr/lib/R/site-library/janeaustenr/data/`)."
        + (
            " Plus *Moby Dick* from `r-cran-tokenizers` (Gutenberg header/footer stripped)."
            if tr.get("moby_dick")
            else ""
        )
        + "\n"
        "* Cleaning: hard-wrapped lines joined into paragraphs (separated by a blank line), "
        "title pages / advertisement / `THE END` / editor's note removed; books separated by "
        "`<|endoftext|>`.\n"
        f"* Split: the last {hp.get('val_fraction', 0.05) * 100:.0f}% (by characters) of "
        "**each** book is held out for validation; everything reported below is measured there.\n"
        f"* Tokens: train {tr.get('corpus', {}).get('train_tokens', '?')}, validation "
        f"{tr.get('corpus', {}).get('val_tokens', '?')}.\n"
        "* Licences: the novels are in the public domain; the `janeaustenr` packaging is MIT "
        "(copyright 2016-2017 Julia Silge, see `/usr/share/doc/r-cran-janeaustenr/copyright`). "
        "No other data was used.\n"
    )
    L.append("## Tokenizer\n")
    L.append(
        f"Byte-level BPE (`tokenizers`), vocab {tcfg['vocab_size']}, trained on the training "
        "split only. `<|endoftext|>` (id "
        f"{tcfg['eos_token_id']}) is EOS and also BOS/PAD/UNK; no BOS is prepended "
        "automatically. Load with `AutoTokenizer.from_pretrained('models/demo/target')` "
        "(or `.../draft`, identical).\n"
    )
    L.append("## Models\n")
    L.append("| | target | draft |\n|---|---|---|")
    L.append(f"| architecture | {_fmt_cfg(tcfg)} | {_fmt_cfg(dcfg)} |")
    L.append(
        f"| parameters | {tr.get('params', {}).get('target', 0) / 1e6:.2f} M | "
        f"{tr.get('params', {}).get('draft', 0) / 1e6:.3f} M |"
    )
    L.append(
        f"| weights on disk | {hp.get('target_save_dtype', '?')} safetensors | "
        f"{hp.get('draft_save_dtype', '?')} safetensors |"
    )
    L.append(f"| val perplexity | **{q['target_val_ppl']}** | **{q['draft_val_ppl']}** |")
    L.append(
        f"| decode step (fp32, batch 1, KV cache) | {cr['target_step_ms']} ms | {cr['draft_step_ms']} ms |"
    )
    L.append("")
    if q["draft_val_ppl"] < 1.15 * q["target_val_ppl"]:
        L.append(
            "Note: the draft's perplexity is close to the target's. The target is compute-limited "
            "(well under 3 epochs on 2 CPU cores) while the 1-layer draft sees many more tokens and "
            "is distilled on the target's full distributions. For speculative decoding only the "
            "target's distribution matters (the output is distributed exactly as the target's); "
            "a longer training budget would widen the gap.\n"
        )
    L.append(
        "`config.json` says `dtype: float32`: `from_pretrained` upcasts the stored bf16 weights, "
        "so both models run in float32 on CPU by default. Context length "
        f"{tcfg['max_position_embeddings']} tokens (trained on windows of {hp.get('seq_len', '?')}).\n"
    )
    L.append("## Training\n")
    chain, t = [], tr
    while t:
        chain.insert(0, t)
        t = t.get("resumed_from")
    if chain:
        total = sum(r.get("train_seconds_total", 0) for r in chain)
        L.append(
            f"Hardware: {hw.get('cpu', '?')}, {hw.get('threads', '?')} torch threads "
            f"({hw.get('cores', '?')}-core machine shared with other jobs, no GPU), torch "
            f"{hw.get('torch', '?')}, bf16 autocast. Total training wall time "
            f"{total / 60:.1f} min."
        )
        if len(chain) > 1:
            L.append(
                " The machine was busy with other work during training, so the pair was trained "
                "in "
                + str(len(chain))
                + " runs: "
                + "; then ".join(
                    f"run {i + 1}: `{r.get('command', '?')}`" for i, r in enumerate(chain)
                )
                + ". On an idle machine a single run with the one-line command above reaches a "
                "similar number of optimiser steps."
            )
        L.append("\n")
        L.append(
            "| phase | what | wall time | steps | tokens seen | val ppl at end |\n|---|---|---|---|---|---|"
        )
        for i, run in enumerate(chain):
            rhp = run.get("hyperparameters", {})
            resumed = run.get("resumed_from") is not None
            t_lr = rhp.get("target_lr", 0) * (rhp.get("resume_lr_scale", 1) if resumed else 1)
            desc = {
                "target": f"target, CE, AdamW peak lr {t_lr:g} cosine, batch {rhp.get('target_batch')}x{rhp.get('seq_len')}",
                "draft": f"draft, CE, AdamW peak lr {rhp.get('draft_lr')} cosine, batch {rhp.get('draft_batch')}x{rhp.get('seq_len')}",
                "distill": f"draft, KL(p_target &#124;&#124; q_draft) + {rhp.get('distill_ce_weight')} CE, peak lr {rhp.get('distill_lr')}",
            }
            for k in ("target", "draft", "distill"):
                p = run.get("phases", {}).get(k)
                if p:
                    label = f"run {i + 1}: {k}" if len(chain) > 1 else k
                    L.append(
                        f"| {label} | {desc[k]} | {p['seconds'] / 60:.1f} min | {p['steps']} | "
                        f"{p['tokens'] / 1e6:.2f} M | {math.exp(p['final_val_loss']):.1f} |"
                    )
        L.append("")
        L.append(
            "(In-training val ppl uses bf16 autocast on 24 fixed held-out windows; the numbers "
            "below are float32 over all held-out text.) All hyper-parameters are in the `HP` "
            "dataclass at the top of `models/train_demo.py`; the exact values used are stored in "
            "`metrics.json` (`training.hyperparameters`).\n"
        )
    L.append("## Speculative-decoding metrics (held-out text)\n")
    L.append(
        f"Measured over {q['positions']} positions ({q['windows']} windows of {q['seq_len']} tokens) of "
        "the held-out book endings, both models in float32.\n"
    )
    L.append(
        f"* **alpha (temperature 1)** = E[sum_x min(p(x), q(x))] = **{q['alpha_t1']}** "
        f"(per window: {q['alpha_t1_per_window_min']}..{q['alpha_t1_per_window_max']}; "
        f"by position in window: {q['alpha_t1_by_position_in_window']}; quantiles over positions: "
        f"{q['alpha_t1_quantiles_over_positions']}). At temperature 0.8: {q['alpha_t0.8']}."
    )
    L.append(f"* **greedy agreement** (argmax p == argmax q) = **{q['greedy_agreement']}**")
    L.append(
        f"* **cost ratio c** = draft step / target step = {cr['draft_step_ms']} ms / "
        f"{cr['target_step_ms']} ms = **{cr['c']}** (median of {cr['rounds']} interleaved rounds x "
        f"{cr['steps_per_round']} steps after a {cr['prompt_len']}-token prompt, "
        f"{m.get('threads', '?')} threads, this CPU). At this scale a decode step costs roughly "
        "a fixed amount per layer (framework overhead plus reading the layer's weights), so c is "
        "close to the layer-count ratio; it will differ on other hardware.\n"
    )
    L.append(
        "Expected speedup (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma*c + 1)) at temperature 1:\n"
    )
    L.append("| gamma | " + " | ".join(str(r["gamma"]) for r in m["speedup_t1"]) + " |")
    L.append("|---|" + "---|" * len(m["speedup_t1"]))
    L.append(
        "| E[tokens / target call] | "
        + " | ".join(f"{r['expected_tokens_per_target_call']:.2f}" for r in m["speedup_t1"])
        + " |"
    )
    L.append("| speedup | " + " | ".join(f"{r['speedup']:.2f}" for r in m["speedup_t1"]) + " |")
    L.append("")
    L.append("With greedy decoding (temperature 0) the acceptance rate is the greedy agreement:\n")
    L.append("| gamma | " + " | ".join(str(r["gamma"]) for r in m["speedup_greedy"]) + " |")
    L.append("|---|" + "---|" * len(m["speedup_greedy"]))
    L.append("| speedup | " + " | ".join(f"{r['speedup']:.2f}" for r in m["speedup_greedy"]) + " |")
    L.append("")
    L.append(
        "(The formula assumes i.i.d. acceptance and ignores verification overhead beyond one "
        "target forward, which over gRPC/CPU is not free; treat it as an upper bound.)\n"
    )
    L.append("## Samples from the target\n")
    L.append(
        "Greedy = `generate(do_sample=False)`; sampled = temperature 1, no top-k/top-p. "
        "80 new tokens each; `>>>` marks where the model's continuation starts (line breaks "
        "in the output are shown as spaces). The last prompt is from the held-out part of *Emma*.\n"
    )
    for s in m["samples"]:
        L.append("```text")
        for label, key in (
            ("target, greedy", "target_greedy"),
            ("target, sampled T=1", "target_sampled_t1"),
            ("draft, greedy (40 tokens)", "draft_greedy"),
        ):
            cont = " ".join(s[key].split())
            L.append(f"[{label}]")
            L.extend(textwrap.wrap(f"{s['prompt']} >>> {cont}", 100))
            L.append("")
        L[-1] = "```\n"
    L.append("## Files\n")
    L.append("| file | bytes |\n|---|---|")
    for rel, size in dir_sizes(d):
        if rel != "MODEL_CARD.md":
            L.append(f"| `{rel}` | {size} |")
    L.append("")
    L.append("## Intended use and limitations\n")
    L.append(
        "Demo/test fixture for speculative decoding only. Trained on ~1M tokens of 19th-century "
        "fiction; it knows nothing else, produces ungrammatical text often, and reflects the "
        "social attitudes of its source. Not for any real use.\n"
    )
    with open(os.path.join(d, "MODEL_CARD.md"), "w") as f:
        f.write("\n".join(L))


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", default="models/demo")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-samples", action="store_true")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.time()
    tok, target, draft = load_pair(args.dir)
    val, val_docs = held_out_ids(tok)
    print(f"[measure] loaded pair; {len(val)} held-out tokens", flush=True)
    q = quality(target, draft, val, args.seq_len, args.max_windows)
    print(f"[measure] {json.dumps(q)}", flush=True)
    cr = cost_ratio(target, draft, val)
    print(f"[measure] {json.dumps(cr)}", flush=True)
    m = {
        "quality": q,
        "cost": cr,
        "threads": args.threads,
        "speedup_t1": speedups(q["alpha_t1"], cr["c"]),
        "speedup_greedy": speedups(q["greedy_agreement"], cr["c"]),
        "samples": [] if args.no_samples else samples(tok, target, draft, val_docs),
        "vocab_identical": True,
        "seconds": None,
    }
    best = max(m["speedup_t1"], key=lambda r: r["speedup"])
    m["best_gamma_t1"] = best
    m["seconds"] = round(time.time() - t0, 1)
    path = os.path.join(args.dir, "metrics.json")
    metrics = {}
    if os.path.exists(path):
        with open(path) as f:
            metrics = json.load(f)
    metrics["measurement"] = m
    metrics["files"] = {rel: size for rel, size in dir_sizes(args.dir)}
    with open(path, "w") as f:
        json.dump(metrics, f, indent=2)
    write_card(args.dir, metrics)
    for s in m["samples"]:
        print(
            f"[sample] {s['prompt']!r} -> greedy {s['target_greedy']!r}\n   sampled {s['target_sampled_t1']!r}"
        )
    print(
        f"[measure] alpha={q['alpha_t1']} greedy_agree={q['greedy_agreement']} c={cr['c']} "
        f"ppl target={q['target_val_ppl']} draft={q['draft_val_ppl']} best={best} "
        f"({m['seconds']}s)",
        flush=True,
    )


if __name__ == "__main__":
    main()
