"""The bundled demo pair (models/demo): it loads through the project's own
loader, its tokenizers agree, greedy generation through the full local
pipeline equals the target's own generate(), and it accepts drafts often."""

from __future__ import annotations

import pytest
import torch

from specdec.config import REPO_ROOT
from specdec.runtime.loading import load_model, load_tokenizer, tokenizer_fingerprint
from specdec.sampling import SamplingParams, acceptance_rate, probs_from_logits

from .stack import drafted_on, guesses_used, local_stack
from .test_greedy import reference

DEMO = REPO_ROOT / "models" / "demo"
# Held-out style prompts (plain English in the corpus' register).
PROMPTS = [
    "It was a fine morning, and Elizabeth walked out alone",
    "Mrs. Bennet was quite disconcerted. She could not bear",
    "The carriage stopped at the door, and the whole party",
    "Captain Wentworth had no fortune. He had been lucky in his profession",
]


@pytest.fixture(scope="module")
def pair():
    draft, target = DEMO / "draft", DEMO / "target"
    assert (draft / "config.json").exists() and (target / "config.json").exists(), (
        "the demo pair is missing: see models/demo/MODEL_CARD.md to rebuild it"
    )
    return draft, target


def head_starts(stack) -> float:
    """Blocks the draft drafted before the orchestrator asked for them, and that were
    used: paced (fresh pipeline blocks), drafted on the target's echo (``draft_on``),
    drafted ahead during a verify, or guessed for a rejection (``draft.guesses``)."""
    fresh = stack.metric("draft", "specdec_model_pipeline_blocks_total", 'kind="fresh"')
    ahead = stack.metric("orchestrator", "specdec_overlapped_steps_total", 'outcome="used"')
    return fresh + drafted_on(stack, "used") + ahead + guesses_used(stack)


def test_tokenizers_agree(pair):
    draft_tok, target_tok = (load_tokenizer(str(d)) for d in pair)
    assert tokenizer_fingerprint(draft_tok) == tokenizer_fingerprint(target_tok)
    assert target_tok.eos_token_id is not None
    assert target_tok.decode(target_tok.encode(PROMPTS[0])) == PROMPTS[0]


def test_greedy_through_pipeline_equals_target_generate(tmp_path, pair):
    tok = load_tokenizer(str(pair[1]))
    with local_stack(tmp_path, *pair) as stack:
        for prompt in PROMPTS[:2]:
            ids = tok.encode(prompt)
            want = reference(pair[1], ids, 32)
            got, text, stats = stack.generate_raw(
                prompt=ids, max_new_tokens=32, temperature=0.0, gamma=4
            )
            assert got == want
            assert stats.accepted_tokens > 0
            assert any(c.isalpha() for c in text)
        # Adaptive requests (gamma and seed unset) on a pair worth speculating with: the
        # draft starts each next block before it is asked (``head_starts``; which way is
        # the policy's choice, from measured times). An adaptive request fixes the next
        # step's gamma when it asks the draft to draft on: none is drafted for a gamma
        # that step then does not ask for.
        started, discarded = head_starts(stack), drafted_on(stack, "discarded")
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            got, _, stats = stack.generate_raw(prompt=ids, max_new_tokens=48, temperature=0.0)
            assert got == reference(pair[1], ids, 48) and stats.adaptive
        assert head_starts(stack) >= started + len(PROMPTS)
        assert drafted_on(stack, "discarded") == discarded
        # Drafting ahead, greedy: the draft also drafts the next block for rejections,
        # from its second choice (draft.guesses); on this pair many are right.
        guessed = guesses_used(stack)
        for prompt in PROMPTS[:2]:
            ids = tok.encode(prompt)
            got, _, stats = stack.generate_raw(
                prompt=ids, max_new_tokens=48, temperature=0.0, gamma=4, overlap=True
            )
            assert got == reference(pair[1], ids, 48)
        used_now = guesses_used(stack)
        assert used_now >= guessed + 4


def test_acceptance_rate_at_temperature_one(pair):
    draft, target = (load_model(str(d)) for d in pair)
    tok = load_tokenizer(str(pair[1]))
    params = SamplingParams(1.0)
    alphas = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            p = probs_from_logits(target(ids).logits[0].float(), params)
            q = probs_from_logits(draft(ids).logits[0].float(), params)
        alphas.append(acceptance_rate(p, q)[4:])  # skip the first few positions
    alpha = float(torch.cat(alphas).mean())
    print(f"alpha at temperature 1 on {len(PROMPTS)} prompts: {alpha:.3f}")
    assert alpha >= 0.6, alpha
