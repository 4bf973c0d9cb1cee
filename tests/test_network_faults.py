"""Network faults between the orchestrator and its model services, through REAL services.

A user-space TCP proxy (``specdec.local.proxy``) sits on the orchestrator's
draft hop and on its target hop. Promises checked:

- a slow (delayed beyond ``draft_timeout_s``), stalled or dropped draft never
  fails a request: greedy output is identical to the no-fault run, and the
  steps are counted as fallbacks (stats and ``specdec_fallback_steps_total``);
- once the draft hop heals, speculation resumes after the breaker's back-off;
- a stalled target ends a request with its deadline (DEADLINE_EXCEEDED or
  UNAVAILABLE), promptly, never a hang; later requests succeed and no session
  or request outlives its request.
"""

from __future__ import annotations

import time

import grpc
import pytest

from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .stack import proxied_stack

PROMPT = "the proxy is in the way"
GREEDY = dict(prompt=PROMPT, max_new_tokens=24, temperature=0.0, gamma=4, seed=7)
DRAFT_TIMEOUT_S = 0.2
SESSION_TTL_S = 6.0
STRICT_S = 2.0  # well under SESSION_TTL_S: a session gone by then was closed


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, llama_pair):
    """A stack whose orchestrator reaches draft and target through fault proxies."""
    with proxied_stack(
        tmp_path_factory.mktemp("faults"),
        *llama_pair,
        orchestrator__draft_timeout_s=DRAFT_TIMEOUT_S,
        draft__relay_send_timeout_s=0.1,  # the production deadline: faults are the point
        orchestrator__draft_retry_after_s=0.2,
        orchestrator__draft_retry_max_s=0.8,
        orchestrator__target_retry_s=1.0,
        orchestrator__grace_period_s=1,
        draft__grace_period_s=1,
        target__grace_period_s=1,
        draft__session_ttl_s=SESSION_TTL_S,
        target__session_ttl_s=SESSION_TTL_S,
    ) as proxied:
        yield proxied


@pytest.fixture(scope="module")
def reference(faulty):
    """The no-fault greedy output (speculation on). The stack's draft deadline is
    short on purpose, so on a loaded machine a first request may meet it once (a
    slow call, not a fault): up to five tries for one without a fallback step."""
    stack, draft_proxy, _ = faulty
    for _ in range(5):
        ids, text, stats = stack.generate_raw(**GREEDY)
        if stats.fallback_steps == 0:
            break
        time.sleep(1.0)  # past the breaker's back-off
    assert draft_proxy.forwarded["down"] > 0, "the draft hop does not go through the proxy"
    assert stats.drafted_tokens > 0 and stats.fallback_steps == 0, stats
    assert len(ids) == GREEDY["max_new_tokens"]
    return ids, text


def fallback_total(stack) -> float:
    return stack.metric("orchestrator", "specdec_fallback_steps_total")


def live(stack, role: str) -> float:
    return stack.live_sessions(role)


def assert_no_leaks(stack, proxies=()):
    """No live request, and each service's live sessions back to 0 within
    ``STRICT_S``, well under the services' ``session_ttl_s``: a session gone by
    then was closed (its stream ended), not expired.

    Bytes a proxy held during a fault reach the service only when the proxy
    lets them go (a late OpenSession can still create a session), so wait for
    the proxies to flush first.
    """
    for proxy in proxies:
        wait_for(lambda p=proxy: p.held_bytes() == 0, 10, "the proxy to flush")
    wait_for(
        lambda: stack.metric("orchestrator", "specdec_live_requests") == 0, 5, "0 live requests"
    )
    for role in ("target", "draft"):
        wait_for(lambda r=role: live(stack, r) == 0, STRICT_S, f"0 live {role} sessions")


@pytest.mark.parametrize("fault", ["delay", "stall", "drop"])
def test_broken_draft_hop_never_fails_a_request(faulty, reference, fault):
    stack, draft_proxy, _ = faulty
    before = fallback_total(stack)
    if fault == "delay":
        draft_proxy.delay(2.5 * DRAFT_TIMEOUT_S)  # 0.5 s each way, past the 0.2 s deadline
    elif fault == "stall":
        draft_proxy.stall()
    else:
        draft_proxy.drop()
    try:
        for _ in range(2):  # the first request meets the fault, the second the open breaker
            t0 = time.monotonic()
            ids, text, stats = stack.generate_raw(**GREEDY)
            took = time.monotonic() - t0
            assert (ids, text) == reference, f"{fault}: output differs from the no-fault run"
            assert stats.fallback_steps > 0, stats
            assert stats.generated_tokens == len(ids)
            # Each failed draft call costs at most its deadline; nothing waits on the hop.
            assert took < 15, f"{fault}: request took {took:.1f}s"
            print(f"draft {fault}: {stats.fallback_steps} fallback steps, {took:.2f}s")
        assert fallback_total(stack) > before
        if fault == "delay":  # let the late bytes arrive late, as a slow network would
            wait_for(lambda: draft_proxy.held_bytes() == 0, 10, "the delayed bytes")
    finally:
        draft_proxy.pass_through()
    assert_no_leaks(stack, [draft_proxy])


def test_speculation_resumes_after_the_draft_hop_heals(faulty, reference):
    stack, draft_proxy, _ = faulty
    draft_proxy.drop()
    _, _, stats = stack.generate_raw(**GREEDY)
    assert stats.fallback_steps > 0
    draft_proxy.pass_through()
    healed = time.monotonic()

    def speculating():
        ids, text, stats = stack.generate_raw(**GREEDY)
        assert (ids, text) == reference
        return stats if stats.drafted_tokens > 0 else None

    wait_for(speculating, 20, "drafted tokens > 0 after the draft hop healed", 0.2)
    print(f"speculation resumed {time.monotonic() - healed:.2f}s after the hop healed")
    # Once the breaker has closed, whole requests speculate without a fallback step.
    wait_for(
        lambda: stack.generate_raw(**GREEDY)[2].fallback_steps == 0,
        20,
        "a request without fallback steps",
        0.2,
    )
    assert_no_leaks(stack)


def test_stalled_target_ends_with_the_deadline_not_a_hang(faulty, reference):
    stack, _, target_proxy = faulty
    target_proxy.stall()
    try:
        with grpc.insecure_channel(stack.orchestrator_address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            req = orchestrator_pb2.GenerateRequest(text=PROMPT, max_new_tokens=24, temperature=0.0)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, timeout=2.0))
            took = time.monotonic() - t0
        assert err.value.code() in (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.UNAVAILABLE,
        ), err.value
        assert took < 3.0, f"the request ended {took:.2f}s after it started (deadline 2 s)"
        print(f"stalled target: {err.value.code().name} after {took:.2f}s")
    finally:
        target_proxy.pass_through()
    # The orchestrator itself still answers while the target is unreachable ...
    # ... and after the hop heals, requests succeed and nothing is left behind.
    ids, text, stats = stack.generate_raw(**GREEDY)
    assert (ids, text) == reference
    assert stats.generated_tokens == len(ids)
    assert_no_leaks(stack, [target_proxy])


def test_dropped_target_is_a_clean_error_then_recovers(faulty, reference):
    stack, _, target_proxy = faulty
    target_proxy.drop()
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stack.generate_raw(**GREEDY)
        took = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert err.value.details().startswith("target"), err.value.details()
        assert took < 10, f"{took:.1f}s to fail (target_retry_s is 1)"
    finally:
        target_proxy.pass_through()
    ids, text, _ = wait_for(
        lambda: _try_generate(stack), 15, "a successful request after the target hop healed", 0.2
    )
    assert (ids, text) == reference
    assert_no_leaks(stack)


def _try_generate(stack):
    try:
        return stack.generate_raw(**GREEDY)
    except grpc.RpcError:
        return None


@pytest.mark.parametrize("peer", ["draft", "target"])
def test_lost_open_answer_leaves_no_session(faulty, reference, peer):
    """The service opened the session but its answer came too late: the orchestrator
    must still close it (it cannot know the open did not happen)."""
    stack, draft_proxy, target_proxy = faulty
    assert_no_leaks(stack)  # nothing the earlier tests did is left
    proxy = draft_proxy if peer == "draft" else target_proxy
    proxy.delay(1.0, "down")  # requests arrive at once, answers 1 s late
    try:
        if peer == "draft":
            ids, text, stats = stack.generate_raw(**GREEDY)
            assert (ids, text) == reference and stats.fallback_steps > 0
        else:
            with grpc.insecure_channel(stack.orchestrator_address) as ch:
                stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
                req = orchestrator_pb2.GenerateRequest(text=PROMPT, max_new_tokens=8)
                with pytest.raises(grpc.RpcError):
                    list(stub.Generate(req, timeout=0.6))
        wait_for(lambda: proxy.held_bytes() == 0, 10, "the delayed answers")
    finally:
        proxy.pass_through()
    assert_no_leaks(stack)


@pytest.mark.parametrize("keepalive_s", [1.0, None])
def test_a_replica_gone_silent_fails_its_open_calls_within_twice_the_keepalive(keepalive_s):
    """A replica's node dies or is cut off without a reset while the orchestrator
    has calls open on it: nothing tells the connection. With keepalive
    (``orchestrator.keepalive_s``) its unanswered ping gives the connection up and
    the calls fail with UNAVAILABLE within twice ``keepalive_s``, so requests move
    to another replica; without it a call waits for its own deadline
    (``target_timeout_s``, 30 s). The services' own server and the orchestrator's
    channel, with a call that stays open (``Health/Watch``)."""
    import asyncio

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.config import TlsConfig
    from specdec.local.proxy import FaultProxy
    from specdec.transport.channels import open_channel
    from specdec.transport.server import start_server

    async def scenario() -> tuple[object, float]:
        running = await start_server(lambda server: None, (), "127.0.0.1", 0, "test")
        try:
            with FaultProxy("127.0.0.1", running.port) as proxy:
                channel = open_channel(proxy.address, TlsConfig(), 1 << 20, keepalive_s)
                watch = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(), timeout=6.0
                )
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                proxy.stall()
                began = time.monotonic()
                try:
                    await watch.read()
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                took = time.monotonic() - began
                await channel.close()
                return code, took
        finally:
            await running.server.stop(0)

    code, took = asyncio.run(scenario())
    print(f"keepalive {keepalive_s}: {code.name} after {took:.2f} s")
    if keepalive_s:
        assert code == grpc.StatusCode.UNAVAILABLE and took < 2 * keepalive_s + 1.5, (code, took)
    else:  # the call's own deadline
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and took > 4.0, (code, took)


def test_a_quiet_call_outlives_many_keepalive_pings():
    """A call on which nothing comes for a while (a session between steps, a Watch)
    keeps its connection through the client's keepalive pings. (Before, the servers
    set the ping rate they accept under a name gRPC does not know, kept its 5-minute
    default, and answered the third ping with GOAWAY "too many pings": the call
    failed UNAVAILABLE after about 3 keepalive periods.)"""
    import asyncio

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.config import TlsConfig
    from specdec.transport.channels import open_channel
    from specdec.transport.server import start_server

    async def scenario() -> tuple[object, float]:
        running = await start_server(lambda server: None, (), "127.0.0.1", 0, "test")
        try:
            channel = open_channel(f"127.0.0.1:{running.port}", TlsConfig(), 1 << 20, 1.0)
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(), timeout=6.0
            )
            await watch.read()
            began = time.monotonic()
            try:
                await watch.read()
            except grpc.aio.AioRpcError as e:
                code = e.code()
            await channel.close()
            return code, time.monotonic() - began
        finally:
            await running.server.stop(0)

    code, took = asyncio.run(scenario())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and took > 5.0, (code, took)
