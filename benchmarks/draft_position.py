"""What one drafted position costs the draft service, per wire, at T=1, and what
unpacking a proposal costs the target.

A position is one forward of one token through the draft's runner (as
``Drafter._draft`` feeds it) and the q and draw for it:

* **list**: the runner applies the output layer; ``draft_position`` cuts q to
  ``--top-k`` tokens out of 2^16 and draws from it (the default wire);
* **hidden**: the runner skips the output layer (``Feed.head`` false) and
  ``hidden_position`` derives q from the last hidden state's int8 codes with the
  quantized head (``specdec.hidden_q``) and draws from it;
* **hidden, head run too**: the same, with the output layer applied and its
  logits thrown away (the runner before ``Feed.head``);
* with ``--against REV``: **hidden at REV**, the head run too and
  ``hidden_position`` of ``specdec/hidden_q.py`` as of git revision REV.

The target's side (``--gamma`` positions, 5 by default): the proposal parsed
from its bytes and unpacked (``unpack_q``: validated, and for hidden states
derived into q): **list**, **hidden** (the head packed for oneDNN, as the
target keeps it: ``QuantHead.packed``) and **hidden, head not packed**.

Models: the demo draft, and a random one-layer Qwen2-shaped draft with a
151,936-token vocabulary and width 896 (Qwen2.5-0.5B's head, built in memory;
``--no-large`` skips it). One thread; the session's cache is rolled back after
each position, so every position sees the same length. Rounds interleave the
modes position by position (order rotating), so that a slow spell of the
machine falls on every mode alike; each cell is the median over all positions.

    python -m benchmarks.draft_position [--rounds 9] [--positions 200] [--top-k 1024]
        [--gamma 5] [--against REV] [--no-large] [--out results/draft-position-<time>]

Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec.hidden_q import QuantHead, hidden_position
from specdec.runtime.loading import load_model
from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV
from specdec.sampling import SamplingParams, draft_position
from specdec.v1 import common_pb2
from specdec.wire import DEFAULT_Q_BITS, pack_q, unpack_q

from .common import DEFAULT_DRAFT, machine_info, module_at

PARAMS = SamplingParams(1.0)


def large_draft() -> torch.nn.Module:
    """A random one-layer draft with Qwen2.5-0.5B's vocabulary and width."""
    config = Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def modes(
    model, head: QuantHead, top_k: int, before: types.ModuleType | None
) -> dict[str, Callable[[], None]]:
    """Each mode's one position, on a session of 32 tokens that it leaves as it was."""
    runner = RaggedRunner(model)
    vocab = model.config.vocab_size
    kv = SessionKV()
    runner.forward([Feed(kv, [(7 * i + 3) % vocab for i in range(32)], 0)])
    old_head = before.QuantHead.of_model(model) if before is not None else None
    rng = np.random.default_rng(0)
    token = [5]

    def forward(hidden: list | None, with_head: bool):
        length = kv.length
        (logits,) = runner.forward([Feed(kv, token, 1, hidden, head=with_head)])
        kv.truncate(length)
        return logits

    def listed():
        logits = forward(None, True)
        token[0] = draft_position(logits[0], PARAMS, top_k, 0.0, DEFAULT_Q_BITS, rng)[0]

    def hidden(with_head: bool, derive=hidden_position, quant=head):
        def position():
            out: list = []
            forward(out, with_head)
            token[0] = derive(quant, out[0][0], PARAMS, rng)[0]

        return position

    got = {
        f"list (top-{top_k})": listed,
        "hidden": hidden(False),
        "hidden, head run too": hidden(True),
    }
    if before is not None:
        got["hidden at before"] = hidden(True, before.hidden_position, old_head)
    return got


def unpack_modes(model, head: QuantHead, top_k: int, gamma: int) -> dict[str, Callable[[], None]]:
    """The target's unpacking of one proposal of ``gamma`` positions, per wire, from
    the draft's hidden states after a prompt."""
    vocab = model.config.vocab_size
    ids = torch.tensor([[(7 * i + 3) % vocab for i in range(32)]])
    hidden = model(ids, output_hidden_states=True).hidden_states[-1][0, -gamma:]  # [g, d]
    logits = model.get_output_embeddings()(hidden)  # [gamma, vocab]
    rng = np.random.default_rng(0)
    hidden_drawn = [hidden_position(head, h, PARAMS, rng) for h in hidden]
    listed = [draft_position(z, PARAMS, top_k, 0.0, DEFAULT_Q_BITS, rng) for z in logits]

    def unpack(drawn, quant=None):
        sent = pack_q([q for _, q in drawn]).SerializeToString()
        tokens = [x for x, _ in drawn]

        def once():
            pb = common_pb2.PackedQ()
            pb.ParseFromString(sent)
            unpack_q(pb, vocab, tokens, head=quant, params=PARAMS)

        return once

    return {
        f"list (top-{top_k})": unpack(listed),
        "hidden": unpack(hidden_drawn, head.packed()),
        "hidden, head not packed": unpack(hidden_drawn, head),
    }


def measure(fs: dict[str, Callable[[], None]], rounds: int, positions: int) -> dict[str, dict]:
    """Per mode: the median time of one position, and each round's median. The modes
    take turns position by position (the order rotating), so that a slow spell of the
    machine falls on all of them alike."""
    names = list(fs)
    for f in fs.values():  # warm-up
        for _ in range(max(5, positions // 10)):
            f()
    per: dict[str, list[list[float]]] = {n: [] for n in names}
    for _ in range(rounds):
        times: dict[str, list[float]] = {n: [] for n in names}
        for i in range(positions):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                t = time.perf_counter()
                fs[name]()
                times[name].append(1e6 * (time.perf_counter() - t))
        for n in names:
            per[n].append(times[n])
    return {
        n: {
            "us": statistics.median(t for r in v for t in r),
            "rounds": [round(statistics.median(r), 1) for r in v],
        }
        for n, v in per.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--positions", type=int, default=200)
    ap.add_argument("--top-k", type=int, default=1024)
    ap.add_argument("--gamma", type=int, default=5, help="positions of the target's proposal")
    ap.add_argument("--against", help="also hidden_position as of this git revision")
    ap.add_argument("--no-large", action="store_true", help="only the demo draft")
    ap.add_argument("--out", default=f"results/draft-position-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    info = machine_info("cpu")
    before = module_at(args.against, "specdec/hidden_q.py") if args.against else None
    models = {"demo draft (4,096 x 160)": lambda: load_model(str(DEFAULT_DRAFT))}
    if not args.no_large:
        models["random Qwen2 draft (151,936 x 896)"] = large_draft
    results, unpacks = {}, {}
    for label, build in models.items():
        model = build()
        large = model.config.vocab_size > 100_000
        positions = max(10, args.positions // 20) if large else args.positions
        with torch.inference_mode():
            head = QuantHead.of_model(model)  # quantized once, for both sides
            results[label] = measure(modes(model, head, args.top_k, before), args.rounds, positions)
            unpacks[label] = measure(
                unpack_modes(model, head, args.top_k, args.gamma), args.rounds, positions
            )
        del model
    info["load_average_end"] = list(os.getloadavg())
    against = f" `--against {args.against}`;" if args.against else ""
    lines = [
        "# One drafted position per wire, at T=1",
        "",
        f"{info['date']}, commit {info['git_commit']}, {info['cpu_model']}; load average "
        f"{', '.join(f'{x:.2f}' for x in info['load_average'])} at the start, "
        f"{', '.join(f'{x:.2f}' for x in info['load_average_end'])} at the end.{against} "
        f"{args.rounds} rounds, the modes taking turns position by position; one thread; "
        "medians over positions.",
        "",
    ]
    base = f"list (top-{args.top_k})"
    lines += _table(results, "mode", "us per position", base, args.against)
    lines += ["", f"The target unpacking a proposal of {args.gamma} positions:", ""]
    lines += _table(unpacks, "wire", "us per proposal", base, args.against)
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps({"info": info, "results": results, "unpack": unpacks}, indent=1)
    )
    return 0


def _table(
    results: dict[str, dict], kind: str, unit: str, base: str, against: str | None
) -> list[str]:
    """Markdown rows of each draft's modes, against the ``base`` mode."""
    rows = [f"| draft | {kind} | {unit} | vs list |", "|---|---|---|---|"]
    for label, res in results.items():
        for name, r in res.items():
            shown = name.replace("before", against or "")
            rows.append(f"| {label} | {shown} | {r['us']:.0f} | {r['us'] / res[base]['us']:.2f} |")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
