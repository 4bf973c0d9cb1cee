"""Exact and statistical tests of the math in specdec.sampling (no I/O)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import kernels, sampling
from specdec.errors import NonFiniteLogits
from specdec.rng import generator
from specdec.sampling import (
    SamplingParams,
    SparseQ,
    accepted_count,
    probs_from_logits,
    quantize,
    residual_distribution,
    sparse_q,
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


@pytest.mark.parametrize("vocab", [50, 4096, 32_000])
@pytest.mark.parametrize("top_k", [0, 40, 1000])
def test_top_k_and_top_p_keep_what_transformers_keeps(vocab, top_k):
    """The CPU's top-k (a partition, not torch's top-k) and top-p (only the likely
    tokens sorted, four times more while their mass falls short, every possible
    token at last) keep the tokens transformers' warpers keep: peaked and flat
    rows, nuclei from one token to most of the vocabulary. A token may differ only
    where its cumulative mass sits within float rounding of the threshold."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(vocab + top_k)
    for scale in (0.3, 1.0, 3.0, 8.0):
        logits = torch.randn(3, vocab, generator=g) * scale
        for top_p in (0.05, 0.5, 0.9, 0.99, 1.0):
            params = SamplingParams(1.0, top_k=top_k, top_p=top_p)
            ours = torch.isinf(sampling.warp_logits(logits, params))
            ref_k = TopKLogitsWarper(top_k)(None, logits) if 0 < top_k < vocab else logits
            ref = TopPLogitsWarper(top_p)(None, ref_k) if top_p < 1.0 else ref_k
            differ = torch.nonzero(ours != torch.isinf(ref))
            for row, token in differ.tolist():  # only at the threshold, within rounding
                ranked, order = torch.sort(ref_k[row])
                cum = ranked.softmax(-1).double().cumsum(-1)
                at = int(torch.nonzero(order == token)[0])
                assert abs(float(cum[at]) - (1 - top_p)) < 1e-6, (scale, top_p, row, token)
            assert len(differ) <= 2, (scale, top_p)


@pytest.mark.parametrize("vocab", [100, 4096, 32000])
def test_top_p_keeps_the_tied_token_transformers_keeps(vocab):
    """Tokens of equal score on both sides of top-p's cut: transformers keeps the one
    ``torch.sort`` places last, and so does the CPU's top-p now (before, its own
    stable order kept the lowest id: another token than ``generate()`` samples, and
    another than on a GPU). With bfloat16 logits such ties are common: at 32,000
    tokens and top_p 0.9, most rows had one."""
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(vocab)
    tied = torch.full((1, vocab), -5.0)
    tied[0, :2] = 20.0  # two equal, far above the rest
    rows = [tied, (torch.randn(8, vocab, generator=g) * 3).bfloat16().float()]
    for logits in rows:
        for top_p in (1e-9, 0.3, 0.5, 0.9):
            params = SamplingParams(1.0, top_p=top_p)
            ours = torch.isinf(sampling.warp_logits(logits, params))
            ref = torch.isinf(TopPLogitsWarper(top_p)(None, logits))
            for row, token in torch.nonzero(ours != ref).tolist():  # within rounding only
                ranked, order = torch.sort(logits[row])
                cum = ranked.softmax(-1).double().cumsum(-1)
                at = int(torch.nonzero(order == token)[0])
                assert abs(float(cum[at]) - (1 - top_p)) < 1e-6, (top_p, row, token)


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[1.0, 3.0, 2.0], [5.0, -1.0, 0.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    q = sparse_q(logits[0], SamplingParams(temperature=0.0), 8, 0.0)
    assert q.ids.tolist() == [1] and q.prob(1) == 1.0 and q.tail == 0


@pytest.mark.parametrize(
    "params", [SamplingParams(1.0), SamplingParams(0.8, top_k=5), SamplingParams(1.0, top_p=0.7)]
)
def test_sparse_q_is_the_truncated_warped_q_quantized(params):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(4)) * 2
    q = sparse_q(logits, params, max_entries=10, eps=0.0)
    full = probs_from_logits(logits, params).double()
    listed = full.topk(len(q.ids)).indices
    assert set(q.ids.tolist()) <= set(listed.tolist()) and len(q.ids) <= 10
    assert int(q.counts.sum()) + q.tail == 1 << 16
    dense = q.dense()
    assert abs(float(dense.sum()) - 1.0) < 1e-12
    if params.full_support:  # the mass beyond the list is spread over everything else
        rest = 1.0 - float(full[q.ids].sum())
        assert abs(q.tail / 2**16 - rest) < 2e-4
    else:  # the listed tokens are renormalized; nothing outside the warped support
        assert q.tail == 0
        expected = full[q.ids] / full[q.ids].sum()
        torch.testing.assert_close(dense[q.ids], expected, rtol=0, atol=2 / 2**16)


@pytest.mark.parametrize("vocab", [4096, 32_000, 151_936])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sparse_q_lists_the_most_likely_tokens_at_any_vocabulary(vocab, temperature):
    """The listed tokens are the k most likely, in ascending order (the wire's), less
    only those whose count rounds to 0, and each count is within one of its warped
    mass. With a cut by mass (eps > 0) they are listed the most likely first."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(6)) * 3
    params = SamplingParams(temperature)
    top = logits.topk(256).indices
    by_mass = sparse_q(logits, params, max_entries=256, eps=1e-9)
    assert set(by_mass.ids.tolist()) == set(top.tolist()) and by_mass.ids[0] == top[0]
    q = sparse_q(logits, params, max_entries=256, eps=0.0)
    assert q.ids.tolist() == sorted(set(q.ids.tolist()) & set(top.tolist()))
    dropped = sorted(set(top.tolist()) - set(q.ids.tolist()))
    p = probs_from_logits(logits.double(), params).numpy()
    assert (p[dropped] * (1 << 16) < 1).all()
    expected = p[q.ids] * (1 << 16)
    assert np.abs(q.counts - expected).max() <= 1.0 + 1e-6
    assert int(q.counts.sum()) + q.tail == 1 << 16


def _layouts(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(vocab)
    scores = (rng.standard_normal(vocab) * 3).astype(np.float32)
    padded = scores.copy()
    padded[vocab // 2 :] = -np.inf  # a checkpoint's padded vocabulary
    strided = scores.copy()
    strided[::8] += 20.0  # every token the strided sample reads beats all the others
    return {
        "random": scores,
        "ascending": np.sort(scores),
        "descending": np.sort(scores)[::-1].copy(),
        "padded": padded,
        "strided": strided,
    }


@pytest.mark.parametrize("vocab", [300, 4096, 32_000, 151_936])
@pytest.mark.parametrize("k", [1, 64, 256, 1024])
def test_most_likely_finds_the_k_largest_from_a_sample_or_the_whole(vocab, k):
    """``_most_likely`` guesses a cut from a strided sample; whatever the scores'
    layout (sorted, a padded vocabulary, or the sample reading only the leaders,
    which puts the cut too high and must fall back to the whole), it returns the
    k largest with the largest first."""
    for name, z in _layouts(vocab).items():
        kk = min(k, vocab - 1)
        ids = sampling._most_likely(z, kk)
        assert len(ids) == kk, name
        want = np.argsort(-z.astype(np.float64), kind="stable")[:kk]
        assert np.sort(z[ids]).tolist() == np.sort(z[want]).tolist(), name
        assert len(set(ids.tolist())) == kk, name
        assert z[ids[0]] == z.max(), name


@pytest.mark.parametrize("vocab", [300, 4096, 32_000, 151_936])
@pytest.mark.parametrize("k", [1, 64, 256, 1024])
def test_largest_ascending_finds_the_k_largest_in_id_order(vocab, k):
    """``_largest_ascending``, from a sample's cut or the whole, on the same layouts
    and on ties at the k-th score: exactly k distinct ids, ascending, the k largest."""
    layouts = _layouts(vocab)
    tied = layouts["random"].copy()
    tied[np.argsort(-tied)[max(0, k - 3) : k + 5]] = 1.5  # ties straddle the k-th
    layouts["tied"] = tied
    for name, z in layouts.items():
        kk = min(k, vocab - 1)
        ids = sampling._largest_ascending(z, kk)
        assert len(ids) == kk and (np.diff(ids) > 0).all(), name
        want = np.argsort(-z.astype(np.float64), kind="stable")[:kk]
        assert np.sort(z[ids]).tolist() == np.sort(z[want]).tolist(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_greedy_tokens_are_torchs_argmax(dtype):
    """numpy's argmax on the CPU picks what torch's does: the first of tied maxima (many
    in half precision), +inf, every row of a batch, any strides; a row with a NaN
    (which both would pick) is refused, wherever it is."""
    x = (torch.randn(6, 5000, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    x[1, 4000] = x[1, 9] = x[1].max() + 1  # a tie: the first wins
    x[3] = float("-inf")
    x[4, 100] = float("inf")
    assert sampling.greedy_tokens(x) == x.argmax(dim=-1).tolist()
    assert sampling.greedy_tokens(x[1]) == int(x[1].argmax()) == 9
    assert sampling.greedy_tokens(x.t()[:100]) == x.t()[:100].argmax(dim=-1).tolist()
    assert sampling.greedy_tokens(x.reshape(2, 3, -1)) == x.argmax(dim=-1).reshape(2, 3).tolist()
    x[2, 17] = float("nan")
    for rows in (x, x[2], x.t()[:100], x.reshape(2, 3, -1)):
        with pytest.raises(NonFiniteLogits):
            sampling.greedy_tokens(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_top2_is_the_argmax_and_the_runner_up(dtype):
    """A greedy draft's token and second choice in one call: the argmax as
    ``greedy_tokens`` picks it (the first of tied maxima, however many), then the next
    best (the next tied one on a tie); a NaN is refused."""
    x = (torch.randn(6, 5000, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    x[1, 4000] = x[1, 9] = x[1, 70] = x[1].max() + 1  # a three-way tie
    x[3] = float("-inf")
    x[4, 100] = float("inf")
    for row in x:
        first, second = sampling.greedy_top2(row)
        assert first == sampling.greedy_tokens(row)
        rest = row.clone()
        rest[first] = float("-inf")
        assert row[second] == rest.max() and second != first
    assert sampling.greedy_top2(x[1]) == (9, 70)
    assert sampling.greedy_top2(x[3]) == (0, 1)
    x[2, 17] = float("nan")
    with pytest.raises(NonFiniteLogits):
        sampling.greedy_top2(x[2])


def test_sparse_q_takes_half_precision_logits():
    """A bfloat16 or float16 draft's logits give the q their float32 values give."""
    logits = torch.randn(300, generator=torch.Generator().manual_seed(5)) * 3
    for dtype in (torch.bfloat16, torch.float16):
        half = logits.to(dtype)
        a = sparse_q(half, SamplingParams(0.7), max_entries=32, eps=0.0)
        b = sparse_q(half.float(), SamplingParams(0.7), max_entries=32, eps=0.0)
        assert a.ids.tolist() == b.ids.tolist() and a.counts.tolist() == b.counts.tolist()
        assert a.tail == b.tail


def test_quantize_cuts_by_mass_and_rounds_by_largest_remainder():
    probs = np.array([0.5, 0.3, 0.15, 0.04, 0.01])
    ids = np.arange(5)
    q = quantize(ids, probs, vocab=100, eps=0.1, bits=4, keep_tail=True)
    assert q.ids.tolist() == [0, 1, 2]  # 0.95 >= 1 - 0.1
    assert int(q.counts.sum()) + q.tail == 16 and q.tail == int(0.05 * 16)
    q = quantize(ids, probs, vocab=100, eps=0.0, bits=16, keep_tail=False)
    assert q.tail == 0 and int(q.counts.sum()) == 1 << 16
    assert np.abs(q.counts / 2**16 - probs).max() <= 2**-16


def test_sparse_q_samples_exactly_what_it_describes():
    """Listed tokens and the uniform tail, drawn with integer arithmetic, match q."""
    q = SparseQ(np.array([3, 7, 11]), np.array([30000, 20000, 10000]), 5536, vocab=20)
    g = generator(7)
    n = 60000
    draws = torch.tensor([q.sample(g) for _ in range(n)])
    dense = q.dense()
    assert tv(draws, dense) < tv_threshold(dense, n)
    assert (draws == 7).sum() > 0 and ((draws != 3) & (draws != 7) & (draws != 11)).sum() > 0


def test_verify_greedy_accepts_exactly_the_argmax():
    logits = torch.full((4, 10), -100.0)
    for row, tok in enumerate([3, 4, 5, 6]):
        logits[row, tok] = 100.0
    drafts = [3, 4, 9]
    qs = [SparseQ.point(x, 10) for x in drafts]
    r = verify_draft(logits, drafts, qs, SamplingParams(temperature=0.0), torch.zeros(4))
    n = accepted_count(r.p_draft, r.q_draft, [0.0, 0.0, 0.0])
    assert n == 2 and r.q_draft == [1.0, 1.0, 1.0]
    assert step_tokens(drafts, n, r.residual_tokens, r.bonus_token) == [3, 4, 5]


@pytest.mark.parametrize("vocab", [50, 4096, 151_936])
def test_a_plain_token_is_drawn_as_the_general_path_draws_it(vocab):
    """A draw without drafts (every token of a plain run) takes a short path of its
    own; it must give the token the general path gives (``inverse_cdf`` over p in
    float64), the same uniform in, for every warping, and refuse NaN as it does."""
    g = torch.Generator().manual_seed(vocab)
    warps = [
        SamplingParams(1.0),
        SamplingParams(0.7, top_k=40),
        SamplingParams(1.3, top_p=0.9),
        SamplingParams(0.5, top_k=100, top_p=0.8),
    ]
    for i in range(200 if vocab < 100_000 else 12):
        logits = torch.randn(1, vocab, generator=g) * float(0.5 + 4 * torch.rand(1, generator=g))
        params = warps[i % len(warps)]
        u = torch.rand(1, generator=g, dtype=torch.float64)
        if i % 10 == 0:  # at the edges of [0, 1)
            u[0] = 0.0 if i % 20 == 0 else 1.0 - 2**-53
        got = verify_draft(logits, [], [], params, u).bonus_token
        want = int(sampling.inverse_cdf(probs_from_logits(logits, params).double(), u)[0])
        assert got == want, (i, params)
    logits[0, 3] = float("nan")
    with pytest.raises(NonFiniteLogits):
        verify_draft(logits, [], [], SamplingParams(1.0), torch.zeros(1, dtype=torch.float64))


# ---- statistical: one whole step, many times, in-process -------------------------------


def _dense_q(q: torch.Tensor) -> SparseQ:
    """q as an untruncated SparseQ at 30 bits (the draft's exact proposal)."""
    return quantize(np.arange(q.shape[0]), q.numpy(), q.shape[0], eps=0.0, bits=30, keep_tail=False)


def _simulate(p_rows, q_rows, n_samples, seed, broken=False):
    """Tokens at position 1 from n_samples one-step speculations with gamma = 2.

    p_rows: (p1 [vocab], p2 given x1 [vocab, vocab]); q_rows likewise.
    """
    p1, p2_given = p_rows
    q1, q2_given = q_rows
    g = generator(seed)
    q1s = _dense_q(q1)
    q2s = [_dense_q(row) for row in q2_given]
    orig = sampling.residual_distribution
    if broken:  # the classic bug: resample from p on rejection (on the reference path)
        sampling.residual_distribution = lambda p, q: p
        kernels.ENABLED = False
    try:
        first = []
        for _ in range(n_samples):
            x1 = q1s.sample(g)
            x2 = q2s[x1].sample(g)
            logits = torch.stack([p1, p2_given[x1], p1]).log()
            u = torch.tensor(g.random(3), dtype=torch.float64)
            r = verify_draft(logits, [x1, x2], [q1s, q2s[x1]], SamplingParams(1.0), u)
            n = accepted_count(r.p_draft, r.q_draft, g.random(2))
            out = step_tokens([x1, x2], n, r.residual_tokens, r.bonus_token)
            first.append(out[0])
    finally:
        sampling.residual_distribution = orig
        kernels.ENABLED = True
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
