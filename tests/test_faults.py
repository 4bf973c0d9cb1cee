"""Fault injection on a real local stack: kill -9, restarts and SIGTERM.

Each case asserts its promise (the request completes with output identical
to the no-fault run, or ends with the documented status) and that no session
leaks. The tests share one stack of their own (not the session's): each
restarts whatever it killed.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .stack import local_stack

PROMPT = [5, 9, 2, 7, 1]
LONG = 300  # tokens: long enough to be interrupted mid-way


class Streamer(threading.Thread):
    """Runs one Generate in the background, recording chunks, stats or the error."""

    def __init__(self, address: str, **fields) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.request = orchestrator_pb2.GenerateRequest(**fields)
        self.ids: list[int] = []
        self.stats = None
        self.error: grpc.RpcError | None = None
        self.first_chunk = threading.Event()

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            try:
                for msg in stub.Generate(self.request, timeout=120):
                    if msg.HasField("chunk"):
                        self.ids += msg.chunk.token_ids
                        self.first_chunk.set()
                    else:
                        self.stats = msg.stats
            except grpc.RpcError as e:
                self.error = e
            finally:
                self.first_chunk.set()


def greedy(stack, n=LONG, **extra):
    return Streamer(
        stack.orchestrator_address,
        token_ids=orchestrator_pb2.TokenIds(ids=PROMPT),
        max_new_tokens=n,
        temperature=0.0,
        gamma=4,
        **extra,
    )


def run_to_end(streamer: Streamer) -> Streamer:
    streamer.start()
    streamer.join(120)
    assert not streamer.is_alive()
    return streamer


def wait_until(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def no_sessions(stack, roles=("draft", "target")) -> None:
    for role in roles:
        wait_until(lambda r=role: stack.live_sessions(r) == 0, what=f"{role} sessions to close")


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory, llama_pair):
    with local_stack(
        tmp_path_factory.mktemp("faults"),
        *llama_pair,
        orchestrator__draft_retry_after_s=0.5,
        orchestrator__draft_retry_max_s=1.0,
    ) as stack:
        yield stack


def whole(stack):
    """A fixture's body: ``stack`` whole and answering; whatever a test kills is
    restarted after it, and whatever it stops (SIGSTOP) continued."""
    wait_until(lambda: run_to_end(greedy(stack, n=2)).error is None, what="the stack to answer")
    yield stack
    for role in stack.ROLES:
        p = stack.proc(role)
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)  # (a no-op unless a test stopped it)
        else:
            stack.restart(role)


@pytest.fixture
def fault_stack(shared_stack):
    """The shared stack, whole and answering (``whole``)."""
    yield from whole(shared_stack)


def test_kill_draft_mid_generation_falls_back_exactly_and_resumes(fault_stack):
    stack = fault_stack
    reference = run_to_end(greedy(stack)).ids
    assert len(reference) == LONG

    s = greedy(stack)
    s.start()
    assert s.first_chunk.wait(60)
    stack.signal("draft", signal.SIGKILL)
    s.join(120)
    assert s.error is None, s.error
    assert s.ids == reference  # exact, through plain target decoding
    assert s.stats.fallback_steps > 0
    assert stack.metric("orchestrator", "specdec_fallback_steps_total") > 0
    assert stack.metric("orchestrator", "specdec_speculation_enabled") == 0
    no_sessions(stack, roles=("target",))

    # The draft comes back: after the breaker's back-off, speculation resumes.
    stack.restart("draft")
    time.sleep(1.2)
    again = run_to_end(greedy(stack, n=40))
    assert again.ids == reference[:40]
    assert again.stats.drafted_tokens > 0
    assert stack.metric("orchestrator", "specdec_speculation_enabled") == 1
    no_sessions(stack)


def test_restart_target_mid_generation_completes_identically(fault_stack):
    stack = fault_stack
    reference = run_to_end(greedy(stack)).ids
    s = greedy(stack)
    s.start()
    assert s.first_chunk.wait(60)
    stack.signal("target", signal.SIGKILL)
    stack.restart("target")  # sessions gone: the orchestrator re-prefills from its history
    s.join(120)
    assert s.error is None, s.error
    assert s.ids == reference
    no_sessions(stack)


def test_target_down_fails_fast_with_unavailable(fault_stack):
    stack = fault_stack
    stack.signal("target", signal.SIGKILL)
    stack.proc("target").wait(10)
    start = time.monotonic()
    s = run_to_end(greedy(stack, n=10))
    assert s.error is not None and s.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "target" in s.error.details()
    assert time.monotonic() - start < 5.0
    assert stack.metric("orchestrator", "specdec_live_requests") == 0


@pytest.mark.parametrize("role", ["draft", "target", "orchestrator"])
def test_sigterm_under_load_finishes_in_flight_work(fault_stack, role):
    stack = fault_stack
    reference = run_to_end(greedy(stack, n=120)).ids
    inflight = [greedy(stack, n=120) for _ in range(3)]
    for s in inflight:
        s.start()
    for s in inflight:
        assert s.first_chunk.wait(60)
    stack.signal(role, signal.SIGTERM)
    time.sleep(0.3)  # the service is draining now
    late = run_to_end(greedy(stack, n=10))
    for s in inflight:
        s.join(120)
        assert s.error is None, (role, s.error)
        assert s.ids == reference
    if role == "draft":
        # New work is refused by the draft, not by the system: plain decoding serves it.
        assert late.error is None and late.ids == reference[:10]
        assert late.stats.drafted_tokens == 0
    else:
        assert late.error is not None
        assert late.error.code() == grpc.StatusCode.UNAVAILABLE, late.error
    drained = time.monotonic()
    assert stack.proc(role).wait(30) == 0  # exits cleanly once drained,
    # not at the end of its 10 s grace period: a draft's relay stream to the target,
    # open between requests, ends with the drain (target_service.servicer)
    assert time.monotonic() - drained < 5.0, role
    survivors = [r for r in ("draft", "target") if r != role]
    no_sessions(stack, roles=survivors)


@pytest.mark.parametrize("role", ["draft", "target", "orchestrator"])
def test_sigterm_ends_a_held_health_watch(fault_stack, role):
    """A client holding a ``grpc.health.v1.Health/Watch`` stream (gRPC's client-side
    health checking does) sees NOT_SERVING, then the stream ends, and the service
    exits once drained. (Before, the stream ran on, and the service waited out its
    whole grace period before it stopped.)"""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stack = fault_stack
    seen: list[int] = []
    ended: list[object] = []
    with grpc.insecure_channel(stack.address(role)) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())

        def follow() -> None:
            try:
                for response in watch:
                    seen.append(response.status)
                ended.append("ok")
            except grpc.RpcError as e:
                ended.append(e.code())

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        wait_until(lambda: seen, what="the first health status")
        stack.signal(role, signal.SIGTERM)
        drained = time.monotonic()
        assert stack.proc(role).wait(30) == 0
        assert time.monotonic() - drained < 5.0, role  # the grace period is 10 s
        follower.join(5)
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    assert seen[0] == serving and seen[-1] == not_serving, seen
    assert ended == ["ok"], ended


@pytest.mark.parametrize(
    ("details", "expected"),
    [
        ("Internal error from Core", "Unavailable"),  # gRPC core: the connection died
        ("Received RST_STREAM with error code 2", "Unavailable"),
        ("internal error: RuntimeError: CUDA error", "Internal"),  # the service's own
    ],
)
def test_a_connection_dying_mid_stream_counts_as_a_lost_peer(details, expected):
    """gRPC core reports some killed connections as INTERNAL; the orchestrator must
    fail over on those (a lost replica), and not on a service's own INTERNAL."""
    from specdec.transport.status import error_of

    e = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )
    assert type(error_of(e, "target")).__name__ == expected


@pytest.mark.parametrize(
    ("details", "expected"),
    [
        ("sessions: the limit of 256 live sessions is reached", "ResourceExhausted"),
        ("memory: the device ran out of memory in a forward", "ResourceExhausted"),
        ("Received message larger than max (20000000 vs. 16777216)", "Internal"),
        ("Sent message larger than max (20000000 vs. 16777216)", "Internal"),
    ],
)
def test_only_a_services_own_resource_exhausted_is_worth_a_wait(details, expected):
    """A full replica or a pass out of memory (the service's RESOURCE_EXHAUSTED) is
    waited out or left for another replica; gRPC's own, for a message over the size
    limit, is this call's failure and would fail every retry alike. (Found by review:
    such a verify was sent again twice a second for target_retry_s.)"""
    from specdec.transport.status import error_of

    e = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )
    assert type(error_of(e, "target")).__name__ == expected


def test_liveness_stays_serving_while_a_service_drains():
    """The health service's "liveness" name (what the manifests' liveness probes ask)
    stays SERVING when SIGTERM turns the others NOT_SERVING: a liveness probe that
    failed during a drain would have the container killed before its work is done."""
    import asyncio

    from grpc_health.v1 import health_pb2

    from specdec.transport.server import Health

    async def statuses() -> dict[str, int]:
        health = Health()
        await health.set("specdec.v1.Orchestrator", health_pb2.HealthCheckResponse.SERVING)
        await health.enter_graceful_shutdown()
        await health.set(Health.LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)  # ignored
        names = ("", "specdec.v1.Orchestrator", Health.LIVENESS)
        return {
            n: (await health.Check(health_pb2.HealthCheckRequest(service=n), None)).status
            for n in names
        }

    got = asyncio.run(statuses())
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    assert got == {"": not_serving, "specdec.v1.Orchestrator": not_serving, "liveness": serving}
