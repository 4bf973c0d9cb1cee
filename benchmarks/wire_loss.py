"""Acceptance lost to the wire, exactly: alpha of the q each wire sends against
alpha of the draft's own q, on the same positions, with no sampling noise.

    python -m benchmarks.wire_loss [--prompts 8] [--tokens 64] [--top-k 256 1024]
        [--out results/wire-loss-<time>]

The target samples ``--tokens`` tokens after each prompt (T=1, seeded); at every
position both models' logits are computed once. For each sampling setting
(T=1, T=0.7, T=1 with top-k 50, T=1 with top-p 0.9) the report gives
alpha = sum_x min(p(x), q(x)) averaged over positions for the draft's full q, for
each list wire (``sparse_q`` at ``--top-k``, counts out of 2^16, the rest spread
evenly: what the draft sends) and for the hidden-state wire (``specdec.hidden_q``:
q derived from the int8 codes of the draft's last hidden state), with each wire's
bytes per position (a packed q of one position). Bytes per generated token are
bytes per position x gamma / tokens per step. Prints a table; writes
results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from specdec.hidden_q import HiddenQ, QuantHead, derive_q, encode_hidden
from specdec.runtime.loading import load_model, load_tokenizer
from specdec.sampling import SamplingParams, probs_from_logits, sparse_q
from specdec.wire import pack_q

from .common import DEFAULT_DRAFT, DEFAULT_TARGET, PROMPTS, machine_info

SETTINGS = {
    "T=1": SamplingParams(1.0),
    "T=0.7": SamplingParams(0.7),
    "T=1, top-k 50": SamplingParams(1.0, top_k=50),
    "T=1, top-p 0.9": SamplingParams(1.0, top_p=0.9),
}


def positions(draft, target, tokenizer, prompts, tokens: int):
    """Target logits [n, V], draft logits [n, V] and draft hidden states [n, d] at every
    position of the target's own samples after each prompt."""
    lp, lq, hs = [], [], []
    torch.manual_seed(0)
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            seq = target.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=True,
                max_new_tokens=tokens, top_k=0, top_p=1.0,
            )  # fmt: skip
            n = ids.shape[1]
            lp.append(target(seq).logits[0, n - 1 : -1].float())
            out = draft(seq, output_hidden_states=True)
            lq.append(out.logits[0, n - 1 : -1].float())
            hs.append(out.hidden_states[-1][0, n - 1 : -1])
    return torch.cat(lp), torch.cat(lq), torch.cat(hs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--out", default=f"results/wire-loss-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info("cpu")
    draft, target = load_model(args.draft), load_model(args.target)
    head = QuantHead.of_model(draft)
    lp, lq, hs = positions(
        draft, target, load_tokenizer(args.target), PROMPTS[: args.prompts], args.tokens
    )
    encoded = [encode_hidden(h) for h in hs]
    codes = np.stack([c for c, _ in encoded])
    scales = np.array([s for _, s in encoded])
    results: dict[str, dict] = {}
    for name, params in SETTINGS.items():
        p = probs_from_logits(lp, params).double()  # [n, V]
        q = probs_from_logits(lq, params).double()
        row = {"full q": {"alpha": float(torch.minimum(p, q).sum(-1).mean()), "bytes": None}}
        for k in args.top_k:
            alphas, sizes = [], []
            for i in range(len(p)):
                sq = sparse_q(lq[i], params, k, 0.0)
                alphas.append(float(torch.minimum(p[i], sq.dense()).sum()))
                sizes.append(len(pack_q([sq]).SerializeToString()))
            row[f"top-{k} list"] = {"alpha": float(np.mean(alphas)), "bytes": float(np.mean(sizes))}
        if head is not None:
            qs = derive_q(head, codes, scales, params)
            alphas = [float(torch.minimum(p[i], qs[i].dense()).sum()) for i in range(len(qs))]
            size = len(pack_q([_with_code(qs[0], codes[0], scales[0])]).SerializeToString())
            row["hidden state"] = {"alpha": float(np.mean(alphas)), "bytes": float(size)}
        results[name] = row
        print(name + ": " + ", ".join(f"{w} {v['alpha']:.4f}" for w, v in row.items()), flush=True)
    lines = [
        "# Acceptance lost to the wire, exactly",
        "",
        f"{info['date']}, commit {info['git_commit']}; {len(lp)} positions "
        f"({args.prompts} prompts x {args.tokens} tokens the target sampled at T=1); "
        f"vocabulary {lp.shape[-1]}; draft head {head.dim if head else '-'} wide.",
        "",
        "| setting | wire | alpha | lost against the full q | bytes per position |",
        "|---|---|---|---|---|",
    ]
    for name, row in results.items():
        full = row["full q"]["alpha"]
        for wire, v in row.items():
            b = "-" if v["bytes"] is None else f"{v['bytes']:.0f}"
            lines.append(f"| {name} | {wire} | {v['alpha']:.4f} | {full - v['alpha']:+.4f} | {b} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"info": info, "results": results}, indent=1))
    print("\n".join(lines))
    return 0


def _with_code(q, code, scale) -> HiddenQ:
    return HiddenQ(q.ids, q.counts, q.tail, q.vocab, q.bits, code, float(scale))


if __name__ == "__main__":
    raise SystemExit(main())
