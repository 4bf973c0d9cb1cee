"""The gateway over plain HTTP, as ``curl`` sees it: server-sent events checked byte
for byte, and bad input, every kind of it, answered with a 4xx in OpenAI's error
shape, never a 500. Against a real stack (tiny models).
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess

import grpc
import pytest

from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .gateway_stack import MODEL, gateway

PROMPT = "speculative decoding"
DONE = b"data: [DONE]\n\n"


@pytest.fixture(scope="module")
def gw(tmp_path_factory, llama_stack):
    with gateway(
        tmp_path_factory.mktemp("gateway-http"),
        llama_stack.config,
        llama_stack.orchestrator_address,
        chat_template="plain-text",  # the tiny tokenizer has no chat template
    ) as g:
        yield g


def request(
    gw, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None
) -> tuple[int, http.client.HTTPMessage, bytes]:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=120)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def grpc_chunks(address: str, **fields) -> list[str]:
    """The text of each chunk the orchestrator streams for this request."""
    with grpc.insecure_channel(address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        return [
            m.chunk.text
            for m in stub.Generate(orchestrator_pb2.GenerateRequest(**fields), timeout=120)
            if m.HasField("chunk")
        ]


def events(body: bytes) -> list[bytes]:
    """The ``data:`` payloads, after checking the framing: ``data: <one line>\\n\\n`` each."""
    assert body.endswith(DONE) and body.count(b"[DONE]") == 1, body[-200:]
    frames = body.split(b"\n\n")
    assert frames[-1] == b"", "the stream must end with a blank line"
    payloads = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: "), frame
        assert b"\n" not in frame and b"\r" not in frame, frame
        payloads.append(frame[len(b"data: ") :])
    assert payloads[-1] == b"[DONE]"
    return payloads[:-1]


def compact(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# ---- server-sent events, byte for byte ------------------------------------------------
def test_completion_stream_byte_for_byte(gw, llama_stack):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    status, headers, raw = request(gw, "POST", "/v1/completions", body)
    assert status == 200
    assert headers["Content-Type"] == "text/event-stream"
    assert headers["Cache-Control"] == "no-cache"
    assert headers["Transfer-Encoding"] == "chunked" and "Content-Length" not in headers

    payloads = events(raw)
    first = json.loads(payloads[0])
    head = (
        b'{"id":"' + first["id"].encode() + b'","object":"text_completion","created":'
        + str(first["created"]).encode() + b',"model":"' + MODEL.encode() + b'","choices":'
    )  # fmt: skip
    # Every event but the last: exactly these bytes around its text, and the texts
    # together are the orchestrator's greedy output. (Where the chunks break
    # depends on the steps, which an adaptive gamma may choose by timing.)
    texts = [json.loads(p)["choices"][0]["text"] for p in payloads[:-1]]
    assert all(texts)
    expected = [
        head + compact([{"text": t, "index": 0, "logprobs": None, "finish_reason": None}]) + b"}"
        for t in texts
    ]
    assert payloads[:-1] == expected
    chunks = grpc_chunks(
        llama_stack.orchestrator_address, text=PROMPT, max_new_tokens=12, temperature=0
    )
    assert "".join(texts) == "".join(chunks) and len(chunks) >= 2
    last = json.loads(payloads[-1])
    assert payloads[-1].startswith(
        head + b'[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"specdec":{'
    )
    assert last["specdec"]["finish_reason"] == "length" and "usage" not in last


def test_chat_stream_byte_for_byte_with_usage(gw, llama_stack):
    messages = [{"role": "user", "content": "hi"}]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 9,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, headers, raw = request(gw, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert headers["x-specdec-chat-template"] == "plain-text"
    payloads = events(raw)
    first = json.loads(payloads[0])
    head = (
        b'{"id":"' + first["id"].encode() + b'","object":"chat.completion.chunk","created":'
        + str(first["created"]).encode() + b',"model":"' + MODEL.encode() + b'","choices":'
    )  # fmt: skip

    def chunk(delta: bytes, finish: bytes = b"null") -> bytes:
        return (
            head + b'[{"index":0,"delta":' + delta
            + b',"logprobs":null,"finish_reason":' + finish + b'}],"usage":null'
        )  # fmt: skip

    chunks = grpc_chunks(
        llama_stack.orchestrator_address,
        text="user: hi\nassistant:",
        max_new_tokens=9,
        temperature=0,
    )
    assert payloads[0] == chunk(b'{"role":"assistant","content":""}') + b"}"
    texts = [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads[1:-2]]
    assert all(texts) and "".join(texts) == "".join(chunks)
    assert payloads[1:-2] == [chunk(compact({"content": t})) + b"}" for t in texts]
    assert payloads[-2].startswith(chunk(b"{}", b'"length"') + b',"specdec":{')
    assert (
        payloads[-1]
        == head
        + b'[],"usage":{"prompt_tokens":'
        + str(len("user: hi\nassistant:")).encode()
        + b',"completion_tokens":9,"total_tokens":'
        + str(len("user: hi\nassistant:") + 9).encode()
        + b"}}"
    )


def test_an_error_before_the_first_byte_is_an_http_status_not_an_event(gw):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100_000, "stream": True}
    status, headers, raw = request(gw, "POST", "/v1/completions", body)
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    assert json.loads(raw)["error"]["param"] == "max_tokens"


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_the_readme_curl_example(gw):
    """The README's command, with the test's address and model."""
    out = subprocess.run(
        [
            "curl", "-sN", f"{gw.url}/v1/chat/completions",
            "-H", "Content-Type: application/json",
            "-H", "Authorization: Bearer $SPECDEC_TOKEN",
            "-d", json.dumps({
                "model": MODEL, "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Who is Emma?"}],
            }),
        ],
        capture_output=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    payloads = events(out)
    assert json.loads(payloads[-1])["choices"][0]["finish_reason"] == "length"


# ---- bad input: always a 4xx in OpenAI's error shape ------------------------------------
C = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
M = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_COMPLETIONS = [
    # (body, status, param)
    (b"", 400, None),
    (b"not json", 400, None),
    (b"\xff\xfe", 400, None),
    (b"[1, 2]", 400, None),
    (b"[" * 50_000, 400, None),
    (b'{"model": "specdec-test", "prompt": "x", "max_tokens": NaN}', 400, None),
    (b'{"model": "specdec-test", "prompt": "x", "temperature": Infinity}', 400, None),
    ({**C, "max_tokens": "10"}, 400, "max_tokens"),
    ({**C, "max_tokens": True}, 400, "max_tokens"),
    ({**C, "max_tokens": 1.5}, 400, "max_tokens"),
    ({**C, "max_tokens": -1}, 400, "max_tokens"),
    ({**C, "max_tokens": 10**6}, 400, "max_tokens"),
    ({**C, "temperature": -0.5}, 400, "temperature"),
    ({**C, "temperature": 2.5}, 400, "temperature"),
    ({**C, "temperature": "hot"}, 400, "temperature"),
    ({**C, "top_p": 0}, 400, "top_p"),
    ({**C, "top_p": 1.5}, 400, "top_p"),
    ({**C, "top_k": -1}, 400, "top_k"),
    ({**C, "gamma": -1}, 400, "gamma"),
    ({**C, "gamma": 10**6}, 400, "gamma"),
    ({**C, "gamma": "four"}, 400, "gamma"),
    ({**C, "overlap": "yes"}, 400, "overlap"),
    ({**C, "seed": -(2**63) - 1}, 400, "seed"),  # (a negative int64 is taken: its 64 bits)
    ({**C, "seed": 2**64}, 400, "seed"),
    ({**C, "seed": 1.5}, 400, "seed"),
    ({**C, "stop": 5}, 400, "stop"),
    ({**C, "stop": [1]}, 400, "stop"),
    ({**C, "stop": [""]}, 400, "stop"),
    ({**C, "stop": ["a"] * 20}, 400, "stop"),
    ({**C, "n": 0}, 400, "n"),
    ({**C, "n": 2}, 400, "n"),
    ({**C, "n": "1"}, 400, "n"),
    ({**C, "stream": "yes"}, 400, "stream"),
    ({**C, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({**C, "stream": True, "stream_options": "all"}, 400, "stream_options"),
    (
        {**C, "stream": True, "stream_options": {"include_usage": 1}},
        400,
        "stream_options.include_usage",
    ),
    ({"model": MODEL}, 400, "prompt"),
    ({**C, "prompt": ""}, 400, "prompt"),
    ({**C, "prompt": []}, 400, "prompt"),
    ({**C, "prompt": [[]]}, 400, "prompt"),
    ({**C, "prompt": ["a", "b"]}, 400, "prompt"),
    ({**C, "prompt": [-1]}, 400, "prompt"),
    ({**C, "prompt": [1.5]}, 400, "prompt"),
    ({**C, "prompt": [10**6]}, 400, "prompt"),
    ({**C, "prompt": {"text": "x"}}, 400, "prompt"),
    ({**C, "prompt": "x" * 5000}, 400, "prompt"),
    ({**C, "prompt": "x" * 1500, "max_tokens": 1000}, 400, "max_tokens"),  # over max_context
    ({"prompt": "x"}, 400, "model"),
    ({**C, "model": 5}, 400, "model"),
    ({**C, "model": "gpt-4o"}, 404, "model"),
    ({**C, "logprobs": 5}, 400, "logprobs"),
    ({**C, "logprobs": 0}, 400, "logprobs"),  # OpenAI then returns the sampled tokens' ones
    ({**C, "echo": True}, 400, "echo"),
    ({**C, "best_of": 2}, 400, "best_of"),
    ({**C, "suffix": "end"}, 400, "suffix"),
    ({**C, "presence_penalty": 1.0}, 400, "presence_penalty"),
    ({**C, "frequency_penalty": -1}, 400, "frequency_penalty"),
    ({**C, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    # Past what the orchestrator's int32 fields, a float or UTF-8 can hold (these were 500s).
    ({**C, "max_tokens": 2**31}, 400, "max_tokens"),
    ({**C, "top_k": 2**31}, 400, "top_k"),
    ({**C, "gamma": 2**31}, 400, "gamma"),
    ({**C, "prompt": [2**31]}, 400, "prompt"),
    ({**C, "temperature": 10**400}, 400, "temperature"),
    ({**C, "top_p": -(10**400)}, 400, "top_p"),
    ({**C, "prompt": "a\ud800b"}, 400, "prompt"),
    ({**C, "stop": ["ok", "\udc00"]}, 400, "stop[1]"),
    ({**C, "\ud800": 1}, 400, None),
]
BAD_CHATS = [
    ({"model": MODEL}, 400, "messages"),
    ({**M, "messages": []}, 400, "messages"),
    ({**M, "messages": "hi"}, 400, "messages"),
    ({**M, "messages": [1]}, 400, "messages[0]"),
    ({**M, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({**M, "messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ({**M, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    (
        {**M, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),
    ({**M, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({**M, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({**M, "max_tokens": 10**6}, 400, "max_tokens"),
    ({**M, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),  # the orchestrator's
    ({**M, "messages": [{"role": "user", "content": "x" * 5000}]}, 400, "messages"),
    ({**M, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({**M, "tool_choice": "auto"}, 400, "tool_choice"),
    ({**M, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({**M, "logprobs": True}, 400, "logprobs"),
    ({**M, "top_logprobs": 3}, 400, "top_logprobs"),
    ({**M, "n": 3}, 400, "n"),
    ({**M, "messages": [{"role": "user", "content": "x\ud800"}]}, 400, "messages[0].content"),
    ({**M, "max_completion_tokens": 2**31}, 400, "max_completion_tokens"),
]


def _check_error(status: int, headers, raw: bytes, want_status: int, want_param) -> None:
    assert status == want_status, raw
    assert headers["Content-Type"].startswith("application/json")
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["code"], str)
    assert error["param"] == want_param, error


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS)
def test_bad_completion_requests_get_a_4xx_in_openais_shape(gw, body, status, param):
    _check_error(*request(gw, "POST", "/v1/completions", body), status, param)


@pytest.mark.parametrize("body,status,param", BAD_CHATS)
def test_bad_chat_requests_get_a_4xx_in_openais_shape(gw, body, status, param):
    _check_error(*request(gw, "POST", "/v1/chat/completions", body), status, param)


def test_harmless_values_of_unsupported_fields_and_unknown_fields_are_accepted(gw):
    body = {
        **C,
        "logprobs": None,
        "echo": False,
        "best_of": 1,
        "presence_penalty": 0,
        "logit_bias": {},
        "user": "someone",
        "some_future_field": {"x": 1},
    }
    status, _, raw = request(gw, "POST", "/v1/completions", body)
    assert status == 200, raw
    chat = {**M, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    status, _, raw = request(gw, "POST", "/v1/chat/completions", chat)
    assert status == 200, raw


def test_http_level_errors_are_in_openais_shape_too(gw):
    status, headers, raw = request(gw, "POST", "/v1/nothing", C)
    assert status == 404 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, headers, raw = request(gw, "GET", "/v1/completions")
    assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"
    assert headers["Allow"] == "POST"  # (RFC 9110: a 405 says which methods are)
    big = json.dumps({**C, "prompt": "x" * (2 * 1024 * 1024)}).encode()
    status, headers, raw = request(gw, "POST", "/v1/completions", big)
    assert status == 413 and json.loads(raw)["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**C, "prompt": "x" * 5000}, "prompt"),  # over max_prompt_tokens
        ({**C, "prompt": "x" * 1500, "max_tokens": 1000}, "max_tokens"),  # over max_context
        (
            {**M, "messages": [{"role": "user", "content": "x" * 1500}], "max_tokens": 1000},
            "max_tokens",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x" * 1500}],
                "max_completion_tokens": 1000,
            },
            "max_completion_tokens",
        ),
    ],
    ids=["prompt", "completion", "chat", "chat-max-completion-tokens"],
)
def test_a_request_too_long_for_the_model_is_context_length_exceeded(gw, body, param):
    """OpenAI's code and wording for it, which clients and proxies look for (LiteLLM's
    context-window fallbacks match "maximum context length"); the request's own
    field names throughout the message, none of the gRPC API's."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, _, raw = request(gw, "POST", path, body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded", error
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    assert "maximum context length" in error["message"], error
    assert "max_new_tokens" not in error["message"], error


def test_no_bad_input_ever_became_a_500(gw):
    """Runs after the tests above (same module, same gateway): its own metrics agree."""
    for line in gw.metrics_text().splitlines():
        if line.startswith("specdec_gateway_requests_total{"):
            assert 'status="5' not in line, line
    assert gw.metric("specdec_gateway_requests_total", 'status="400"') >= len(BAD_COMPLETIONS)
