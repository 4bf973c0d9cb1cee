"""The live exactness monitor: quiet on the exact pipeline, loud on a broken one.

Runs the engine with in-process services (monitor_fraction 1: every sampled
step is checked) and reads the monitor the orchestrator exports:
* the correct pipeline stays under the alert threshold for 50,000 checked
  tokens (temperature 1, top-k/top-p, gamma 1-4, overlapped or not; 8
  requests at a time, so they share batched passes): `make soak`, about 3
  minutes; `make test` runs the same for 8,192 tokens;
* a draft that misreports q (it proposes its most likely token but reports its
  whole q) trips the alert within 8,192 checked tokens;
* a target whose residual is replaced by p (the classic bug) trips it too.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from orchestrator.monitor import ALERT_CHI2, emitted_terms
from specdec import kernels, sampling

from .inprocess import in_process

PROMPTS = ["the cat", "a b c", "we shall see", "Hello", "it was", "emma said"]
ALERT_WITHIN = 8192  # checked tokens
CLIENTS = 8


def test_pit_terms_rank_tokens_by_probability():
    p = torch.tensor([[0.1, 0.4, 0.1, 0.4]])  # ranked: 1, 3 (tie: smaller id first), 0, 2
    above, at = sampling.pit_terms(p, [0, 0, 0, 0], [0, 1, 2, 3])
    assert above == pytest.approx([0.8, 0.0, 0.9, 0.4])
    assert at == pytest.approx([0.1, 0.4, 0.1, 0.4])


def test_pit_terms_on_the_cpu_match_the_whole_mask():
    """The CPU's candidate-at-a-time terms equal the candidates-by-vocabulary mask
    (the other devices' way), ties by id included."""
    gen = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(5, 4096, generator=gen) * 3, dim=-1)
    p[1, :50] = p[1, 60]  # tied with token 60, and ranked above it by id
    rows, tokens = [0, 1, 1, 2, 3, 4, 1], [7, 60, 10, 4095, 0, 123, 49]
    above, at = sampling.pit_terms(p, rows, tokens)
    rows_p = p[rows].double()
    t = torch.tensor(tokens)
    mass = rows_p.gather(1, t[:, None])
    ids = torch.arange(4096)
    ahead = (rows_p > mass) | ((rows_p == mass) & (ids[None, :] < t[:, None]))
    assert above == pytest.approx((rows_p * ahead).sum(-1).tolist(), rel=1e-12, abs=1e-15)
    assert at == mass[:, 0].tolist()


def test_the_emitted_tokens_terms_are_checked():
    above, at = [0.0, 0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8, 0.9]
    # gamma 2 (x1, x2, residuals r1, r2, bonus): x1 accepted, then r2.
    assert emitted_terms(above, at, 2, 1, True) == ([0.0, 0.3], [0.5, 0.8])
    assert emitted_terms(above, at, 2, 2, True) == ([0.0, 0.1, 0.4], [0.5, 0.6, 0.9])
    assert emitted_terms(above, at, 2, 2, False) == ([0.0, 0.1], [0.5, 0.6])
    # A plain run: the bonus and every further draw.
    assert emitted_terms(above, at, 0, 0, True) == (above, at)
    assert emitted_terms(above[:1], at[:1], 0, 0, True) == ([0.0], [0.5])


@pytest.mark.parametrize("sharpen", [1.0, 1.3])
def test_the_pit_is_uniform_exactly_for_draws_from_p(sharpen):
    """Tokens drawn from p give uniform u; from a sharper p (a wrong temperature)
    they drift towards 0, and the monitor's statistic sees it."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, 100, generator=gen) * 2, dim=-1)  # [rows, vocab]
    drawn_from = torch.softmax(torch.log(p) * sharpen, dim=-1)
    rows = torch.randint(0, 64, (8192,), generator=gen)
    tokens = torch.multinomial(drawn_from[rows], 1, generator=gen)[:, 0]
    above, at = sampling.pit_terms(p, rows.tolist(), tokens.tolist())
    u = np.asarray(above) + np.random.default_rng(0).random(len(at)) * np.asarray(at)
    counts = np.histogram(u, bins=16, range=(0, 1))[0]
    chi2 = float(((counts - len(u) / 16) ** 2).sum() / (len(u) / 16))
    assert (chi2 < 40) if sharpen == 1.0 else (chi2 > ALERT_CHI2), chi2


async def _drive(system, until_tokens: int, stop_on_alarm: bool) -> tuple[float, int | None]:
    """Generate, 8 requests at a time (they share batched passes), until
    ``until_tokens`` were checked; returns (max chi2 once the window was large
    enough, tokens checked when it first alarmed)."""
    monitor = system.orch.monitor
    worst, alarmed_at = 0.0, None
    next_request = iter(range(10**9))

    def done() -> bool:
        return monitor.total >= until_tokens or (stop_on_alarm and alarmed_at is not None)

    async def client() -> None:
        nonlocal worst, alarmed_at
        while not done():
            i = next(next_request)
            await system.generate(
                prompt=PROMPTS[i % len(PROMPTS)],
                max_new_tokens=200,
                temperature=1.0,
                gamma=1 + i % 4,
                overlap=bool(i % 2),
                seed=i,
                **[dict(), dict(top_k=12), dict(top_p=0.8)][i % 3],
            )
            if monitor.size >= 1024:
                worst = max(worst, monitor.chi2())
            if monitor.alarming() and alarmed_at is None:
                alarmed_at = monitor.total

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return worst, alarmed_at


@pytest.mark.parametrize(
    "tokens", [ALERT_WITHIN, pytest.param(50_000, marks=pytest.mark.soak)], ids=["8k", "50k"]
)
def test_the_exact_pipeline_stays_quiet(llama_pair, tokens):
    async def scenario():
        async with in_process(*llama_pair, monitor_fraction=1.0, monitor_window=4096) as system:
            return await _drive(system, tokens, stop_on_alarm=False)

    worst, alarmed_at = asyncio.run(scenario())
    print(f"max chi2 over {tokens} checked tokens: {worst:.1f} (alert above {ALERT_CHI2})")
    assert alarmed_at is None, f"false alarm after {alarmed_at} tokens (chi2 {worst:.1f})"


def test_a_draft_that_misreports_q_trips_the_alert(llama_pair, monkeypatch):
    def most_likely(self, rng):  # FAULT: propose the top token, report the whole q
        return int(self.ids[self.counts.argmax()])

    monkeypatch.setattr(sampling.SparseQ, "sample", most_likely)
    monkeypatch.setattr(kernels, "ENABLED", False)  # (on the reference path, where it is)

    async def scenario():
        async with in_process(*llama_pair, monitor_fraction=1.0, monitor_window=4096) as system:
            return await _drive(system, ALERT_WITHIN, stop_on_alarm=True)

    worst, alarmed_at = asyncio.run(scenario())
    assert alarmed_at is not None and alarmed_at <= ALERT_WITHIN, (worst, alarmed_at)


def test_a_broken_residual_trips_the_alert(llama_pair, monkeypatch):
    monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p)  # the classic bug
    monkeypatch.setattr(kernels, "ENABLED", False)  # (on the reference path, where it is)

    async def scenario():
        async with in_process(*llama_pair, monitor_fraction=1.0, monitor_window=4096) as system:
            return await _drive(system, ALERT_WITHIN, stop_on_alarm=True)

    worst, alarmed_at = asyncio.run(scenario())
    assert alarmed_at is not None and alarmed_at <= ALERT_WITHIN, (worst, alarmed_at)
