"""The compiled judge (specdec.kernels) draws what the reference in numpy and torch
draws, for the same uniforms, and refuses what the reference refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import kernels
from specdec.errors import NonFiniteLogits
from specdec.rng import uniforms
from specdec.sampling import (
    SamplingParams,
    SparseQ,
    inverse_cdf,
    probs_from_logits,
    residual_distribution,
    sparse_q,
    verify_draft,
)

PARAMS = [
    SamplingParams(1.0),
    SamplingParams(0.7),
    SamplingParams(1.3, top_k=20),
    SamplingParams(1.0, top_p=0.8),
]


def _reference(*args):
    """verify_draft on the reference path (numpy and torch)."""
    kernels.ENABLED = False
    try:
        return verify_draft(*args)
    finally:
        kernels.ENABLED = True


def _case(seed: int, vocab: int, gamma: int, params: SamplingParams, entries: int, eps: float):
    """Target logits [gamma + 1, vocab] and a draft's x_i ~ q_i from nearby logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(gamma + 1, vocab, generator=g) * 3
    rng = np.random.default_rng(seed)
    drafts, qs = [], []
    for i in range(gamma):
        q = sparse_q(logits[i] + torch.randn(vocab, generator=g), params, entries, eps)
        drafts.append(q.sample(rng))
        qs.append(q)
    return logits, drafts, qs


def _close_call(logits, drafts, qs, params, u, i: int, a: int, b: int) -> bool:
    """Whether draws a and b at row i differ only by rounding: the exact float64 CDF
    of the row crosses u_i times its mass within 1e-9 of it between a and b."""
    p = probs_from_logits(logits.double(), params)
    if i < len(drafts):
        row = residual_distribution(p[i : i + 1], qs[i].dense()[None])[0]
    else:
        row = p[i]
    cdf = row.cumsum(0)
    return abs(float(cdf[min(a, b)]) - float(u[i]) * float(cdf[-1])) < 1e-9


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.sampled_from([2, 7, 64, 1000, 4096]),
    gamma=st.integers(0, 6),
    params=st.sampled_from(PARAMS),
    entries=st.sampled_from([0, 1, 8, 256]),
    eps=st.sampled_from([0.0, 0.01]),
    float64=st.booleans(),
)
def test_the_compiled_judge_draws_what_the_reference_draws(
    seed, vocab, gamma, params, entries, eps, float64
):
    logits, drafts, qs = _case(seed, vocab, gamma, params, entries, eps)
    if float64:
        logits = logits.double()
    u = uniforms(seed, gamma + 1)
    ours = verify_draft(logits, drafts, qs, params, u)
    ref = _reference(logits, drafts, qs, params, u)
    assert ours.p_draft == ref.p_draft and ours.q_draft == ref.q_draft
    for i, (a, b) in enumerate(
        zip(
            ref.residual_tokens + [ref.bonus_token],
            ours.residual_tokens + [ours.bonus_token],
            strict=True,
        )
    ):
        assert a == b or _close_call(logits, drafts, qs, params, u, i, a, b), (i, a, b)


def test_a_row_without_residual_mass_draws_from_p():
    """p == q at a position: x is never rejected there, and the kernel's residual
    draw comes from p, as ``residual_distribution``'s does."""
    vocab, scale = 16, 2**16
    q = SparseQ(np.array([1, 4, 9]), np.array([40000, 20000, 5000]), 536, vocab)
    p = torch.stack([q.dense(), torch.full((vocab,), 1 / vocab, dtype=torch.float64)])
    meta = np.array([4, 3, 536], dtype=np.int64)
    for s in range(50):
        u = uniforms(s, 2)
        out = np.empty(4)
        assert kernels.judge(p.numpy(), meta, q.ids, q.counts, scale, u.numpy(), out) == kernels.OK
        rows = torch.cat([residual_distribution(p[:1], q.dense()[None]), p[1:]])
        assert torch.equal(rows[0], p[0])  # (the reference's rule for an empty row)
        assert out[2:].tolist() == inverse_cdf(rows, u).tolist()
        assert out[:2].tolist() == [float(p[0, 4]), q.prob(4)]


@pytest.mark.parametrize("row", [0, 2])
def test_non_finite_logits_are_refused_as_by_the_reference(row):
    logits, drafts, qs = _case(3, 50, 2, SamplingParams(1.0), 8, 0.0)
    logits[row, 7] = float("nan")
    for enabled in (True, False):
        kernels.ENABLED = enabled
        try:
            with pytest.raises(NonFiniteLogits):
                verify_draft(logits, drafts, qs, SamplingParams(1.0), uniforms(1, 3))
        finally:
            kernels.ENABLED = True


def test_warm_compiles_without_error():
    kernels.warm()
