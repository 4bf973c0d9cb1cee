"""Relay: the draft sends its proposal straight to the target
(``specdec.transport.relay``). The route must never change the output, and a
relay the orchestrator gave up on must never run or be taken for an answer."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

from orchestrator.ports.remote import RemoteTarget
from orchestrator.replicas import ReplicaPool
from orchestrator.resilience import Budget, TargetLink
from orchestrator.step import Cursor
from specdec.errors import DeadlineExceeded
from specdec.runtime.loading import ModelInfo
from specdec.sampling import Proposal, SamplingParams, Verdict
from specdec.transport.relay import Relayed, RelayInboxes
from specdec.v1 import target_pb2, target_pb2_grpc

from .stack import drafted_on, free_port, local_stack


def test_an_inbox_takes_its_own_relays_and_refuses_cancelled_or_unknown_ones():
    async def go():
        inboxes = RelayInboxes()
        inbox = inboxes.open()
        assert inboxes.deliver(inbox.token, "verify", (1, 0)) == ""
        assert inbox.queue.get_nowait() == Relayed("verify")  # (marked: not the caller's)
        assert "no session" in inboxes.deliver(b"x" * 16, "verify", (1, 0))
        inbox.cancel([7])
        assert "cancelled" in inboxes.deliver(inbox.token, "verify", (7, 0))
        assert inbox.queue.empty()
        inboxes.close(inbox)
        assert "no session" in inboxes.deliver(inbox.token, "verify", (2, 0))
        assert len(inboxes) == 0

    asyncio.run(go())


def test_one_broken_stream_rests_its_address_once_however_many_sends_it_fails():
    """The sends in flight when a relay stream breaks all fail: one failure, one
    back-off (1 s), not one doubling per send; a failure after the rest doubles it,
    up to 30 s."""
    from specdec.config import TlsConfig
    from specdec.transport.relay import RelayClient

    async def go():
        client = RelayClient(TlsConfig(), 1 << 20, 0.1)
        loop = asyncio.get_running_loop()
        for _ in range(4):  # four sends of one broken stream
            client.rest("t:1", "stream ended")
        until, backoff = client._resting["t:1"]
        assert backoff == 1.0 and until - loop.time() <= 1.0
        client._resting["t:1"] = (loop.time() - 0.01, backoff)  # the rest is over
        client.rest("t:1", "could not send")  # failing again: doubled
        assert client._resting["t:1"][1] == 2.0
        for _ in range(10):
            client._resting["t:1"] = (loop.time() - 0.01, client._resting["t:1"][1])
            client.rest("t:1", "could not send")
        assert client._resting["t:1"][1] == 30.0

    asyncio.run(go())


def _relay(token: bytes, cursor: Cursor, seed: int, tag: int) -> target_pb2.RelayedVerify:
    verify = target_pb2.Verify(cache_len=cursor.cache_len, pending_tokens=cursor.pending, seed=seed)
    return target_pb2.RelayedVerify(relay_token=token, verify=verify, tag=tag)


def test_relayed_verdicts_reach_the_session_and_late_ones_are_refused_or_skipped(llama_stack):
    """Through the real target service: a relayed verify answers on the session's
    own stream; one cancelled before it arrives is refused; one that ran after its
    caller moved on is passed over by the caller (its seed is not the one asked)."""

    async def go():
        async with grpc.aio.insecure_channel(llama_stack.address("target")) as channel:
            port = RemoteTarget(channel)
            history = [5, 6, 7, 8]
            session = await port.open("relay-test", history[:-1], SamplingParams(), 30.0)
            assert len(session.relay_token) == 16
            relay = target_pb2_grpc.TargetServiceStub(channel).Relay()
            cursor = Cursor.fresh(history)

            # Relayed: no answer on the relay stream, the verdict comes on the session's.
            await relay.write(_relay(session.relay_token, cursor, seed=11, tag=1))
            relayed = await session.verify(cursor, _Relayed(), 11, False, 30.0)
            assert relayed.cache_len == cursor.end  # the pending token was fed

            # Another replica's token, or none: refused, naming why.
            await relay.write(_relay(b"\0" * 16, cursor, seed=12, tag=2))
            ack = await relay.read()
            assert (ack.tag, ack.accepted) == (2, False) and "no session" in ack.reason

            # Cancelled with the next verify: a relay arriving later never runs.
            session.cancel_relay(13)
            await session.verify(cursor, None, 14, False, 30.0)
            await relay.write(_relay(session.relay_token, cursor, seed=13, tag=3))
            ack = await relay.read()
            assert not ack.accepted and "cancelled" in ack.reason

            # Ran before its cancel arrived: its verdict is skipped, not taken.
            await relay.write(_relay(session.relay_token, cursor, seed=15, tag=4))
            await asyncio.sleep(0.5)  # taken and run (nothing comes back for it)
            session.cancel_relay(15)
            own = await session.verify(cursor, None, 16, False, 30.0)
            again = await session.verify(cursor, None, 16, False, 30.0)
            assert own.bonus_token == again.bonus_token  # the answer to seed 16, twice
            assert await session.rollback(cursor.cache_len, 30.0) == cursor.cache_len
            relay.cancel()
            await session.close()

    asyncio.run(go())


class _Relayed:
    """A proposal whose verify the draft relayed (only what the port reads)."""

    tokens: list[int] = []
    relayed = True


@pytest.fixture(scope="module")
def ab_stack(tmp_path_factory, llama_pair):
    """One draft and target; the stack's orchestrator relays (and the draft drafts on),
    a second one does not relay, a third relays without drafting on, and a fourth
    lets the draft pace sequential steps (``orchestrator.paced``, on by default; off
    for the others). The draft guesses
    sampled residual draws (``sampled_guesses``), which must not depend on the route.
    (The target runs every pass on one thread: whether a pass takes more,
    ``plain_torch_threads``, depends on timing, and its logits' last bits with it.)"""
    draft, target = llama_pair
    with local_stack(
        tmp_path_factory.mktemp("relay-ab"),
        draft,
        target,
        draft__sampled_guesses=4,
        orchestrator__paced=False,
    ) as stack:
        direct, _ = stack.start_orchestrator(
            "direct",
            stack.address("draft"),
            stack.address("target"),
            {"orchestrator.relay": False},
        )
        waiting, _ = stack.start_orchestrator(
            "waiting",
            stack.address("draft"),
            stack.address("target"),
            {"orchestrator.draft_on": False},
        )
        paced, _ = stack.start_orchestrator(
            "paced", stack.address("draft"), stack.address("target"), {"orchestrator.paced": True}
        )
        yield stack, direct, waiting, paced


def test_a_lone_sequential_request_lets_its_verifies_take_the_drafts_core(llama_stack):
    """``Verify.draft_idle``, relayed or sent by the orchestrator: the verify of a
    step that drafts nothing ahead, with the orchestrator's only request, runs on
    ``target.plain_torch_threads`` (``specdec_model_wide_passes_total``); one of a
    step that drafts ahead does not (the draft drafts meanwhile)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: no pass takes more threads")
    stack = llama_stack  # (plain_torch_threads 2)
    direct, _ = stack.start_orchestrator(
        "wide-direct",
        stack.address("draft"),
        stack.address("target"),
        {"orchestrator.relay": False},
    )

    def wide() -> float:
        return stack.metric("target", "specdec_model_wide_passes_total", 'kind="verify"')

    def relayed() -> float:
        return stack.metric("orchestrator", "specdec_relayed_steps_total", 'outcome="relayed"')

    time.sleep(1.2)  # (an earlier test's concurrent requests count as load for a second)
    got = {}
    for route, address, overlap in (
        ("relayed", None, False),
        ("direct", direct, False),
        ("ahead", None, True),
    ):
        before, relays = wide(), relayed()
        _, _, stats = stack.generate_raw(
            address=address, prompt=[3, 9, 27], max_new_tokens=40, temperature=0.0, gamma=3,
            overlap=overlap,
        )  # fmt: skip
        got[route] = (wide() - before, stats.steps, relayed() - relays, stats.overlapped_steps)
    # Every drafting step's verify (all but at most the last one or two, which may
    # draft fewer or none) went wide; the relayed ones through the draft's relay.
    assert got["relayed"][0] >= got["relayed"][1] - 2 and got["relayed"][2] > 0, got
    assert got["direct"][0] >= got["direct"][1] - 2 and got["direct"][2] == 0, got
    # Drafting ahead: only steps that drafted nothing ahead (the last ones), if any.
    assert got["ahead"][0] <= 2, got


def _residual_guesses(stack) -> float:
    return sum(
        stack.metric("target", "specdec_model_residual_guesses_total", f'outcome="{o}"')
        for o in ("kept", "redrawn")
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_route_does_not_change_a_single_token(ab_stack, temperature):
    """Same seed, same draws: relayed steps emit exactly what direct ones do, and
    drafting on (the draft settles each step itself from the echoed verdict and
    drafts the next) changes nothing either, nor does pacing (the draft also relays
    that next block itself, with the request's own draws), greedy and sampled, for
    every gamma,
    and with drafting ahead (overlap) too, where sampled residual draws are coupled
    to the draft's guesses on every route."""
    stack, direct, waiting, paced = ab_stack
    fresh = stack.metric("draft", "specdec_model_pipeline_blocks_total", 'kind="fresh"')
    before = stack.metric("orchestrator", "specdec_relayed_steps_total", 'outcome="relayed"')
    used = drafted_on(stack, "used")
    for gamma, overlap in ((1, False), (3, False), (6, False), (3, True)):
        for seed in (1, 2):
            fields = dict(
                prompt=[3, 9, 27],
                max_new_tokens=40,
                temperature=temperature,
                gamma=gamma,
                seed=seed,
                overlap=overlap,
            )
            relayed, _, _ = stack.generate_raw(**fields)
            coupled = _residual_guesses(stack)
            plain, _, _ = stack.generate_raw(address=direct, **fields)
            if temperature and overlap:  # the direct route's draws were coupled too
                assert _residual_guesses(stack) > coupled, (gamma, seed)
            assert relayed == plain, (gamma, seed)
            assert stack.generate_raw(address=waiting, **fields)[0] == plain, (gamma, seed)
            assert stack.generate_raw(address=paced, **fields)[0] == plain, (gamma, seed)
    after = stack.metric("orchestrator", "specdec_relayed_steps_total", 'outcome="relayed"')
    assert after - before >= 2 * 6 * 5  # the sequential requests relayed (5+ steps each)
    # Nearly every step after the first was drafted before the orchestrator asked.
    assert drafted_on(stack, "used") - used >= 6 * 3
    # The paced requests' steps after the first: drafted and relayed by the draft itself.
    assert stack.metric("draft", "specdec_model_pipeline_blocks_total", 'kind="fresh"') - fresh >= (
        2 * 6 * 4
    )


def test_a_relay_left_unconfirmed_never_changes_the_output(tmp_path, llama_pair):
    """With a send deadline nobody meets, every relay is given up on: the target may
    or may not have received it. The orchestrator cancels it and verifies itself (with a
    seed of its own, so a sampled request's draws differ from the direct route's
    there; greedy output cannot). Greedy output equals the direct route's, and the
    draft stops relaying to a target that does not answer (a back-off, not an ack
    timeout per step)."""
    draft, target = llama_pair
    with local_stack(tmp_path, draft, target, draft__relay_send_timeout_s=1e-6) as stack:
        direct, _ = stack.start_orchestrator(
            "direct",
            stack.address("draft"),
            stack.address("target"),
            {"orchestrator.relay": False},
        )
        deadline = time.monotonic() + 3.0
        requests = 0
        while time.monotonic() < deadline or requests < 4:
            temperature = float(requests % 2)
            fields = dict(
                prompt=[4, 8, 15 + requests],
                max_new_tokens=32,
                temperature=temperature,
                gamma=3,
                seed=requests,
            )
            got, _, stats = stack.generate_raw(**fields)
            want, _, _ = stack.generate_raw(address=direct, **fields)
            if temperature == 0.0:
                assert got == want
            assert len(got) == len(want) == 32
            assert stats.total_time_s < 4.0  # no step waits for a verdict that never comes
            requests += 1
        not_relayed = stack.metric(
            "orchestrator", "specdec_relayed_steps_total", 'outcome="not_relayed"'
        )
        assert not_relayed >= 1
        # Sessions close just after a request's last message: give that a moment.
        deadline = time.monotonic() + 10.0
        while stack.live_sessions("target") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stack.live_sessions("target") == 0


class _LostRelayTarget:
    """A target port whose sessions never answer a relayed verify (the relay went to
    another replica), and answer direct ones with a plain verdict."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.opened = 0

    async def info(self, timeout):
        return ModelInfo("m", 47, "tok", "float32", "cpu", "X", (), 64, "fp", "0", 2)

    async def open(self, session_id, tokens, params, timeout, counter=None):
        self.opened += 1
        return _LostRelaySession()

    async def aclose(self) -> None:
        pass


class _LostRelaySession:
    relay_token = b"t" * 16
    next_logits = False

    def __init__(self) -> None:
        self.cancelled: list[int] = []

    def cancel_relay(self, seed: int) -> None:
        self.cancelled.append(seed)

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
        if proposal is not None and proposal.relayed:
            await asyncio.sleep(timeout)
            raise DeadlineExceeded(f"target: no answer within {timeout:.3g} s")
        assert proposal is None and run == 1
        return Verdict([], [], [], 1, cache_len=cursor.end)

    async def close(self) -> None:
        pass


def test_a_relayed_verdict_that_never_comes_costs_one_bounded_wait():
    """The draft sent the relay, but it never reaches this session (another replica
    behind the same address): after relay_timeout_s the step decodes plain on a
    re-opened session, its drafts dropped, and the request relays no more."""

    async def go():
        pool = ReplicaPool("target", "a:1", _LostRelayTarget, 1.0, 30.0)
        await pool.refresh()
        budget = Budget(None, draft_timeout_s=0.5, target_timeout_s=10.0)
        link = TargetLink(
            pool,
            "sid",
            [1, 2, 3],
            SamplingParams(),
            budget,
            None,
            asyncio.ensure_future,
            retry_s=5.0,
            relay_timeout_s=0.2,
        )
        await link.open()
        relay = link.relay_to(seed=5, pit=False)
        assert relay is not None and relay.cursor == link.cursor
        proposal = Proposal([7, 8], None, 4, relayed=True)
        began = time.monotonic()
        verdict = await link.verify(proposal, 5, False)
        assert 0.2 <= time.monotonic() - began < 2.0
        assert verdict.drafts_dropped and verdict.p_draft == []
        assert pool.replicas["a:1"].port.opened == 2  # re-opened, same replica
        assert link.relay_to(seed=6, pit=False) is None  # no more relays for it

    asyncio.run(go())


def test_a_write_to_a_relay_stream_that_just_ended_breaks_the_link_not_the_caller():
    """The target's stream can end (the target died) between the reader's last read and
    its marking the link broken: grpc.aio then refuses the write with
    InvalidStateError. The relay is not sent, and the caller (a propose, a pipeline)
    goes on: found by a chaos run whose pipelines stopped with that traceback."""
    from specdec.config import TlsConfig
    from specdec.transport.channels import open_channel
    from specdec.transport.relay import _Link

    async def go():
        troubles = []
        channel = open_channel(f"127.0.0.1:{free_port()}", TlsConfig(), 1 << 20)
        link = _Link(channel, troubles.append)

        async def finished(request):
            raise asyncio.InvalidStateError("RPC already finished.")

        link.call.write = finished
        request = target_pb2.RelayedVerify(relay_token=b"t")
        assert await link.send(request, 1.0, lambda v: None) is False
        assert link.broken and not link.echoes
        await link.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("token_bytes", [16, 1 << 20])
def test_a_sender_cancelled_mid_write_leaves_the_shared_relay_stream_alone(
    llama_stack, token_bytes
):
    """Every session of a draft relays to a target on one stream, and grpc.aio cancels
    a whole call when a task is cancelled inside its write. A sender cancelled while
    its relay is being written (its propose's caller gone, its pipeline stopped) must
    not take the stream, and every other session's relays and echoes, with it: its
    write finishes on its own, and the link goes on. (Before, the link broke, and
    every relay in flight on it was lost to its orchestrator's relay_timeout_s.) Its
    refusal for want of the session means its request ended: it must not make the
    draft rest the address, as a live sender's does (several at once rested it for
    up to 30 s, and no request relayed or pipelined meanwhile)."""
    from specdec import metrics
    from specdec.config import TlsConfig
    from specdec.transport.channels import open_channel
    from specdec.transport.relay import _Link

    def refused_relay(size: int = 16) -> target_pb2.RelayedVerify:
        return target_pb2.RelayedVerify(relay_token=b"\0" * size)  # no such session

    def refusals() -> float:
        return metrics.RELAY_REFUSALS._value.get()

    async def go():
        troubles: list[str] = []
        before = refusals()
        channel = open_channel(llama_stack.address("target"), TlsConfig(), 64 << 20)
        link = _Link(channel, troubles.append)
        assert await link.send(refused_relay(), 5.0, None)  # the stream is up
        cancelled = 0
        for spins in range(1, 6):  # cancel at each of the write's first turns of the loop
            sender = asyncio.ensure_future(link.send(refused_relay(token_bytes), 5.0, None))
            for _ in range(spins):
                await asyncio.sleep(0)
            cancelled += sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        await asyncio.sleep(0.3)  # the refusals come back
        assert cancelled, "every write finished before its cancel"
        assert not link.broken and not link.call.done()
        assert await link.send(refused_relay(), 5.0, None)
        deadline = time.monotonic() + 5
        while refusals() - before < 7 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await link.aclose()
        return troubles, refusals() - before, cancelled

    troubles, refused, cancelled = asyncio.run(go())
    # The first and the last relay were refused on the same stream, and so was every
    # cancelled sender's, whose write went out all the same; only the refusals of
    # senders still waiting were trouble for the address.
    assert refused == 7, refused
    assert len(troubles) == 7 - cancelled, (troubles, cancelled)
    assert all("no session" in t for t in troubles), troubles


@pytest.mark.parametrize("keepalive_s", [1.0, None])
def test_a_relay_stream_to_a_target_gone_silent_is_given_up_within_twice_the_keepalive(
    llama_stack, keepalive_s
):
    """The draft's relay stream to a target whose node died or was cut off without a
    reset: nothing tells the connection, and relays written to it are lost (each
    costing its orchestrator ``relay_timeout_s``) until the kernel's buffers fill.
    With ``draft.relay_keepalive_s`` the unanswered ping ends the stream within twice
    that: the draft rests the address, and the next relay after the rest opens a new
    stream. Without it the stream looks alive for as long as the test waits."""
    from specdec.local.proxy import FaultProxy
    from specdec.transport.relay import RelayClient

    host, port = llama_stack.address("target").rsplit(":", 1)

    def late_relay() -> target_pb2.RelayedVerify:  # refused (no session), but no rest
        return target_pb2.RelayedVerify(relay_token=b"\0" * 16)

    async def go(proxy: FaultProxy) -> tuple[float | None, bool]:
        from specdec.config import TlsConfig

        client = RelayClient(TlsConfig(), 1 << 20, 5.0, keepalive_s)
        try:
            assert (await client.send(proxy.address, late_relay(), late=True))[0]
            link = client._links[proxy.address]
            proxy.stall()
            began = time.monotonic()
            while not link.broken and time.monotonic() - began < 5.0:
                await asyncio.sleep(0.05)
            took = time.monotonic() - began if link.broken else None
            proxy.pass_through()
            await asyncio.sleep(1.1)  # the first rest (1 s) is over
            sent, _ = await client.send(proxy.address, late_relay(), late=True)
            return took, sent and client._links[proxy.address] is not link
        finally:
            await client.aclose()

    with FaultProxy(host, int(port)) as proxy:
        took, reopened = asyncio.run(go(proxy))
    print(f"relay keepalive {keepalive_s}: stream given up after {took} s")
    if keepalive_s:
        assert took is not None and took < 2 * keepalive_s + 1.5, took
        assert reopened
    else:
        assert took is None
