"""Chaos under load, short: replicas killed with SIGKILL and restarted while 32
clients generate (``benchmarks/chaos.py`` runs the same for 10 minutes).

Two drafts and two targets behind one orchestrator; a target replica and then a
draft replica are killed mid-load. No request is lost or answered twice, every
greedy output equals its no-fault output, a failure is only ever UNAVAILABLE,
the requests in flight on a killed target complete, a dead draft costs fallback
steps only, and every session is freed at the end.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from benchmarks.chaos import print_report, run_chaos
from orchestrator.replicas import ReplicaPool
from orchestrator.resilience import Budget, TargetLink
from specdec.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from specdec.runtime.loading import ModelInfo
from specdec.sampling import SamplingParams, Verdict

SECONDS = 20
CLIENTS = 32


@pytest.mark.timeout(600)
def test_replicas_killed_under_load_lose_nothing(tmp_path, llama_pair):
    r = run_chaos(
        tmp_path / "chaos",
        *llama_pair,
        seconds=SECONDS,
        clients=CLIENTS,
        kill_every=(6.0, 8.0),
        victims=["target-0", "draft-1"],
        max_new_tokens=24,
        seed=7,
    )
    print_report(r)
    assert not r["restart_errors"], r["restart_errors"]
    assert r["lost"] == 0, r["lost_detail"]
    assert r["duplicated"] == 0
    assert r["server_counted"] == r["requests"]  # each request seen once by the server
    assert r["greedy_checked"] > 100 and r["greedy_wrong"] == 0
    assert set(r["outcomes"]) <= {"completed", "UNAVAILABLE"}, r["failed_detail"]
    killed = [k["replica"] for k in r["kills"]]
    assert killed[:2] == ["target-0", "draft-1"], killed
    target_kill, draft_kill = r["kills"][:2]
    assert target_kill["in_flight"] >= CLIENTS // 2
    # The killed target's requests moved to the other one: they completed, greedy ones
    # token for token as without the fault.
    assert target_kill["completed"] == target_kill["in_flight"], target_kill
    assert draft_kill["completed"] == draft_kill["in_flight"], draft_kill  # fallback
    assert r["fallback_requests"] > 0
    assert not any(r["leftovers"].values()), r["leftovers"]


# ---- found by the 10-minute run (docs/reliability.md, section 10) --------------------------
# A target replica that comes back stays out of rotation while its breaker is open: one
# outage with 32 requests in flight counts 32 failures, so the back-off reaches its
# maximum (30 s). If the other target dies in that window, every request fails with
# UNAVAILABLE "no healthy replica" although a healthy one is there. Reproduced here with
# fake ports, in milliseconds; when it is fixed these XPASS and the markers go.
class FakeTarget:
    """A target replica's port that is up or down."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.up = True
        self.hung = False  # answers nothing: every call times out (DeadlineExceeded)
        self.full = False  # at max_sessions: opens are refused (ResourceExhausted)
        self.out_of_memory = 0  # the next this many verifies run out of device memory

    async def info(self, timeout):
        return ModelInfo("m", 47, "tok", "float32", "cpu", "X", (), 64, "fp", "0", 2)

    async def open(self, session_id, tokens, params, timeout, counter=None):
        await self.answer(timeout)
        if self.full:
            raise ResourceExhausted("sessions: the limit of 1 live sessions is reached")
        return FakeSession(self)

    async def answer(self, timeout) -> None:
        if not self.up:
            raise Unavailable(f"target: {self.address} is down")
        if self.hung:
            await asyncio.sleep(timeout)
            raise DeadlineExceeded(f"target: no answer within {timeout:.3g} s")

    async def aclose(self) -> None:
        pass


class FakeSession:
    next_logits = False  # (every verify answers from cursor.end alone)

    def __init__(self, port: FakeTarget) -> None:
        self.port = port

    async def verify(
        self,
        cursor,
        proposal,
        seed,
        dense_p,
        timeout,
        pit=False,
        run=1,
        follow=(),
        draft_idle=False,
    ):
        await self.port.answer(timeout)
        if self.port.out_of_memory:
            self.port.out_of_memory -= 1
            raise ResourceExhausted("memory: the device ran out of memory in a forward")
        return Verdict([], [], [], 1, cache_len=cursor.end)

    async def close(self) -> None:
        pass


async def _pool_after_an_outage_of(name: str, in_flight: int = 32) -> ReplicaPool:
    """Two target replicas; ``name`` was down with ``in_flight`` requests on it and is
    back up now (as each failing request tells its breaker)."""
    pool = ReplicaPool("target", "a:1,b:2", FakeTarget, retry_after_s=1.0, retry_max_s=30.0)
    await pool.refresh()
    for _ in range(in_flight):
        pool.replicas[name].breaker.failure()
    return pool


def _link(pool: ReplicaPool, retry_s: float = 0.5) -> TargetLink:
    budget = Budget(None, draft_timeout_s=0.5, target_timeout_s=1.0)
    return TargetLink(
        pool, "sid", [1, 2, 3], SamplingParams(), budget, None, asyncio.ensure_future,
        retry_s=retry_s,
    )  # fmt: skip


def test_a_new_request_uses_the_target_that_came_back():
    async def scenario():
        pool = await _pool_after_an_outage_of("b:2")  # b was down; it is back
        pool.replicas["a:1"].port.up = False  # now a dies
        link = _link(pool)
        await link.open()  # today: Unavailable "no healthy replica"
        assert link.replica.address == "b:2"

    asyncio.run(scenario())


def test_a_request_on_a_dead_target_moves_to_the_one_that_came_back():
    async def scenario():
        pool = await _pool_after_an_outage_of("b:2")
        link = _link(pool)
        await link.open()
        assert link.replica.address == "a:1"
        pool.replicas["a:1"].port.up = False  # a dies under the request
        await link.verify(None, seed=1, dense_p=False)  # today: Unavailable after retry_s
        assert link.replica.address == "b:2"

    asyncio.run(scenario())


def test_the_fakes_move_a_request_when_no_breaker_is_open():
    """The same scenario without the earlier outage passes: the fakes are sound."""

    async def scenario():
        pool = await _pool_after_an_outage_of("b:2", in_flight=0)
        link = _link(pool)
        await link.open()
        pool.replicas["a:1"].port.up = False
        await link.verify(None, seed=1, dense_p=False)
        assert link.replica.address == "b:2"

    asyncio.run(scenario())


def test_a_request_on_a_hung_target_moves_to_another_and_opens_its_breaker():
    """A replica that answers nothing (stopped, cut off without a reset) costs a request
    one target_timeout_s, not its end: the request moves to the other replica, and the
    hung one's breaker opens so that new requests go elsewhere. With no other replica
    left, the request ends with UNAVAILABLE, not a DEADLINE_EXCEEDED it never set.
    (Before, every request on it got DEADLINE_EXCEEDED after target_timeout_s, and new
    ones kept being placed on it.)"""

    async def scenario():
        pool = await _pool_after_an_outage_of("b:2", in_flight=0)
        link = _link(pool)
        await link.open()
        assert link.replica.address == "a:1"
        pool.replicas["a:1"].port.hung = True
        began = time.monotonic()
        await link.verify(None, seed=1, dense_p=False)
        assert link.replica.address == "b:2" and time.monotonic() - began < 3
        assert not pool.replicas["a:1"].breaker.allow()  # new requests go to b
        fresh = _link(pool)
        await fresh.open()
        assert fresh.replica.address == "b:2"
        pool.replicas["b:2"].port.hung = True  # and now b hangs too
        with pytest.raises(Unavailable, match="no other replica"):
            await link.verify(None, seed=2, dense_p=False)

    asyncio.run(scenario())


def test_a_full_target_replica_leaves_the_request_to_another():
    """A replica at its max_sessions (several orchestrators share the targets) is up:
    a new request goes to another replica, and so does one re-opening its session
    after a restart; its breaker stays closed; with every replica full the request
    ends with RESOURCE_EXHAUSTED. (Before, the request failed at once, though
    another replica had room.)"""

    async def scenario():
        pool = await _pool_after_an_outage_of("b:2", in_flight=0)
        pool.replicas["a:1"].port.full = True
        link = _link(pool)
        await link.open()
        assert link.replica.address == "b:2"
        pool.replicas["a:1"].port.full = False
        moved = _link(pool)
        await moved.open()
        assert moved.replica.address == "a:1"
        pool.replicas["a:1"].port.full = True
        moved.drop_session()  # its session was lost (a restart): it re-opens on a full a
        await moved.verify(None, seed=1, dense_p=False)
        assert moved.replica.address == "b:2"
        assert all(r.breaker.closed for r in pool.replicas.values())
        pool.replicas["b:2"].port.full = True
        with pytest.raises(ResourceExhausted):
            await _link(pool).open()

    asyncio.run(scenario())


def test_a_pass_out_of_memory_is_retried_on_the_same_session():
    """A target pass that ran out of device memory (the forward loop's
    ResourceExhausted) is retried after a wait on the same session, not re-opened
    elsewhere, and counts nothing against the replica's breaker."""

    async def scenario():
        pool = await _pool_after_an_outage_of("b:2", in_flight=0)
        link = _link(pool)
        await link.open()
        session, replica = link.session, link.replica
        replica.port.out_of_memory = 2
        await link.verify(None, seed=1, dense_p=False)
        assert link.session is session and link.replica is replica
        assert replica.breaker.closed and replica.port.out_of_memory == 0
        replica.port.out_of_memory = 1000  # for longer than target_retry_s
        with pytest.raises(ResourceExhausted):
            await link.verify(None, seed=2, dense_p=False)

    asyncio.run(scenario())
