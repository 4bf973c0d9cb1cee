"""How often the draft can guess the target's token at a rejected position, in
one process, no services.

    python -m benchmarks.guess_rates [--draft DIR] [--target DIR] [--gamma 4]
        [--max-new-tokens 64]

Greedy: steps of ``gamma`` drafts along the target's own greedy output (the
benchmark prompts); at each rejection, whether the target's token is the
draft's second choice (what ``draft.guesses`` drafts from), or its second or
third. T=1: along a sampled output of the target, at every position, each
draft token x weighted by its chance of being drawn and rejected,
q(x) max(0, 1 - p(x)/q(x)); the chance that the target's residual draw r =
norm(max(0, p - q)) equals a guess: the draft's most likely token other than x
(argmax), a draw from g = q without x renormalized (independent), or that draw
coupled to the residual draw by the seed's rule (sum of min(r, g); not
implemented in the services). float64. Prints and writes results.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec.runtime.loading import load_model, load_tokenizer

from .common import DEFAULT_DRAFT, DEFAULT_TARGET, PROMPTS


def greedy_rates(draft, target, prompts: list[list[int]], gamma: int, n: int) -> dict:
    steps = full = rejections = second = second_or_third = 0
    with torch.inference_mode():
        for ids in prompts:
            seq = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)[0]
            seq = seq.tolist()
            pos = len(ids)
            while pos < len(seq):
                context, drafts, ranked = torch.tensor([seq[:pos]]), [], []
                for _ in range(gamma):
                    top = draft(context).logits[0, -1].topk(3).indices.tolist()
                    drafts.append(top[0])
                    ranked.append(top)
                    context = torch.cat([context, torch.tensor([[top[0]]])], 1)
                k = 0
                while k < gamma and pos + k < len(seq) and drafts[k] == seq[pos + k]:
                    k += 1
                if pos + k >= len(seq):
                    break
                steps += 1
                if k == gamma:
                    full += 1
                    pos += gamma + 1
                    continue
                rejections += 1
                second += seq[pos + k] == ranked[k][1]
                second_or_third += seq[pos + k] in ranked[k][1:]
                pos += k + 1
    return {
        "steps": steps,
        "every_draft_accepted": full / steps,
        "rejections": rejections,
        "second_choice": second / rejections,
        "second_or_third": second_or_third / rejections,
    }


def sampled_rates(draft, target, prompts: list[list[int]], n: int, top: int = 64) -> dict:
    weight = argmax = independent = coupled = 0.0
    positions = 0
    torch.manual_seed(0)
    with torch.inference_mode():
        for ids in prompts:
            seq = target.generate(
                torch.tensor([ids]), do_sample=True, top_k=0, top_p=1.0, max_new_tokens=n
            )[0]
            p_all = target(seq[None]).logits[0].double().softmax(-1)  # [len, vocab]
            q_all = draft(seq[None]).logits[0].double().softmax(-1)
            for t in range(len(ids) - 1, len(seq) - 1):
                p, q = p_all[t], q_all[t]
                r = (p - q).clamp(min=0)
                if r.sum() <= 1e-12:
                    continue
                r = r / r.sum()
                positions += 1
                rejected = (1 - p / q).clamp(min=0)
                best = q.topk(2).indices.tolist()
                for x in q.topk(min(top, len(q))).indices.tolist():  # most of q's mass
                    w = float(q[x] * rejected[x])
                    if w <= 0:
                        continue
                    g = q.clone()
                    g[x] = 0
                    g = g / g.sum()
                    weight += w
                    argmax += w * float(r[best[1] if x == best[0] else best[0]])
                    independent += w * float((r * g).sum())
                    coupled += w * float(torch.minimum(r, g).sum())
    return {
        "positions": positions,
        "rejection_chance": weight / positions,
        "argmax_guess": argmax / weight,
        "independent_draw": independent / weight,
        "coupled_draw": coupled / weight,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=f"results/guess-rates-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    draft, target = load_model(args.draft), load_model(args.target)
    tok = load_tokenizer(args.target)
    prompts = [tok.encode(p) for p in PROMPTS]
    results = {
        "greedy": greedy_rates(draft, target, prompts, args.gamma, args.max_new_tokens),
        "t1": sampled_rates(draft, target, prompts, args.max_new_tokens),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    g, s = results["greedy"], results["t1"]
    print(
        f"greedy, gamma {args.gamma}: {g['steps']} steps, every draft accepted in "
        f"{g['every_draft_accepted']:.0%}; of {g['rejections']} rejections the target's "
        f"token is the draft's second choice in {g['second_choice']:.0%}, second or third "
        f"in {g['second_or_third']:.0%}"
    )
    print(
        f"T=1: {s['positions']} positions, rejection chance {s['rejection_chance']:.3f}; "
        f"a rejection's token equals the draft's argmax guess {s['argmax_guess']:.0%}, "
        f"an independent draw from g {s['independent_draw']:.0%}, a coupled draw "
        f"{s['coupled_draw']:.0%}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
