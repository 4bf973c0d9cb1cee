"""Every invalid field gets a precise status naming it; the services keep serving."""

from __future__ import annotations

import math
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


def _call_error(fn, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        result = fn(*args, timeout=10, **kw)
        if not isinstance(
            result,
            common_pb2.ModelInfo
            | common_pb2.OpenSessionResponse
            | common_pb2.RollbackResponse
            | target_pb2.VerifyResponse,
        ):
            list(result)
    return err.value


def test_model_services_reject_bad_calls(llama_stack):
    draft_ch = grpc.insecure_channel(llama_stack.address("draft"))
    target_ch = grpc.insecure_channel(llama_stack.address("target"))
    draft = draft_pb2_grpc.DraftServiceStub(draft_ch)
    target = target_pb2_grpc.TargetServiceStub(target_ch)
    params = common_pb2.SamplingParams(temperature=1.0)
    try:
        e = _call_error(
            draft.Propose,
            draft_pb2.ProposeRequest(session_id="nope", append_tokens=[1], gamma=2, params=params),
        )
        assert e.code() == grpc.StatusCode.NOT_FOUND and "session_id" in e.details()

        draft.OpenSession(
            common_pb2.OpenSessionRequest(session_id="s1", tokens=[1, 2, 3]), timeout=10
        )
        e = _call_error(draft.OpenSession, common_pb2.OpenSessionRequest(session_id="s1"))
        assert e.code() == grpc.StatusCode.ALREADY_EXISTS
        e = _call_error(
            draft.Propose,
            draft_pb2.ProposeRequest(
                session_id="s1", cache_len=7, append_tokens=[1], gamma=2, params=params
            ),
        )
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.details().startswith("cache_len:")
        e = _call_error(
            draft.Propose,
            draft_pb2.ProposeRequest(
                session_id="s1", cache_len=3, append_tokens=[1], gamma=0, params=params
            ),
        )
        assert e.code() == INVALID and e.details().startswith("gamma:")
        e = _call_error(
            draft.Propose,
            draft_pb2.ProposeRequest(
                session_id="s1", cache_len=3, append_tokens=[], gamma=2, params=params
            ),
        )
        assert e.code() == INVALID and e.details().startswith("append_tokens:")
        e = _call_error(
            draft.Propose,
            draft_pb2.ProposeRequest(
                session_id="s1",
                cache_len=3,
                append_tokens=[1],
                gamma=2,
                params=common_pb2.SamplingParams(temperature=1.0, top_p=2.0),
            ),
        )
        assert e.code() == INVALID and e.details().startswith("params.top_p:")
        e = _call_error(draft.Rollback, common_pb2.RollbackRequest(session_id="s1", cache_len=9))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        ok = draft.Rollback(common_pb2.RollbackRequest(session_id="s1", cache_len=1), timeout=10)
        assert (ok.cache_len, ok.removed) == (1, 2)
        assert draft.CloseSession(
            common_pb2.CloseSessionRequest(session_id="s1"), timeout=10
        ).existed

        target.OpenSession(
            common_pb2.OpenSessionRequest(session_id="t1", tokens=[1, 2]), timeout=10
        )
        e = _call_error(
            target.Verify,
            target_pb2.VerifyRequest(
                session_id="t1", cache_len=2, pending_tokens=[999], params=params
            ),
        )
        assert e.code() == INVALID and e.details().startswith("pending_tokens:")
        e = _call_error(
            target.Verify,
            target_pb2.VerifyRequest(
                session_id="t1", cache_len=2, pending_tokens=[1], draft_tokens=[4], params=params
            ),
        )
        assert e.code() == INVALID and e.details().startswith("draft_q:")
        e = _call_error(
            target.Verify,
            target_pb2.VerifyRequest(
                session_id="t1",
                cache_len=2,
                pending_tokens=[1],
                draft_tokens=[4],
                draft_q=[common_pb2.Distribution(token_ids=[5], probs=[1.0])],
                params=params,
            ),
        )
        assert e.code() == INVALID and e.details().startswith("draft_q[0]:")
        ok = target.Verify(
            target_pb2.VerifyRequest(
                session_id="t1",
                cache_len=2,
                pending_tokens=[1],
                draft_tokens=[4],
                draft_q=[common_pb2.Distribution(token_ids=[4], probs=[1.0])],
                params=params,
            ),
            timeout=10,
        )
        assert ok.cache_len == 4 and len(ok.p_draft) == 1
        target.CloseSession(common_pb2.CloseSessionRequest(session_id="t1"), timeout=10)
    finally:
        draft_ch.close()
        target_ch.close()
    assert llama_stack.generate(**OK_REQ_TEXT) != ""


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
