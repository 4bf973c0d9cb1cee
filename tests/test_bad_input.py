"""Every invalid field gets a precise status naming it; the services keep serving."""

from __future__ import annotations

import math
import queue
import time

import grpc
import pytest

from specdec.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
OK_REQ_TEXT = dict(prompt_text="ok then", max_new_tokens=4, temperature=0.0)

GENERATE_CASES = [
    ("no prompt", dict(max_new_tokens=4), INVALID, "prompt"),
    ("empty text", dict(text="", max_new_tokens=4), INVALID, "text"),
    (
        "empty ids",
        dict(token_ids=orchestrator_pb2.TokenIds(), max_new_tokens=4),
        INVALID,
        "token_ids",
    ),
    (
        "prompt too long",
        dict(token_ids=orchestrator_pb2.TokenIds(ids=[1] * 5000), max_new_tokens=4),
        INVALID,
        "token_ids",
    ),
    (
        "id outside vocab",
        dict(token_ids=orchestrator_pb2.TokenIds(ids=[1, 10**6]), max_new_tokens=4),
        INVALID,
        "token_ids",
    ),
    (
        "negative id",
        dict(token_ids=orchestrator_pb2.TokenIds(ids=[-1]), max_new_tokens=4),
        INVALID,
        "token_ids",
    ),
    ("max_new_tokens 0", dict(text="a", max_new_tokens=0), INVALID, "max_new_tokens"),
    ("max_new_tokens < 0", dict(text="a", max_new_tokens=-3), INVALID, "max_new_tokens"),
    ("max_new_tokens over limit", dict(text="a", max_new_tokens=10**6), INVALID, "max_new_tokens"),
    ("temperature < 0", dict(text="a", max_new_tokens=4, temperature=-0.5), INVALID, "temperature"),
    (
        "temperature nan",
        dict(text="a", max_new_tokens=4, temperature=math.nan),
        INVALID,
        "temperature",
    ),
    ("top_p > 1", dict(text="a", max_new_tokens=4, top_p=1.5), INVALID, "top_p"),
    ("top_p < 0", dict(text="a", max_new_tokens=4, top_p=-0.1), INVALID, "top_p"),
    ("top_k < 0", dict(text="a", max_new_tokens=4, top_k=-1), INVALID, "top_k"),
    ("gamma < 0", dict(text="a", max_new_tokens=4, gamma=-1), INVALID, "gamma"),
    ("gamma over max", dict(text="a", max_new_tokens=4, gamma=17), INVALID, "gamma"),
    ("empty stop", dict(text="a", max_new_tokens=4, stop=[""]), INVALID, "stop"),
    ("too many stops", dict(text="a", max_new_tokens=4, stop=["x"] * 9), INVALID, "stop"),
]


@pytest.mark.parametrize(
    "name,fields,code,field", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES]
)
def test_generate_rejects_bad_field(llama_stack, name, fields, code, field):
    with grpc.insecure_channel(llama_stack.orchestrator_address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(orchestrator_pb2.GenerateRequest(**fields), timeout=30))
    assert err.value.code() == code, err.value.details()
    assert err.value.details().startswith(field + ":"), err.value.details()
    # The message says what is allowed, not just what is wrong.
    assert any(w in err.value.details() for w in ("must", "over", "outside", "set ", "at most"))
    # ... and the service still answers a valid request.
    assert llama_stack.generate(**OK_REQ_TEXT) != ""


def session(stub, *messages, timeout: float = 10):
    """Send ``messages`` on one session stream; returns (replies, error or None)."""
    replies = []
    try:
        for reply in stub.Session(iter(messages), timeout=timeout):
            replies.append(reply)
    except grpc.RpcError as e:
        return replies, e
    return replies, None


def _open(session_id="s1", tokens=(1, 2, 3), **params):
    return common_pb2.OpenSession(
        session_id=session_id,
        tokens=list(tokens),
        params=common_pb2.SamplingParams(**(params or {"temperature": 1.0})),
        wire_top_k=16,
    )


def D(**kind):  # noqa: N802 - a message constructor
    return draft_pb2.DraftRequest(**kind)


def T(**kind):  # noqa: N802
    return target_pb2.TargetRequest(**kind)


def _q(ids, counts, tail=0, bits=16):
    """A PackedQ of one position, encoded by hand (deltas and counts below 255)."""
    deltas = [ids[0]] + [b - a for a, b in zip(ids, ids[1:], strict=False)]
    big = [c for c in counts if c >= 255]
    return common_pb2.PackedQ(
        sizes=[len(ids)],
        id_deltas=bytes(deltas),
        counts=bytes(min(c, 255) for c in counts),
        count_escapes=big,
        tails=[tail],
        bits=bits,
    )


DRAFT_CASES = [
    ("first message is not open", [D(propose=draft_pb2.Propose(gamma=1))], INVALID, "open"),
    ("open twice", [D(open=_open()), D(open=_open())], INVALID, "open"),
    ("empty session id", [D(open=_open(session_id=""))], INVALID, "session_id"),
    ("token outside vocab", [D(open=_open(tokens=[10**6]))], INVALID, "tokens"),
    ("top_p > 1", [D(open=_open(temperature=1.0, top_p=2.0))], INVALID, "params.top_p"),
    ("tiny temperature", [D(open=_open(temperature=1e-30))], INVALID, "params.temperature"),
    (
        "wire_eps too large",
        [D(open=common_pb2.OpenSession(session_id="s", tokens=[1], wire_eps=0.7))],
        INVALID,
        "wire_eps",
    ),
    (
        "cache_len beyond the cache",
        [D(open=_open()), D(propose=draft_pb2.Propose(cache_len=7, append_tokens=[1], gamma=2))],
        grpc.StatusCode.FAILED_PRECONDITION,
        "cache_len",
    ),
    (
        "gamma 0",
        [D(open=_open()), D(propose=draft_pb2.Propose(cache_len=3, append_tokens=[1], gamma=0))],
        INVALID,
        "gamma",
    ),
    (
        "nothing appended",
        [D(open=_open()), D(propose=draft_pb2.Propose(cache_len=3, gamma=2))],
        INVALID,
        "append_tokens",
    ),
    (
        "rollback beyond the cache",
        [D(open=_open()), D(rollback=common_pb2.Rollback(cache_len=9))],
        grpc.StatusCode.FAILED_PRECONDITION,
        "cache_len",
    ),
    ("retune to gamma 0", [D(open=_open()), D(retune=draft_pb2.Retune())], INVALID, "retune.gamma"),
]

TARGET_CASES = [
    (
        "pending token outside vocab",
        [T(open=_open()), T(verify=target_pb2.Verify(cache_len=3, pending_tokens=[999]))],
        INVALID,
        "pending_tokens",
    ),
    (
        # Empty pending tokens need p kept from a last pass that ended at cache_len
        # (the prefill keeps p after its tokens: 3 here, not 2).
        "no pending token before the prefill's end",
        [T(open=_open()), T(verify=target_pb2.Verify(cache_len=2))],
        grpc.StatusCode.FAILED_PRECONDITION,
        "pending_tokens",
    ),
    (
        "drafts without q",
        [
            T(open=_open()),
            T(verify=target_pb2.Verify(cache_len=3, pending_tokens=[1], draft_tokens=[4])),
        ],
        INVALID,
        "draft_q",
    ),
    (
        "drafted token with q = 0",
        [
            T(open=_open()),
            T(
                verify=target_pb2.Verify(
                    cache_len=3, pending_tokens=[1], draft_tokens=[4], draft_q=_q([5], [65536])
                )
            ),
        ],
        INVALID,
        "draft_q[0]",
    ),
    (
        "duplicate ids in q",
        [
            T(open=_open()),
            T(
                verify=target_pb2.Verify(
                    cache_len=3,
                    pending_tokens=[1],
                    draft_tokens=[4],
                    draft_q=_q([4, 4], [32768, 32768]),
                )
            ),
        ],
        INVALID,
        "draft_q[0]",
    ),
    (
        "counts that are not a distribution",
        [
            T(open=_open()),
            T(
                verify=target_pb2.Verify(
                    cache_len=3, pending_tokens=[1], draft_tokens=[4], draft_q=_q([4], [100])
                )
            ),
        ],
        INVALID,
        "draft_q[0]",
    ),
    (
        "escapes that do not match",
        [
            T(open=_open()),
            T(
                verify=target_pb2.Verify(
                    cache_len=3,
                    pending_tokens=[1],
                    draft_tokens=[4],
                    draft_q=common_pb2.PackedQ(
                        sizes=[1], id_deltas=bytes([4]), counts=bytes([255]), tails=[0]
                    ),
                )
            ),
        ],
        INVALID,
        "draft_q.counts",
    ),
    (
        "a plain run with drafts",
        [
            T(open=_open()),
            T(
                verify=target_pb2.Verify(
                    cache_len=3,
                    pending_tokens=[1],
                    draft_tokens=[4],
                    draft_q=_q([4], [65536]),
                    run_tokens=3,
                )
            ),
        ],
        INVALID,
        "run_tokens",
    ),
    (
        "a plain run over the bound",
        [
            T(open=_open()),
            T(verify=target_pb2.Verify(cache_len=3, pending_tokens=[1], run_tokens=65)),
        ],
        INVALID,
        "run_tokens",
    ),
]


@pytest.mark.parametrize("name,messages,code,field", DRAFT_CASES, ids=[c[0] for c in DRAFT_CASES])
def test_draft_rejects_bad_message(llama_stack, name, messages, code, field):
    with grpc.insecure_channel(llama_stack.address("draft")) as ch:
        _, err = session(draft_pb2_grpc.DraftServiceStub(ch), *messages)
    assert err is not None, "the bad message was accepted"
    assert err.code() == code, err.details()
    assert err.details().startswith(field + ":"), err.details()
    wait_for_zero_sessions(llama_stack)


@pytest.mark.parametrize("name,messages,code,field", TARGET_CASES, ids=[c[0] for c in TARGET_CASES])
def test_target_rejects_bad_message(llama_stack, name, messages, code, field):
    with grpc.insecure_channel(llama_stack.address("target")) as ch:
        _, err = session(target_pb2_grpc.TargetServiceStub(ch), *messages)
    assert err is not None, "the bad message was accepted"
    assert err.code() == code, err.details()
    assert err.details().startswith(field + ":"), err.details()
    wait_for_zero_sessions(llama_stack)


def test_model_services_answer_good_messages(llama_stack):
    with grpc.insecure_channel(llama_stack.address("draft")) as ch:
        replies, err = session(
            draft_pb2_grpc.DraftServiceStub(ch),
            D(open=_open()),
            D(propose=draft_pb2.Propose(cache_len=3, append_tokens=[4], gamma=3, seed=9)),
            D(rollback=common_pb2.Rollback(cache_len=1)),
            D(retune=draft_pb2.Retune(gamma=4)),
        )
    assert err is None, err
    assert replies[0].opened.cache_len == 3
    assert replies[3].retuned.from_block == 0  # (no pipeline runs: nothing changed)
    proposal = replies[1].proposal
    assert len(proposal.tokens) == 3 and proposal.cache_len == 3 + 1 + 2
    assert len(proposal.q.sizes) == 3
    assert (replies[2].rolled_back.cache_len, replies[2].rolled_back.removed) == (1, 5)
    with grpc.insecure_channel(llama_stack.address("target")) as ch:
        replies, err = session(
            target_pb2_grpc.TargetServiceStub(ch),
            T(open=_open()),
            T(
                verify=target_pb2.Verify(
                    cache_len=3,
                    pending_tokens=[1],
                    draft_tokens=list(proposal.tokens),
                    draft_q=proposal.q,
                    seed=3,
                )
            ),
        )
    assert err is None, err
    verdict = replies[1].verdict
    assert verdict.cache_len == 3 + 1 + 3 and len(verdict.p_draft) == 3
    assert all(q > 0 for q in verdict.q_draft)
    wait_for_zero_sessions(llama_stack)
    assert llama_stack.generate(**OK_REQ_TEXT) != ""


def test_a_live_session_id_cannot_be_opened_twice(llama_stack):
    with grpc.insecure_channel(llama_stack.address("target")) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        outbox: queue.Queue = queue.Queue()
        outbox.put(T(open=_open(session_id="dup")))
        held = stub.Session(iter(outbox.get, None), timeout=10)  # stays open
        assert next(held).opened.cache_len == 3
        _, err = session(stub, T(open=_open(session_id="dup")))
        outbox.put(None)  # close the first stream
        assert list(held) == []
    assert err is not None and err.code() == grpc.StatusCode.ALREADY_EXISTS
    wait_for_zero_sessions(llama_stack)


def wait_for_zero_sessions(stack, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stack.live_sessions("draft") == 0 and stack.live_sessions("target") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(
        f"sessions leaked: draft {stack.live_sessions('draft')}, "
        f"target {stack.live_sessions('target')}"
    )


def test_sessions_freed_after_completion_error_and_cancellation(llama_stack):
    llama_stack.generate("complete me", max_new_tokens=20, temperature=1.0)
    wait_for_zero_sessions(llama_stack)

    # Error mid-generation: the client's deadline passes.
    with grpc.insecure_channel(llama_stack.orchestrator_address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        req = orchestrator_pb2.GenerateRequest(text="slow", max_new_tokens=1000, temperature=1.0)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=0.3))
        assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    wait_for_zero_sessions(llama_stack)

    # Client cancellation after the first chunk.
    with grpc.insecure_channel(llama_stack.orchestrator_address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        call = stub.Generate(
            orchestrator_pb2.GenerateRequest(
                text="cancel me", max_new_tokens=1000, temperature=1.0
            ),
            timeout=60,
        )
        next(call)
        call.cancel()
    wait_for_zero_sessions(llama_stack)
    assert llama_stack.metric("orchestrator", "specdec_live_requests") == 0
