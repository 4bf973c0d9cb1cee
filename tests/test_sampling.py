"""Exact and statistical tests of the math in specdec.sampling (no I/O)."""

from __future__ import annotations

import pytest
import torch

from specdec import sampling
from specdec.sampling import (
    SamplingParams,
    accepted_count,
    draft_distribution,
    probs_from_logits,
    residual_distribution,
    step_tokens,
    verify_draft,
)

from .stats import tv, tv_threshold


def emitted_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(first emitted token = x) for one drafted token: accept mass + rejection mass * residual."""
    accept = q * torch.clamp(p / torch.where(q > 0, q, torch.ones_like(q)), max=1.0)
    accept = torch.where(q > 0, accept, torch.zeros_like(q))  # = min(p, q)
    rejection_mass = 1.0 - accept.sum(-1, keepdim=True)
    return accept + rejection_mass * residual_distribution(p, q)


def _pairs(vocab: int = 50):
    g = torch.Generator().manual_seed(0)
    rand = lambda: torch.rand(vocab, generator=g, dtype=torch.float64)  # noqa: E731
    p = rand().softmax(-1)
    yield "random", p, rand().softmax(-1)
    yield "q = p", p, p.clone()
    disjoint_p = torch.zeros(vocab, dtype=torch.float64)
    disjoint_p[: vocab // 2] = 1.0 / (vocab // 2)
    disjoint_q = torch.zeros(vocab, dtype=torch.float64)
    disjoint_q[vocab // 2 :] = 1.0 / (vocab - vocab // 2)
    yield "disjoint supports", disjoint_p, disjoint_q
    one_hot = torch.zeros(vocab, dtype=torch.float64)
    one_hot[7] = 1.0
    yield "one-hot p", one_hot, rand().softmax(-1)
    q_zeros = (rand() * 10).softmax(-1)
    q_zeros[::3] = 0.0
    yield "q with zeros", p, q_zeros / q_zeros.sum()
    peaked = (rand() * 40).softmax(-1)
    yield "peaked vs flat", peaked, torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)


@pytest.mark.parametrize("name,p,q", list(_pairs()), ids=[n for n, *_ in _pairs()])
def test_accept_plus_residual_equals_p_exactly(name, p, q):
    out = emitted_distribution(p, q)
    torch.testing.assert_close(out, p, rtol=0, atol=1e-12)


def test_residual_is_a_distribution_and_falls_back_to_p():
    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    torch.testing.assert_close(residual_distribution(p, p), p)
    r = residual_distribution(p, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(r, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))


def test_accepted_count_stops_at_first_rejection():
    p = torch.tensor([0.5, 0.1, 0.2])
    q = torch.tensor([0.25, 0.5, 0.5])
    assert accepted_count(p, q, torch.tensor([0.99, 0.1, 0.5])) == 2  # 0.5*0.5 >= 0.2
    assert accepted_count(p, q, torch.tensor([0.0, 0.3, 0.0])) == 1  # 0.3*0.5 >= 0.1
    assert accepted_count(p, q, torch.tensor([0.0, 0.0, 0.0])) == 3
    assert accepted_count(torch.tensor([0.0]), torch.tensor([0.5]), torch.tensor([0.0])) == 0
    assert accepted_count(torch.empty(0), torch.empty(0), torch.empty(0)) == 0


def test_step_tokens_uses_residual_or_bonus():
    assert step_tokens([5, 6, 7], 1, [9, 8, 4], 3) == [5, 8]
    assert step_tokens([5, 6, 7], 3, [9, 8, 4], 3) == [5, 6, 7, 3]
    assert step_tokens([], 0, [], 3) == [3]


def test_warping_matches_transformers_processors():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3)) * 3
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
    ref = TemperatureLogitsWarper(0.7)(None, logits)
    ref = TopKLogitsWarper(20)(None, ref)
    ref = TopPLogitsWarper(0.8)(None, ref)
    torch.testing.assert_close(probs_from_logits(logits, params), ref.softmax(-1))


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[1.0, 3.0, 2.0], [5.0, -1.0, 0.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    ids, q = draft_distribution(logits[0], SamplingParams(temperature=0.0), 8)
    assert ids.tolist() == [1] and q.tolist() == [1.0]


@pytest.mark.parametrize(
    "params", [SamplingParams(1.0), SamplingParams(0.8, top_k=5), SamplingParams(1.0, top_p=0.7)]
)
def test_draft_distribution_is_truncated_warped_q(params):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(4)) * 2
    ids, q = draft_distribution(logits, params, wire_top_k=10)
    assert ids.numel() <= 10 and abs(float(q.sum()) - 1) < 1e-6
    full = probs_from_logits(logits, params)
    expected = full[ids] / full[ids].sum()
    torch.testing.assert_close(q, expected)
    assert set(ids.tolist()) <= set(full.topk(10).indices.tolist()) | set(
        (full == full[ids].min()).nonzero().flatten().tolist()
    )


def test_verify_greedy_accepts_exactly_the_argmax():
    logits = torch.full((4, 10), -100.0)
    for row, tok in enumerate([3, 4, 5, 6]):
        logits[row, tok] = 100.0
    drafts = torch.tensor([3, 4, 9])
    q = torch.zeros(3, 10)
    q[torch.arange(3), drafts] = 1.0
    r = verify_draft(logits, drafts, q, SamplingParams(temperature=0.0))
    n = accepted_count(r.p_draft, torch.ones(3), torch.zeros(3))
    assert n == 2
    assert step_tokens(drafts.tolist(), n, r.residual_tokens.tolist(), r.bonus_token) == [3, 4, 5]


# ---- statistical: one whole step, many times, in-process -------------------------------


def _simulate(p_rows, q_rows, n_samples, seed, broken=False):
    """Tokens at positions 1 and 2 from n_samples one-step speculations with gamma = 2.

    p_rows: [vocab, vocab] p at position 2 given x_1 (row), plus p1: [vocab] at index -1.
    """
    p1, p2_given = p_rows
    q1, q2_given = q_rows
    vocab = p1.shape[0]
    g = torch.Generator().manual_seed(seed)
    x1 = torch.multinomial(q1.expand(n_samples, vocab), 1, generator=g).squeeze(-1)
    x2 = torch.multinomial(q2_given[x1], 1, generator=g).squeeze(-1)
    orig = sampling.residual_distribution
    if broken:  # the classic bug: resample from p on rejection
        sampling.residual_distribution = lambda p, q: p
    try:
        first, second = [], []
        for i in range(n_samples):
            drafts = torch.stack([x1[i], x2[i]])
            logits = torch.stack([p1, p2_given[x1[i]], p1]).log()
            q = torch.stack([q1, q2_given[x1[i]]])
            r = verify_draft(logits, drafts, q, SamplingParams(1.0), g)
            u = torch.rand(2, generator=g, dtype=torch.float64)
            n = accepted_count(r.p_draft, q[torch.arange(2), drafts], u)
            out = step_tokens(drafts.tolist(), n, r.residual_tokens.tolist(), r.bonus_token)
            first.append(out[0])
            if len(out) > 1:
                second.append((out[0], out[1]))
    finally:
        sampling.residual_distribution = orig
    return torch.tensor(first)


def test_one_step_matches_p_and_broken_sampler_is_caught():
    vocab, n = 12, 4000
    g = torch.Generator().manual_seed(5)
    p1 = (torch.randn(vocab, generator=g) * 2).softmax(-1).double()
    q1 = (torch.randn(vocab, generator=g) * 2).softmax(-1).double()
    p2 = (torch.randn(vocab, vocab, generator=g) * 2).softmax(-1).double()
    q2 = (torch.randn(vocab, vocab, generator=g) * 2).softmax(-1).double()
    threshold = tv_threshold(p1, n)
    good = tv(_simulate((p1, p2), (q1, q2), n, seed=1), p1)
    bad = tv(_simulate((p1, p2), (q1, q2), n, seed=1, broken=True), p1)
    assert good < threshold, (good, threshold)
    assert bad > threshold, (bad, threshold)
