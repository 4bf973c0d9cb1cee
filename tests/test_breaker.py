"""The replicas' circuit breaker: closed, open, half-open with one trial at a time.

When a dead draft's back-off ends, one request makes the trial call; the others
keep decoding with the target alone until it ends. (Before, every live request
made its own trial and waited its own ``draft_timeout_s`` on a draft still dead.)
Fake ports, so these run in milliseconds.
"""

from __future__ import annotations

import asyncio

from orchestrator.breaker import CircuitBreaker
from orchestrator.replicas import ReplicaPool
from orchestrator.resilience import Budget, DraftLink
from specdec.errors import DeadlineExceeded, ResourceExhausted
from specdec.runtime.loading import ModelInfo
from specdec.sampling import SamplingParams


def test_the_breaker_lets_one_trial_through_after_its_back_off():
    b = CircuitBreaker(retry_after_s=1.0, retry_max_s=30.0, trial_s=5.0)
    assert b.allow(0.0) and not b.claim(0.0)  # closed: no trial to claim
    b.failure(now=10.0)
    b.failure(now=10.5)  # in flight when it died: the same outage
    assert b.failures == 1 and not b.allow(10.9)
    assert b.allow(11.0)  # half-open
    assert b.claim(11.0)  # this request's call is the trial ...
    assert not b.allow(11.1)  # ... and the others keep away
    b.failure(now=11.2)  # the trial failed: open again, twice as long
    assert b.failures == 2 and not b.allow(13.1) and b.allow(13.2)
    token = b.claim(13.2)
    b.release(token)  # its request ended without an outcome: another may try
    assert b.allow(13.3)
    lapsing = b.claim(13.3)
    assert not b.allow(18.2) and b.allow(18.3)  # a trial never given back lapses
    newer = b.claim(18.3)
    b.release(lapsing)  # the lapsed trial's request ends: the newer trial stands
    assert not b.allow(18.4)
    b.release(newer)
    b.failure(now=18.5)  # (no trial in flight: counts, 4 s now)
    assert not b.allow(22.4) and b.allow(22.5) and b.claim(22.5)
    assert b.success() and b.closed and b.allow(22.6) and not b.claim(22.6)


class FakeDraft:
    """A draft replica's port that is up, or hung (every call times out)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.hung = True
        self.full = False  # at max_sessions: opens are refused
        self.opens = 0

    async def info(self, timeout):
        return ModelInfo("m", 47, "tok", "float32", "cpu", "X", (), 64, "fp", "0", 2)

    async def open(self, session_id, tokens, params, shape, timeout, counter=None):
        self.opens += 1
        if self.full:
            raise ResourceExhausted("sessions: the limit of 1 live sessions is reached")
        if self.hung:
            await asyncio.sleep(timeout)
            raise DeadlineExceeded(f"draft: no answer within {timeout:.3g} s")
        await asyncio.sleep(0.01)  # a prefill takes a while
        return FakeDraftSession()

    async def aclose(self) -> None:
        pass


class FakeDraftSession:
    async def propose(self, cursor, gamma, seed, timeout, relay=None, **kw):
        return "a proposal"

    async def close(self) -> None:
        pass


def _links(pool: ReplicaPool, n: int) -> tuple[list[DraftLink], list[str]]:
    fallbacks: list[str] = []
    budget = Budget(None, draft_timeout_s=0.2, target_timeout_s=1.0)
    args = ([1, 2, 3], SamplingParams(), budget, None, asyncio.ensure_future)
    links = [
        DraftLink(pool, f"s{i}", *args, shape=None, on_fallback=fallbacks.append) for i in range(n)
    ]
    return links, fallbacks


def test_a_dead_draft_costs_one_trial_per_back_off_not_one_per_request():
    async def scenario():
        pool = ReplicaPool("draft", "d:1", FakeDraft, retry_after_s=0.05, retry_max_s=1.0)
        await pool.refresh()
        port = pool.replicas["d:1"].port
        links, fallbacks = _links(pool, 8)

        async def step() -> list:
            return await asyncio.gather(*(link.propose(4, seed=1) for link in links))

        assert await step() == [None] * 8  # all in flight when it hung: one outage
        assert pool.replicas["d:1"].breaker.failures == 1
        await asyncio.sleep(0.06)  # the back-off passes
        opens = port.opens
        assert await step() == [None] * 8
        assert port.opens - opens == 1  # one trial; seven decoded without waiting
        assert fallbacks.count("breaker_open") == 7
        assert pool.replicas["d:1"].breaker.failures == 2  # the trial failed

        port.hung = False  # the draft comes back
        await asyncio.sleep(0.11)
        opens = port.opens
        got = await step()
        assert port.opens - opens == 1 and got.count("a proposal") == 1
        assert pool.replicas["d:1"].breaker.closed  # the trial closed it
        assert await step() == ["a proposal"] * 8  # everyone speculates again
        for link in links:
            await link.close()
        assert pool.replicas["d:1"].pinned == 0

    asyncio.run(scenario())


def test_a_trial_whose_request_is_cancelled_is_given_back():
    async def scenario():
        pool = ReplicaPool("draft", "d:1", FakeDraft, retry_after_s=0.05, retry_max_s=1.0)
        await pool.refresh()
        breaker = pool.replicas["d:1"].breaker
        breaker.failure()
        await asyncio.sleep(0.06)
        (link, other), _ = _links(pool, 2)
        task = asyncio.ensure_future(link.propose(4, seed=1))
        await asyncio.sleep(0.01)
        assert not breaker.allow()  # its trial is in flight
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()  # what the engine does for a request that ends
        assert breaker.allow()  # another request may try at once
        pool.replicas["d:1"].port.hung = False
        assert await other.propose(4, seed=1) == "a proposal" and breaker.closed
        await other.close()

    asyncio.run(scenario())


def test_a_full_draft_is_no_outage():
    """A draft at its max_sessions is up and serves the others: a request it refuses
    backs off its own speculation, and the breaker the others share stays closed.
    (Before, it opened, and speculation stopped for every request.)"""

    async def scenario():
        pool = ReplicaPool("draft", "d:1", FakeDraft, retry_after_s=0.05, retry_max_s=1.0)
        await pool.refresh()
        port = pool.replicas["d:1"].port
        port.hung, port.full = False, True
        (refused, other), fallbacks = _links(pool, 2)
        assert await refused.propose(4, seed=1) is None
        assert pool.replicas["d:1"].breaker.closed and refused.skip_steps > 0
        port.full = False
        assert await other.propose(4, seed=1) == "a proposal"
        assert fallbacks == ["resourceexhausted"]
        for link in (refused, other):
            await link.close()

    asyncio.run(scenario())
