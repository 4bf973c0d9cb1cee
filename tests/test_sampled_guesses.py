"""Guesses at temperature > 0: the target's residual draw coupled to the draft's guess.

Where x_i is rejected the target emits a draw from r = norm(max(0, p_i - q_i)).
The draft guesses it with y ~ g = q_i without x_i (``guess_from``) and the target
keeps y with probability min(1, r(y) / g(y)), else draws from norm(max(0, r - g))
(``guess_coupling``). The emitted token must still be distributed as r:

* exact, float64: summing over y ~ g, the coupled draw's distribution is r, and
  it equals y with probability sum(min(r, g)); two broken couplings (falling
  back to r, or always keeping the guess) fail the same identity;
* statistical, with the code both services run: ``guess_from``'s draws follow g,
  and ``verify_draft``'s residual draws with guesses follow r (and hit the guess
  about sum(min(r, g)) of the time); the same test with a coupling that always
  keeps the guess fails.

Through gRPC: ``tests/test_overlap.py`` (sampled requests that draft ahead, with
guesses, follow the target; a planted broken coupling fails).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdec.sampling as sampling
from specdec.rng import generator
from specdec.sampling import (
    SamplingParams,
    SparseQ,
    guess_coupling,
    guess_from,
    guess_g,
    probs_from_logits,
    residual_distribution,
    sparse_q,
    verify_draft,
)

from .stats import tv, tv_threshold


def _rows(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random distributions over ``vocab`` tokens, float64."""
    g = torch.Generator().manual_seed(seed)
    return tuple(
        (torch.randn(vocab, generator=g, dtype=torch.float64) * 2).softmax(-1) for _ in range(2)
    )


def coupled_distribution(r: torch.Tensor, g: torch.Tensor, coupling=guess_coupling):
    """P(z) of the coupled draw, y ~ g summed over: [vocab] float64; and P(z = y)."""
    out = torch.zeros_like(r)
    hit = 0.0
    for y in range(r.shape[0]):
        if g[y] == 0:
            continue
        keep, h = coupling(r, g, y)
        out[y] += g[y] * keep
        out += g[y] * (1.0 - keep) * h
        hit += float(g[y] * keep) + float(g[y] * (1.0 - keep) * h[y])
    return out, hit


def _fallback_to_r(r, g, y):  # BROKEN: on not keeping y, draws from r itself
    keep, _ = guess_coupling(r, g, y)
    return keep, r.clone()


def _always_keep(r, g, y):  # BROKEN: emits the guess whenever there is one
    _, h = guess_coupling(r, g, y)
    return 1.0, h


@pytest.mark.parametrize("seed", range(6))
def test_the_coupled_draw_is_exactly_the_residual(seed):
    p, q = _rows(7, seed)
    x = int(q.argmax())  # the rejected draft (any token q can draw)
    r = residual_distribution(p[None], q[None])[0]
    g = q.clone()
    g[x] = 0.0
    g /= 1.0 - q[x]
    got, hit = coupled_distribution(r, g)
    torch.testing.assert_close(got, r, rtol=0, atol=1e-12)
    assert hit == pytest.approx(float(torch.minimum(r, g).sum()), abs=1e-12)


def test_the_identity_catches_a_broken_coupling():
    p, q = _rows(7, 0)
    r = residual_distribution(p[None], q[None])[0]
    g = q / q.sum()
    for broken in (_fallback_to_r, _always_keep):
        got, _ = coupled_distribution(r, g, broken)
        assert abs(float(got.sum()) - 1.0) < 1e-12  # still a distribution ...
        assert (got - r).abs().max() > 1e-3, broken.__name__  # ... but not r


def _q(vocab: int, seed: int, entries: int = 0) -> SparseQ:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g) * 2
    return sparse_q(logits, SamplingParams(1.0), entries, eps=0.0)


def test_a_guess_is_drawn_from_q_without_x():
    q = _q(40, 1, entries=12)  # a listed head and an even tail
    x = int(q.ids[0])
    rng = generator(5)
    draws = [guess_from(q, x, rng) for _ in range(20_000)]
    g = guess_g(q, x)
    assert x not in draws and float(g.sum()) == pytest.approx(1.0, abs=1e-12)
    assert tv(draws, g) < tv_threshold(g, len(draws))
    assert guess_from(SparseQ.point(3, 40), 3, rng) == -1  # nothing but x to draw


N = 12_000


def _verify_draws(seed: int) -> tuple[torch.Tensor, torch.Tensor, float, float, float]:
    """N residual draws of ``verify_draft`` at one position with the draft's guesses:
    (draws, r, the share that equal their guess, that share's expectation, and an
    independent draw's from g)."""
    vocab, params = 30, SamplingParams(1.0)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, vocab, generator=g) * 2  # [gamma + 1, vocab]
    q = _q(vocab, seed + 100, entries=10)
    p = probs_from_logits(logits, params).double()
    r = residual_distribution(p[:1], q.dense()[None])[0]
    rng, u = generator(seed), generator(seed + 1)
    draws, hits = [], 0
    for _ in range(N):
        x = q.sample(rng)
        y = guess_from(q, x, rng)
        uu = torch.tensor(u.random(3), dtype=torch.float64)
        v = verify_draft(logits, [x], [q], params, uu[:2], guesses=[y], u_keep=uu[2:])
        draws.append(v.residual_tokens[0])
        hits += v.residual_tokens[0] == y
    dense = q.dense()
    gs = [guess_g(q, x) for x in range(vocab)]
    expected = sum(float(dense[x] * torch.minimum(r, gs[x]).sum()) for x in range(vocab))
    independent = sum(float(dense[x] * (r * gs[x]).sum()) for x in range(vocab))
    return torch.tensor(draws), r, hits / N, expected, independent


def test_verify_draft_with_guesses_draws_the_residual():
    draws, r, hit, expected, independent = _verify_draws(3)
    assert tv(draws, r) < tv_threshold(r, N)
    # The guess is right as often as the coupling promises: more than by chance.
    assert abs(hit - expected) < 4 * (expected * (1 - expected) / N) ** 0.5, (hit, expected)
    assert expected > 2 * independent, (expected, independent)


def test_a_coupling_that_always_keeps_the_guess_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(sampling, "guess_coupling", _always_keep)
    draws, r, *_ = _verify_draws(3)
    assert tv(draws, r) >= tv_threshold(r, N)


def test_no_guess_leaves_the_draws_as_they_were():
    """-1 (no guess) everywhere: the same tokens as a verify without guesses."""
    vocab, params = 30, SamplingParams(1.0)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    qs = [_q(vocab, 7), _q(vocab, 8)]
    u = torch.from_numpy(np.linspace(0.05, 0.95, 3))
    plain = verify_draft(logits, [1, 2], qs, params, u)
    none = verify_draft(logits, [1, 2], qs, params, u, guesses=[-1, -1], u_keep=u[:2])
    assert (plain.residual_tokens, plain.bonus_token) == (none.residual_tokens, none.bonus_token)
