"""A model whose logits hold NaN (an overflow, most often in float16): nothing can be
drawn from them, so no token is made up from them.

* In the sampling math, NaN (and +inf, where probabilities are formed) raises
  ``NonFiniteLogits``; -inf (what top-k / top-p remove) and a greedy +inf do not.
* A draft that overflows costs only its speculation: each step falls back to the
  target alone, whose output stays exact, and the request backs off the draft
  (1, 2, 4, ... steps) instead of re-opening its session every step.
* A target that overflows fails the request with an error saying so.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdec.errors import Internal, NonFiniteLogits
from specdec.runtime.loading import load_model, load_tokenizer
from specdec.sampling import SamplingParams, SparseQ, sparse_q, verify_draft

from .inprocess import in_process

# numpy warns of inf - inf on the way to the error these tests expect.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
VOCAB = 50
GREEDY, T1 = SamplingParams(0.0), SamplingParams(1.0)


def _rows(n: int) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(n)) * 3


@pytest.mark.parametrize("params", [GREEDY, T1, SamplingParams(0.7, top_k=5, top_p=0.9)])
def test_a_nan_logit_is_refused_wherever_a_token_is_drawn(params):
    bad = _rows(3)
    bad[1, 7] = float("nan")
    with pytest.raises(NonFiniteLogits, match="not finite"):
        sparse_q(bad[1], params, max_entries=8, eps=0.0)
    drafts = [1, 2]
    qs = [SparseQ.point(x, VOCAB) for x in drafts] if params.greedy else [
        sparse_q(row, params, 8, 0.0) for row in _rows(2)
    ]  # fmt: skip
    drafts = drafts if params.greedy else [int(q.ids[0]) for q in qs]
    with pytest.raises(NonFiniteLogits):  # in a drafted position's row
        verify_draft(bad, drafts, qs, params, torch.rand(3, dtype=torch.float64))
    bonus_only = _rows(3)
    bonus_only[2, 0] = float("nan")
    with pytest.raises(NonFiniteLogits):  # in the bonus row, the only row of a plain step
        verify_draft(bonus_only[2:], [], [], params, torch.rand(1, dtype=torch.float64))


def test_plus_inf_is_refused_where_probabilities_are_formed_and_chosen_when_greedy():
    rows = _rows(2)
    rows[0, 3] = float("inf")
    with pytest.raises(NonFiniteLogits):
        sparse_q(rows[0], T1, max_entries=8, eps=0.0)
    with pytest.raises(NonFiniteLogits):
        verify_draft(rows[:1], [], [], T1, torch.rand(1, dtype=torch.float64))
    assert sparse_q(rows[0], GREEDY, 8, 0.0).ids.tolist() == [3]  # as generate() picks it
    assert verify_draft(rows[:1], [], [], GREEDY, torch.zeros(1)).bonus_token == 3


def test_minus_inf_is_only_a_token_removed():
    rows = _rows(2)
    rows[0, :40] = float("-inf")  # a padded vocabulary, or what top-k removed
    q = sparse_q(rows[0], T1, max_entries=8, eps=0.0)
    assert set(q.ids.tolist()) <= set(range(40, VOCAB)) and q.tail == 0 or q.tail > 0
    v = verify_draft(rows, [int(q.ids[0])], [q], T1, torch.rand(2, dtype=torch.float64))
    assert v.residual_tokens[0] >= 40 and 0 <= v.bonus_token < VOCAB


def _overflowing(src, dst):
    """The model in ``src`` with one output row NaN: every position's logits hold a NaN."""
    model = load_model(str(src))
    with torch.no_grad():
        model.get_output_embeddings().weight[5] = float("nan")
    model.save_pretrained(dst)
    load_tokenizer(str(src)).save_pretrained(dst)
    return dst


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_overflowing_draft_costs_speculation_not_exactness(tmp_path, llama_pair, temperature):
    draft, target = llama_pair
    broken = _overflowing(draft, tmp_path / "nan-draft")
    fields = dict(prompt=[3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=40, gamma=3, seed=11)

    opens = []

    async def scenario():
        async with in_process(broken, target) as system:
            open_draft = system.drafter.open_draft

            async def counted(*args, **kw):
                opens.append(1)
                return await open_draft(*args, **kw)

            system.drafter.open_draft = counted
            return await system.generate(temperature=temperature, **fields)

    got, _, stats = asyncio.run(scenario())
    assert len(got) == 40 and stats.accepted == 0
    assert stats.fallback_steps > 0 and stats.fallback_reasons == {"nonfinitelogits"}
    # The draft is tried (its session opened) at fallback steps 1, 3, 6, 11, ...
    # (backing off 1, 2, 4, ... steps), not at every one of them.
    tries = sum(1 for step in (1, 3, 6, 11, 20, 37) if step <= stats.fallback_steps)
    assert len(opens) == tries < stats.fallback_steps, (opens, stats.fallback_steps)
    if temperature == 0.0:  # the target's own greedy output
        ids = torch.tensor([fields["prompt"]])
        want = load_model(str(target)).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40
        )
        assert got == want[0, ids.shape[1] :].tolist()


def test_an_overflowing_target_fails_the_request_saying_why(tmp_path, llama_pair):
    draft, target = llama_pair
    broken = _overflowing(target, tmp_path / "nan-target")

    async def scenario():
        async with in_process(draft, broken) as system:
            await system.generate(prompt=[3, 1, 4], max_new_tokens=4, temperature=1.0, seed=1)

    with pytest.raises(Internal, match="not finite"):
        asyncio.run(scenario())
