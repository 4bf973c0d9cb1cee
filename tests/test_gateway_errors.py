"""The gateway's error mapping, end to end: every gRPC status the orchestrator can
end a call with becomes its HTTP status and OpenAI's error JSON, and the
``openai`` client raises the matching exception; errors after the first byte of
a stream become an error event followed by ``[DONE]``; an unreachable
orchestrator is a 503 and a failing readiness check.

The gateway runs as in production (``specdec serve gateway``); the orchestrator
is a scripted gRPC server in this process, so that each status can be produced
on demand: the request's ``text`` says what it does.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent import futures

import grpc
import openai
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.local.proxy import FaultProxy
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .gateway_stack import MODEL, gateway
from .stack import free_port

# The mapping under test, written out here rather than imported from gateway.errors.
EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, openai.BadRequestError, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, openai.BadRequestError, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, openai.AuthenticationError, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, openai.PermissionDeniedError, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, openai.NotFoundError, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, openai.RateLimitError, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, openai.InternalServerError, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, openai.InternalServerError, "server_error"),
}
OTHERS = [
    c
    for c in grpc.StatusCode
    if c not in EXPECTED and c not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED)
]
STATS = orchestrator_pb2.GenerationStats(
    prompt_tokens=3, generated_tokens=2, steps=1, finish_reason="length", gamma=4
)


class ScriptedOrchestrator(orchestrator_pb2_grpc.OrchestratorServicer):
    """Generate does what ``text`` says: ``abort CODE message``, ``midstream CODE``,
    ``nostats``, ``empty``, ``hang`` (one chunk, then nothing for up to 20 s);
    anything else: two chunks and the statistics."""

    def Generate(self, request, context):
        words = request.text.split(" ", 2)
        if words[0] == "abort":
            context.abort(grpc.StatusCode[words[1]], words[2])
        if words[0] == "empty":
            return
        yield orchestrator_pb2.GenerateResponse(chunk=orchestrator_pb2.Chunk(text="ab"))
        if words[0] == "hang":
            until = time.monotonic() + 20
            while context.is_active() and time.monotonic() < until:
                time.sleep(0.05)
            return
        if words[0] == "midstream":
            context.abort(grpc.StatusCode[words[1]], "target: gone mid-request")
        if words[0] == "nostats":
            return
        yield orchestrator_pb2.GenerateResponse(chunk=orchestrator_pb2.Chunk(text="cd"))
        yield orchestrator_pb2.GenerateResponse(stats=STATS)

    def Info(self, request, context):
        return orchestrator_pb2.OrchestratorInfo(target_model_id="scripted", vocab_size=10)


def scripted_server() -> tuple[grpc.Server, health.HealthServicer, int]:
    # It takes pings as the services do (``specdec.transport.server``).
    options = [("grpc.http2.min_ping_interval_without_data_ms", 1000)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=options)
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(ScriptedOrchestrator(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    return server, health_servicer, port


CONFIG = {"draft": {"model": "unused"}, "target": {"model": "unused"}}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    server, health_servicer, port = scripted_server()
    try:
        with gateway(tmp_path_factory.mktemp("gateway-errors"), CONFIG, f"127.0.0.1:{port}") as g:
            yield g, health_servicer
    finally:
        server.stop(0)


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def post(gw, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body))
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("code", list(EXPECTED) + OTHERS, ids=lambda c: c.name)
def test_each_grpc_status_becomes_its_http_status_and_client_exception(scripted, code):
    gw, _ = scripted
    status, exception, kind = EXPECTED.get(code, (500, openai.InternalServerError, "server_error"))
    with pytest.raises(exception) as err:
        client(gw).completions.create(model=MODEL, prompt=f"abort {code.name} something broke")
    assert err.value.status_code == status
    assert err.value.body == {
        "message": "something broke",
        "type": kind,
        "param": None,
        "code": code.name.lower(),
    }


def test_an_invalid_argument_names_the_openai_field(scripted):
    gw, _ = scripted
    with pytest.raises(openai.BadRequestError) as err:
        client(gw).completions.create(
            model=MODEL, prompt="abort INVALID_ARGUMENT max_new_tokens: must be in [1, 8], got 9"
        )
    assert err.value.body["param"] == "max_tokens"
    assert err.value.body["message"] == "max_tokens: must be in [1, 8], got 9"
    with pytest.raises(openai.BadRequestError) as err:
        client(gw).completions.create(
            model=MODEL, prompt="abort INVALID_ARGUMENT text: prompt has 9 tokens, over 8"
        )
    assert err.value.body["param"] == "prompt"


def test_an_error_mid_stream_is_an_error_event_then_done(scripted):
    gw, _ = scripted
    body = {"model": MODEL, "prompt": "midstream RESOURCE_EXHAUSTED", "stream": True}
    status, raw = post(gw, body)
    assert status == 200  # the first chunk was already sent
    frames = raw.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    assert json.loads(frames[0][6:])["choices"][0]["text"] == "ab"
    assert json.loads(frames[1][6:]) == {
        "error": {
            "message": "target: gone mid-request",
            "type": "rate_limit_error",
            "param": None,
            "code": "resource_exhausted",
        }
    }
    # The official client raises at that event.
    stream = client(gw).completions.create(model=MODEL, prompt="midstream UNAVAILABLE", stream=True)
    with pytest.raises(openai.APIError, match="gone mid-request"):
        for _ in stream:
            pass


def test_a_stream_without_statistics_is_a_server_error_not_a_hang(scripted):
    gw, _ = scripted
    status, raw = post(gw, {"model": MODEL, "prompt": "empty"})
    assert status == 500 and json.loads(raw)["error"]["type"] == "server_error"
    status, raw = post(gw, {"model": MODEL, "prompt": "nostats", "stream": True})
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert b'"type":"server_error"' in raw


def test_a_whole_answer_from_the_scripted_orchestrator(scripted):
    gw, _ = scripted
    c = client(gw).completions.create(model=MODEL, prompt="hello")
    assert c.choices[0].text == "abcd" and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == 3 and c.usage.completion_tokens == 2


def test_readiness_follows_the_orchestrators_health(scripted):
    gw, health_servicer = scripted

    def ready() -> int:
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        return status

    assert ready() == 200
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        assert ready() == 503
    finally:
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert ready() == 200


def test_an_unreachable_orchestrator_is_a_503_and_not_ready(tmp_path):
    config = {"draft": {"model": "unused"}, "target": {"model": "unused"}}
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    with gateway(tmp_path, config, dead, wait_for="/health/live") as gw:
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503
        conn.close()
        with pytest.raises(openai.InternalServerError) as err:
            client(gw).completions.create(model=MODEL, prompt="hello")
        assert err.value.status_code == 503 and err.value.body["code"] == "unavailable"


def test_an_orchestrator_gone_silent_mid_stream_is_an_error_in_seconds(tmp_path):
    """The orchestrator's node dies or is cut off without a reset, mid-stream: nothing
    tells the gateway's connection, whose call only reads. Its keepalive ping goes
    unanswered, and the stream ends with an error event within about twice
    ``gateway.keepalive_s``; then the gateway serves again once the path is back.
    (Before, the stream hung until request_timeout_s, 600 s by default.)"""
    server, _, port = scripted_server()
    try:
        with (
            FaultProxy("127.0.0.1", port) as proxy,
            gateway(tmp_path, CONFIG, proxy.address, keepalive_s=1) as gw,
        ):
            cut = threading.Timer(1.0, proxy.stall)  # after the first chunk went through
            began = time.monotonic()
            cut.start()
            try:
                status, raw = post(gw, {"model": MODEL, "prompt": "hang", "stream": True})
            finally:
                cut.cancel()
            took = time.monotonic() - began
            assert status == 200 and took < 8, (status, took, raw)
            frames = raw.split(b"\n\n")
            assert frames[-2:] == [b"data: [DONE]", b""], raw
            error = json.loads(frames[-3][6:])["error"]
            assert error["type"] == "server_error" and error["code"] == "unavailable", error
            proxy.pass_through()
            status, raw = post(gw, {"model": MODEL, "prompt": "ok"})
            assert status == 200 and json.loads(raw)["choices"][0]["text"] == "abcd"
    finally:
        server.stop(0)


def test_cors_for_the_origins_configured_and_no_other(tmp_path):
    """``gateway.cors_allow_origins``: a browser's preflight from an allowed origin is
    answered (204, before the bearer check: a preflight never carries the token), and
    every response to that origin, errors and streams included, carries
    ``Access-Control-Allow-Origin``; another origin gets none of it. The bearer
    scheme is read without regard to case (RFC 9110), here and at the orchestrator."""
    app_origin = "https://app.example"
    config = {**CONFIG, "orchestrator": {"auth_tokens": ["tok"]}}
    server, _, port = scripted_server()

    def call(gw, method: str, path: str, headers: dict, body: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
        try:
            conn.request(method, path, json.dumps(body) if body else None, headers)
            r = conn.getresponse()
            return r.status, r.headers, r.read()
        finally:
            conn.close()

    try:
        with gateway(tmp_path, config, f"127.0.0.1:{port}", cors_allow_origins=[app_origin]) as gw:
            preflight = {
                "Origin": app_origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            }
            status, headers, _ = call(gw, "OPTIONS", "/v1/completions", preflight)
            assert status == 204, status
            assert headers["Access-Control-Allow-Origin"] == app_origin
            assert "POST" in headers["Access-Control-Allow-Methods"]
            assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            body = {"model": MODEL, "prompt": "ok"}
            for token, want in (("", 401), ("Bearer tok", 200), ("bearer tok", 200)):
                headers_in = {"Origin": app_origin, **({"Authorization": token} if token else {})}
                status, headers, raw = call(gw, "POST", "/v1/completions", headers_in, body)
                assert status == want, (token, status, raw)
                assert headers["Access-Control-Allow-Origin"] == app_origin, token
            stream = {"Origin": app_origin, "Authorization": "BEARER tok"}
            status, headers, raw = call(
                gw, "POST", "/v1/completions", stream, {**body, "stream": True}
            )
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw
            assert headers["Access-Control-Allow-Origin"] == app_origin
            other = {**preflight, "Origin": "https://elsewhere.example"}
            status, headers, _ = call(gw, "OPTIONS", "/v1/completions", other)
            assert status == 401 and "Access-Control-Allow-Origin" not in headers
            other = {"Origin": "https://elsewhere.example", "Authorization": "Bearer tok"}
            status, headers, _ = call(gw, "POST", "/v1/completions", other, body)
            assert status == 200 and "Access-Control-Allow-Origin" not in headers
    finally:
        server.stop(0)


def test_a_draining_gateway_stays_live_and_turns_new_requests_away(tmp_path):
    """While a request is in flight after SIGTERM, the gateway still listens:
    /health/live says 200 (a liveness probe that failed mid-drain would have the pod
    killed before its streams finish), /health and new requests 503. When the grace
    period is over, the request still in flight is cancelled and the process exits."""
    import signal

    server, _, port = scripted_server()
    try:
        with gateway(tmp_path, CONFIG, f"127.0.0.1:{port}", grace_period_s=3) as gw:
            conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
            body = json.dumps({"model": MODEL, "prompt": "hang", "stream": True})
            conn.request("POST", "/v1/completions", body)
            r = conn.getresponse()
            assert r.read(7) == b"data: {"  # in flight, and it hangs for 20 s
            gw.proc.send_signal(signal.SIGTERM)
            began = time.monotonic()
            time.sleep(0.3)
            for method, path, want in (
                ("GET", "/health/live", 200),
                ("GET", "/health", 503),
                ("POST", "/v1/completions", 503),
            ):
                other = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
                other.request(method, path, body if method == "POST" else None)
                assert other.getresponse().status == want, path
                other.close()
            assert gw.proc.wait(20) == 0
            assert 2.5 < time.monotonic() - began < 10  # the grace period, not the hang
            conn.close()
    finally:
        server.stop(0)
