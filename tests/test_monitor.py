"""The live exactness monitor: quiet on the exact pipeline, loud on a broken one.

Runs the engine with in-process services (monitor_fraction 1: every sampled
step is checked) and reads the monitor the orchestrator exports:
* the correct pipeline stays under the alert threshold for 50,000 checked
  tokens (temperature 1, top-k/top-p, gamma 1-4, overlapped or not);
* a draft that misreports q (it proposes its most likely token but reports its
  whole q) trips the alert within 8,192 checked tokens;
* a target whose residual is replaced by p (the classic bug) trips it too.
"""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.monitor import ALERT_CHI2
from specdec import sampling

from .inprocess import in_process

PROMPTS = ["the cat", "a b c", "we shall see", "Hello", "it was", "emma said"]
ALERT_WITHIN = 8192  # checked tokens


async def _drive(system, until_tokens: int, stop_on_alarm: bool) -> tuple[float, int | None]:
    """Generate until ``until_tokens`` were checked; returns (max chi2 once the
    window was large enough, tokens checked when it first alarmed)."""
    monitor = system.orch.monitor
    worst, alarmed_at, i = 0.0, None, 0
    while monitor.total < until_tokens:
        prompt = PROMPTS[i % len(PROMPTS)]
        params = [dict(), dict(top_k=12), dict(top_p=0.8)][i % 3]
        await system.generate(
            prompt=prompt,
            max_new_tokens=200,
            temperature=1.0,
            gamma=1 + i % 4,
            overlap=bool(i % 2),
            seed=i,
            **params,
        )
        i += 1
        if monitor.size >= 1024:
            worst = max(worst, monitor.chi2())
        if monitor.alarming() and alarmed_at is None:
            alarmed_at = monitor.total
            if stop_on_alarm:
                break
    return worst, alarmed_at


@pytest.mark.slow
def test_the_exact_pipeline_stays_quiet_for_50000_tokens(llama_pair):
    async def scenario():
        async with in_process(*llama_pair, monitor_fraction=1.0, monitor_window=4096) as system:
            return await _drive(system, 50_000, stop_on_alarm=False)

    worst, alarmed_at = asyncio.run(scenario())
    print(f"max chi2 over 50,000 checked tokens: {worst:.1f} (alert above {ALERT_CHI2})")
    assert alarmed_at is None, f"false alarm after {alarmed_at} tokens (chi2 {worst:.1f})"


def test_a_draft_that_misreports_q_trips_the_alert(llama_pair, monkeypatch):
    def most_likely(self, rng):  # FAULT: propose the top token, report the whole q
        return int(self.ids[self.counts.argmax()])

    monkeypatch.setattr(sampling.SparseQ, "sample", most_likely)

    async def scenario():
        async with in_process(*llama_pair, monitor_fraction=1.0, monitor_window=4096) as system:
            return await _drive(system, ALERT_WITHIN, stop_on_alarm=True)

    worst, alarmed_at = asyncio.run(scenario())
    assert alarmed_at is not None and alarmed_at <= ALERT_WITHIN, (worst, alarmed_at)


def test_a_broken_residual_trips_the_alert(llama_pair, monkeypatch):
    monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p)  # the classic bug

    async def scenario():
        async with in_process(*llama_pair, monitor_fraction=1.0, monitor_window=4096) as system:
            return await _drive(system, ALERT_WITHIN, stop_on_alarm=True)

    worst, alarmed_at = asyncio.run(scenario())
    assert alarmed_at is not None and alarmed_at <= ALERT_WITHIN, (worst, alarmed_at)
