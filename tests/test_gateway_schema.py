"""The gateway's pure parts, without any server: OpenAI requests mapped onto
GenerateRequest, the response and event shapes, the error mapping, the config
section; and that the gateway process never imports torch (its slim image).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
import pytest
import yaml

from gateway.errors import ApiError, from_rpc
from gateway.openai_schema import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatShape,
    CompletionShape,
    parse_json,
    plain_text_chat,
    sse,
)
from specdec.config import ConfigError, GatewayConfig, config_from_dict
from specdec.v1 import orchestrator_pb2

from .stack import free_port

MODEL = "m"
CFG = GatewayConfig()
PLAIN = GatewayConfig(chat_template="plain-text")


def completion(**fields) -> orchestrator_pb2.GenerateRequest:
    return CompletionShape.parse({"model": MODEL, "prompt": "hi", **fields}, MODEL, CFG).request


def chat(cfg: GatewayConfig = CFG, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatShape.parse(body, MODEL, cfg)


def test_completion_fields_map_onto_the_grpc_request():
    r = completion(max_tokens=7, temperature=0.5, top_p=0.9, stop="x", seed=3)
    assert (r.text, r.max_new_tokens, r.temperature, r.top_p) == ("hi", 7, 0.5, pytest.approx(0.9))
    assert list(r.stop) == ["x"] and r.seed == 3
    # OpenAI's seed is a signed int64: a negative one is its two's complement.
    assert completion(seed=-1).seed == 2**64 - 1
    assert completion(seed=-(2**63)).seed == 2**63
    assert not r.HasField("gamma") and r.top_k == 0
    r = completion(top_k=5, gamma=0, stop=["a", "b"])
    assert r.top_k == 5 and r.HasField("gamma") and r.gamma == 0 and list(r.stop) == ["a", "b"]
    assert not r.HasField("overlap")
    assert completion(overlap=False).HasField("overlap") and not completion(overlap=False).overlap


def test_completion_defaults_are_openais():
    r = completion()
    assert r.max_new_tokens == COMPLETION_DEFAULT_MAX_TOKENS == 16
    assert r.temperature == 1.0 and r.top_p == 1.0
    assert not r.HasField("seed")  # the orchestrator draws one


def test_prompt_forms():
    assert completion(prompt=["one"]).text == "one"
    assert list(completion(prompt=[1, 2, 3]).token_ids.ids) == [1, 2, 3]
    assert list(completion(prompt=[[4, 5]]).token_ids.ids) == [4, 5]
    with pytest.raises(ApiError) as err:
        completion(prompt=["one", "two"])
    assert err.value.param == "prompt" and "one prompt per request" in err.value.message


def test_chat_fields_and_both_ways_to_make_a_prompt():
    body = {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ],
        "max_tokens": 9,
        "max_completion_tokens": 5,
    }
    g = ChatShape.parse(body, MODEL, CFG)
    assert g.chat_template == "model"
    msgs = [(m.role, m.content) for m in g.request.messages.messages]
    assert msgs == [("system", "be brief"), ("user", "a\nb"), ("assistant", "")]
    assert g.request.max_new_tokens == 5  # max_completion_tokens wins
    g = ChatShape.parse(body, MODEL, PLAIN)
    assert g.chat_template == "plain-text" and g.request.WhichOneof("prompt") == "text"
    assert g.request.text == "system: be brief\nuser: a\nb\nassistant: \nassistant:"
    assert chat().request.max_new_tokens == CFG.default_max_tokens == 256
    assert plain_text_chat([("user", "hi")]) == "user: hi\nassistant:"


def test_parse_json_refuses_what_is_not_a_json_object():
    assert parse_json(b'{"a": 1}') == {"a": 1}
    for raw in (
        b"",
        b"[]",
        b'"x"',
        b"{",
        b'{"a": NaN}',
        b'{"a": -Infinity}',
        b"\xff",
        b"[" * 10**5,
    ):
        with pytest.raises(ApiError) as err:
            parse_json(raw)
        assert err.value.status == 400 and err.value.code == "invalid_json", raw[:20]


def test_an_unknown_model_is_a_404_that_names_the_served_one():
    with pytest.raises(ApiError) as err:
        CompletionShape.parse({"model": "other", "prompt": "x"}, MODEL, CFG)
    assert (err.value.status, err.value.param, err.value.code) == (404, "model", "model_not_found")
    assert f"`{MODEL}`" in err.value.message


@pytest.mark.parametrize(
    "code,status",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
        (grpc.StatusCode.DATA_LOSS, 500),
    ],
)
def test_grpc_status_to_http_status(code, status):
    e = from_rpc(code, "details")
    assert e.status == status and e.code == code.name.lower() and e.message == "details"
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_the_orchestrators_field_names_become_openais():
    e = from_rpc(
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_new_tokens: must be in [1, 1024], got 0",
        CompletionShape.field_names,
    )
    assert e.param == "max_tokens" and e.message == "max_tokens: must be in [1, 1024], got 0"
    e = from_rpc(grpc.StatusCode.INVALID_ARGUMENT, "text: too long", ChatShape.field_names)
    assert e.param == "messages"  # as plain text, the conversation is the text
    e = from_rpc(grpc.StatusCode.INVALID_ARGUMENT, "messages[2].role: must not be empty")
    assert e.param == "messages[2].role"
    e = from_rpc(grpc.StatusCode.INVALID_ARGUMENT, "no field here")
    assert e.param is None and e.message == "no field here"
    # Only argument errors name a param: an UNAVAILABLE "target: ..." is not a field.
    assert from_rpc(grpc.StatusCode.UNAVAILABLE, "target: down").param is None


def test_events_are_one_compact_json_line():
    event = sse({"a": "x\ny", "b": [1, None]})
    assert event == b'data: {"a":"x\\ny","b":[1,null]}\n\n'
    stats = orchestrator_pb2.GenerationStats(
        prompt_tokens=2, generated_tokens=3, finish_reason="eos", acceptance_rate=0.5
    )
    shape = ChatShape(MODEL, include_usage=True)
    final, usage = shape.final_events(stats)
    final = json.loads(final[6:])
    assert final["choices"][0]["finish_reason"] == "stop"  # eos is OpenAI's "stop"
    assert final["usage"] is None and final["specdec"]["acceptance_rate"] == 0.5
    assert json.loads(usage[6:])["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
    }
    assert len(CompletionShape(MODEL).final_events(stats)) == 1  # no usage chunk unless asked


# ---- config ---------------------------------------------------------------------------
BASE = {"draft": {"model": "d"}, "target": {"model": "t"}}


def test_gateway_config_defaults_env_and_errors():
    cfg = config_from_dict(BASE, env={})
    assert (cfg.gateway.port, cfg.gateway.metrics_port) == (8000, 9103)
    assert cfg.gateway.orchestrator_address == "127.0.0.1:50050"
    assert cfg.gateway.chat_template == "model"
    env = {
        "SPECDEC_GATEWAY_PORT": "8080",
        "SPECDEC_GATEWAY_ORCHESTRATOR_TLS__CA": "/ca.pem",
        "SPECDEC_GATEWAY_PORT_8000_TCP": "tcp://10.0.0.1:8000",  # a service link: ignored
    }
    cfg = config_from_dict(BASE, ["gateway.model_name=demo"], env=env)
    assert cfg.gateway.port == 8080 and cfg.gateway.orchestrator_tls.ca == "/ca.pem"
    assert cfg.gateway.model_name == "demo"
    for raw, key in [
        ({**BASE, "gateway": {"port": 70000}}, "gateway.port"),
        ({**BASE, "gateway": {"default_max_tokens": 0}}, "gateway.default_max_tokens"),
        ({**BASE, "gateway": {"chat_template": "chatml"}}, "gateway.chat_template"),
        ({**BASE, "gateway": {"prot": 1}}, "gateway.prot"),
    ]:
        with pytest.raises(ConfigError) as err:
            config_from_dict(raw, env={})
        assert str(err.value).startswith(key + ":"), str(err.value)


def test_the_gateway_process_never_imports_torch(tmp_path):
    """The gateway's image has no torch: ``specdec serve gateway`` must start
    without importing it (nor anything else only the model services need)."""
    port, metrics_port = free_port(), free_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **BASE,
                "gateway": {"port": port, "metrics_port": metrics_port, "grace_period_s": 0},
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "specdec", "serve", "gateway"]
        + ["--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("specdec gateway ready"), ready
    finally:
        proc.send_signal(signal.SIGTERM)
        _, imports = proc.communicate(timeout=30)
    modules = {line.rsplit("|", 1)[-1].strip() for line in imports.splitlines() if "|" in line}
    assert "aiohttp" in modules and "grpc" in modules  # the listing is real
    heavy = {"torch", "transformers", "tokenizers", "numpy", "safetensors"}
    assert not {m.split(".")[0] for m in modules} & heavy
