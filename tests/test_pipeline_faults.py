"""Faults in the middle of a pipeline (``orchestrator.pipeline``), with the target's
own greedy continuation on (``target.lookahead_tokens``).

A pipelined request is paced by the draft: the draft relays each block to the target
unasked, the target runs it and answers the orchestrator, which only listens. Here
the draft is killed, stopped and brought back, the target is killed and restarted,
and the client walks away, each while such a request runs. Each case asserts what
``test_faults`` asserts of an ordinary request: the output is the no-fault output
token for token (greedy), the request ends in time, and no session is left on
either service.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .stack import local_stack
from .test_faults import (
    LONG,
    PROMPT,
    Streamer,
    greedy,
    no_sessions,
    run_to_end,
    wait_until,
    whole,
)
from .test_pipeline import PIPELINE, _blocks, _lookahead

RELAY_TIMEOUT_S = 1.0
DRAFT_TIMEOUT_S = 2.0  # (the tests' stack waits 30 s for the draft unless told)


@pytest.fixture(scope="module")
def piped_stack(tmp_path_factory, llama_pair):
    with local_stack(
        tmp_path_factory.mktemp("pipeline-faults"),
        *llama_pair,
        orchestrator__draft_retry_after_s=0.5,
        orchestrator__draft_retry_max_s=1.0,
        orchestrator__relay_timeout_s=RELAY_TIMEOUT_S,
        orchestrator__draft_timeout_s=DRAFT_TIMEOUT_S,
        target__lookahead_tokens=2,
        **PIPELINE,
    ) as stack:
        yield stack


@pytest.fixture
def stack(piped_stack):
    """The shared stack, whole and answering (``test_faults.whole``)."""
    yield from whole(piped_stack)


@pytest.fixture(scope="module")
def reference(piped_stack):
    """The no-fault greedy output, pipelined: the pipeline, its followers and the
    target's continuation all ran for it."""
    followers, used = _blocks(piped_stack, "follower"), _lookahead(piped_stack, "used")
    s = run_to_end(greedy(piped_stack))
    assert s.error is None and len(s.ids) == LONG
    assert _blocks(piped_stack, "follower") > followers
    assert _lookahead(piped_stack, "used") > used
    return s.ids


def _mid_pipeline(stack, make=None, attempts: int = 3) -> Streamer:
    """A request (``make()``'s, greedy by default) started and past its first
    chunk, its pipeline running. A request that ends without a pipelined block is
    made again, up to ``attempts`` times: one that starts while the orchestrator's
    breaker still backs off from the draft (after the last test's fault) decodes
    without the draft, and on a slow machine the next test's request can start
    within that back-off. (Pipelines resuming after it is asserted by
    ``test_draft_killed_mid_pipeline_falls_back_exactly``.)"""
    for _ in range(attempts):
        s = _started(stack, make() if make is not None else greedy(stack))
        if s is not None:
            return s
    raise AssertionError(f"no pipelined block in {attempts} requests")


def _started(stack, s: Streamer) -> Streamer | None:
    """``s`` started and past its first chunk, its pipeline running; None if it
    ended without a pipelined block."""
    blocks = _blocks(stack, "follower")
    s.start()
    assert s.first_chunk.wait(60)

    def piped() -> bool:
        return _blocks(stack, "follower") > blocks

    wait_until(lambda: piped() or not s.is_alive(), what="a pipelined block")
    if not piped():
        s.join(60)
        return None
    assert s.is_alive(), "the request ended before a fault could reach it"
    return s


def test_draft_killed_mid_pipeline_falls_back_exactly(stack, reference):
    s = _mid_pipeline(stack)
    stack.signal("draft", signal.SIGKILL)
    s.join(120)
    assert s.error is None, s.error
    assert s.ids == reference
    assert s.stats.fallback_steps > 0
    no_sessions(stack, roles=("target",))

    stack.restart("draft")
    time.sleep(1.2)  # the breaker's back-off: speculation, and pipelines, resume
    followers = _blocks(stack, "follower")
    again = run_to_end(greedy(stack, n=80))
    assert again.ids == reference[:80]
    assert _blocks(stack, "follower") > followers
    no_sessions(stack)


def test_draft_stopped_mid_pipeline_costs_the_relay_timeout_not_a_hang(stack, reference):
    """A draft that stops answering (SIGSTOP: alive, its connections open) strands the
    pipeline's next block: the orchestrator gives the relay up after
    ``relay_timeout_s``, decodes on, and the draft's calls time out to fallback steps."""
    s = _mid_pipeline(stack)
    stack.signal("draft", signal.SIGSTOP)
    stopped = time.monotonic()
    s.join(60)
    took = time.monotonic() - stopped
    stack.signal("draft", signal.SIGCONT)
    assert not s.is_alive(), "the request hung behind a stopped draft"
    assert s.error is None, s.error
    assert s.ids == reference
    assert s.stats.fallback_steps > 0
    # the relay given up, then one draft call timed out, and the breaker open: the
    # rest decodes plain at once
    assert took < RELAY_TIMEOUT_S + DRAFT_TIMEOUT_S + 8, took
    no_sessions(stack)


def test_target_restarted_mid_pipeline_completes_identically(stack, reference):
    s = _mid_pipeline(stack)
    stack.signal("target", signal.SIGKILL)
    stack.restart("target")  # sessions gone: re-prefilled from the orchestrator's history
    s.join(120)
    assert s.error is None, s.error
    assert s.ids == reference
    no_sessions(stack)


def test_a_client_gone_mid_pipeline_leaves_no_session_and_no_stale_block(stack, reference):
    blocks = _blocks(stack, "follower")
    req = orchestrator_pb2.GenerateRequest(
        token_ids=orchestrator_pb2.TokenIds(ids=PROMPT),
        max_new_tokens=LONG,
        temperature=0.0,
        gamma=4,
    )
    with grpc.insecure_channel(stack.orchestrator_address) as ch:
        call = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(req, timeout=120)
        got = 0
        for msg in call:
            got += len(msg.chunk.token_ids)
            if got >= 40 and _blocks(stack, "follower") > blocks:
                break
        call.cancel()
    wait_until(
        lambda: stack.metric("orchestrator", "specdec_live_requests") == 0,
        what="the request to end",
    )
    no_sessions(stack)
    # Whatever the draft had relayed for it is gone with its session: a new request
    # on the same prompt is untouched by it.
    again = run_to_end(greedy(stack))
    assert again.error is None and again.ids == reference
    no_sessions(stack)


def test_sampled_pipeline_survives_a_draft_kill(stack):
    def sampled() -> Streamer:
        return Streamer(
            stack.orchestrator_address,
            token_ids=orchestrator_pb2.TokenIds(ids=PROMPT),
            max_new_tokens=LONG,
            temperature=1.0,
            gamma=4,
            seed=11,
        )

    s = _mid_pipeline(stack, sampled)
    stack.signal("draft", signal.SIGKILL)
    s.join(120)
    assert s.error is None, s.error
    assert len(s.ids) == LONG and s.stats.generated_tokens == LONG
    no_sessions(stack, roles=("target",))


@pytest.mark.parametrize("role", ["draft", "target"])
def test_sigterm_mid_pipeline_finishes_the_request_and_exits_promptly(stack, reference, role):
    """A draining service finishes what is in flight: a draft's pipeline ends with its
    session (the request decodes on without it), a target runs the blocks relayed
    for its open sessions. Either way the request's output is the no-fault one, and
    the service exits soon after its last request, not at the end of its grace
    period."""
    s = _mid_pipeline(stack)
    stack.signal(role, signal.SIGTERM)
    s.join(120)
    assert s.error is None, s.error
    assert s.ids == reference
    ended = time.monotonic()
    assert stack.proc(role).wait(30) == 0
    assert time.monotonic() - ended < 5.0, role
    no_sessions(stack, roles=[r for r in ("draft", "target") if r != role])


PACED_RELAY_TIMEOUT_S = 4.0


def test_draft_killed_and_stopped_mid_paced_request(tmp_path, llama_pair):
    """Paced steps (``orchestrator.paced``, on by default): a lone sequential request
    whose draft is killed, and then one whose draft stops answering, mid-request,
    each end with the no-fault output in bounded time, and no session is left
    behind. A killed draft's session stream ends at once, and the orchestrator
    stops waiting for the block it would have relayed then
    (``TargetLink.verify``'s ``draft_ended``), well before ``relay_timeout_s``; a
    stopped one keeps its connection open, so the stranded block's relay is given
    up after ``relay_timeout_s``, and the draft's calls go to fallback steps."""
    with local_stack(
        tmp_path,
        *llama_pair,
        orchestrator__draft_retry_after_s=0.5,
        orchestrator__draft_retry_max_s=1.0,
        orchestrator__relay_timeout_s=PACED_RELAY_TIMEOUT_S,
        orchestrator__draft_timeout_s=DRAFT_TIMEOUT_S,
    ) as stack:
        reference = run_to_end(greedy(stack, overlap=False))
        assert reference.error is None and len(reference.ids) == LONG
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            for _ in whole(stack):
                fresh = _blocks(stack, "fresh")
                s = greedy(stack, overlap=False)
                s.start()
                assert s.first_chunk.wait(60)
                wait_until(lambda f=fresh: _blocks(stack, "fresh") > f, what="a paced block")
                stack.signal("draft", sig)
                hit = time.monotonic()
                s.join(60)
                took = time.monotonic() - hit
                assert not s.is_alive(), f"the request hung behind a draft hit by {sig}"
                assert s.error is None, s.error
                assert s.ids == reference.ids and s.stats.fallback_steps > 0
                if sig == signal.SIGKILL:  # seen as the stream ended, not by a timeout
                    assert took < PACED_RELAY_TIMEOUT_S, took
                assert took < PACED_RELAY_TIMEOUT_S + DRAFT_TIMEOUT_S + 8, (sig, took)
                print(sig.name, f"{took:.2f} s after the fault")
                no_sessions(stack, roles=("target",))
