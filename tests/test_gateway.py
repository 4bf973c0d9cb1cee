"""The OpenAI-compatible gateway, driven by the official ``openai`` package as a user
would, in front of a real stack (tiny models): completion, chat, streaming and
errors; and what each answer must equal: the orchestrator's own greedy or seeded
output over gRPC, token for token.

Also: chat through the model's chat template (a stack whose orchestrator
tokenizer has one) and as plain text (``gateway.chat_template: plain-text``, for
the shared stack, whose tokenizer has none), and that a client disconnecting
mid-stream cancels the gRPC call and frees both sessions.
"""

from __future__ import annotations

import http.client
import json
import signal
import time

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from gateway.openai_schema import plain_text_chat
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .gateway_stack import MODEL, gateway
from .stack import local_stack
from .tiny import CHAT_TEMPLATE, build_tokenizer

PROMPT = "the quick brown fox"
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
]
SPECDEC_KEYS = {
    "acceptance_rate",
    "mean_accepted_length",
    "wire_bytes_per_token",
    "gamma",
    "steps",
    "drafted_tokens",
    "accepted_tokens",
    "fallback_steps",
    "adaptive",
    "mean_gamma",
    "overlapped_steps",
    "judged_tokens",
    "round_trips",
    "time_to_first_token_s",
    "tokens_per_second",
    "total_time_s",
    "finish_reason",
}


@pytest.fixture(scope="module")
def gw(tmp_path_factory, llama_stack):
    with gateway(
        tmp_path_factory.mktemp("gateway"),
        llama_stack.config,
        llama_stack.orchestrator_address,
        chat_template="plain-text",  # the tiny tokenizer has no chat template
    ) as g:
        yield g


def client(gw) -> openai.OpenAI:
    # max_retries=0: a test must see the first answer, not a retried one.
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def grpc_text(address: str, **fields) -> tuple[str, orchestrator_pb2.GenerationStats]:
    """The orchestrator's own answer to a GenerateRequest, over gRPC."""
    messages = fields.pop("messages", None)
    request = orchestrator_pb2.GenerateRequest(**fields)
    if messages is not None:
        request.messages.messages.extend(orchestrator_pb2.ChatMessage(**m) for m in messages)
    text, stats = "", None
    with grpc.insecure_channel(address) as ch:
        for m in orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(request, timeout=120):
            if m.HasField("chunk"):
                text += m.chunk.text
            else:
                stats = m.stats
    return text, stats


# ---- the four modes, with the real client ------------------------------------------------
def test_completion_equals_the_orchestrators_greedy_output(gw, llama_stack):
    c = client(gw).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"gamma": 3}
    )
    expected, stats = grpc_text(
        llama_stack.orchestrator_address, text=PROMPT, max_new_tokens=12, temperature=0, gamma=3
    )
    assert c.object == "text_completion" and c.model == MODEL and c.id.startswith("cmpl-")
    (choice,) = c.choices
    assert choice.text == expected and choice.finish_reason == "length" and choice.index == 0
    assert c.usage.prompt_tokens == stats.prompt_tokens == len(PROMPT)  # one token per character
    assert c.usage.completion_tokens == 12
    assert c.usage.total_tokens == len(PROMPT) + 12
    spec = c.model_extra["specdec"]
    assert set(spec) == SPECDEC_KEYS
    assert spec["gamma"] == 3 and spec["drafted_tokens"] > 0
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["wire_bytes_per_token"] > 0


def test_chat_as_plain_text_for_a_model_without_a_template(gw, llama_stack):
    raw = client(gw).chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0
    )
    assert raw.headers["x-specdec-chat-template"] == "plain-text"
    c = raw.parse()
    expected, stats = grpc_text(
        llama_stack.orchestrator_address,
        text="system: be brief\nuser: hello there\nassistant:",
        max_new_tokens=10,
        temperature=0,
    )
    assert plain_text_chat([(m["role"], m["content"]) for m in CHAT]) == (
        "system: be brief\nuser: hello there\nassistant:"
    )
    assert c.object == "chat.completion" and c.id.startswith("chatcmpl-")
    (choice,) = c.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert c.usage.prompt_tokens == stats.prompt_tokens
    assert set(c.model_extra["specdec"]) == SPECDEC_KEYS


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_equals_the_whole_answer(gw, kind):
    openai_client = client(gw)
    common = dict(model=MODEL, max_tokens=16, temperature=1.0, seed=11)
    if kind == "completion":
        create, args = openai_client.completions.create, {"prompt": PROMPT}

        def text_of(chunk):
            return chunk.choices[0].text
    else:
        create, args = openai_client.chat.completions.create, {"messages": CHAT}

        def text_of(chunk):
            return chunk.choices[0].delta.content or ""

    whole = create(**common, **args)
    chunks = list(create(**common, **args, stream=True, stream_options={"include_usage": True}))
    *generated, last, usage_chunk = chunks
    streamed = "".join(text_of(c) for c in generated)
    expected = whole.choices[0].text if kind == "completion" else whole.choices[0].message.content
    assert streamed == expected  # same seed, same tokens, streamed or not
    assert len(generated) >= 2
    assert all(c.choices[0].finish_reason is None for c in generated)
    assert last.choices[0].finish_reason == "length"
    assert last.model_extra["specdec"]["finish_reason"] == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1
    if kind == "chat":
        assert generated[0].choices[0].delta.role == "assistant"


def test_errors_raise_the_clients_exceptions_with_openais_error_body(gw):
    c = client(gw)
    with pytest.raises(openai.BadRequestError) as err:  # refused by the gateway
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert err.value.status_code == 400
    assert err.value.body["param"] == "max_tokens" and err.value.body["code"] == "invalid_value"
    assert err.value.body["type"] == "invalid_request_error"

    with pytest.raises(openai.BadRequestError) as err:  # refused by the orchestrator
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000)
    assert err.value.body["param"] == "max_tokens"
    assert err.value.body["code"] == "invalid_argument"
    assert err.value.body["message"].startswith("max_tokens: must be in [1, ")

    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=CHAT, n=2)
    assert err.value.body["param"] == "n"

    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="gpt-4o", prompt=PROMPT)
    assert err.value.body["code"] == "model_not_found" and MODEL in err.value.body["message"]

    with pytest.raises(openai.BadRequestError) as err:  # a gamma over the orchestrator's limit
        c.completions.create(model=MODEL, prompt=PROMPT, extra_body={"gamma": 99})
    assert err.value.body["param"] == "gamma" and err.value.body["code"] == "invalid_argument"


# ---- request fields ---------------------------------------------------------------------
def test_seed_top_k_top_p_and_gamma_reach_the_orchestrator(gw, llama_stack):
    fields = dict(max_new_tokens=14, temperature=1.0, top_k=5, top_p=0.9, gamma=2, seed=5)
    expected, stats = grpc_text(llama_stack.orchestrator_address, text=PROMPT, **fields)
    c = client(gw).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=14,
        temperature=1.0,
        top_p=0.9,
        seed=5,
        extra_body={"top_k": 5, "gamma": 2},
    )
    assert c.choices[0].text == expected
    assert c.model_extra["specdec"]["gamma"] == stats.gamma == 2


def test_token_id_prompts_and_stop_strings(gw, llama_stack):
    c = client(gw)
    greedy = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    text = greedy.choices[0].text
    stop = text[6:9]
    cut = text.index(stop)
    stopped = c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == text[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.model_extra["specdec"]["finish_reason"] == "stop"
    # The same prompt as token ids: the ids the target's tokenizer gives it.
    ids = AutoTokenizer.from_pretrained(llama_stack.config["target"]["model"]).encode(PROMPT)
    by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_models_and_health(gw):
    models = client(gw).models.list()
    (model,) = models.data
    assert model.id == MODEL and model.object == "model" and model.owned_by == "specdec"
    assert model.model_extra["specdec"]["vocab_size"] > 0
    assert client(gw).models.retrieve(MODEL) == model  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError) as err:
        client(gw).models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    for path in ("/health", "/health/live"):
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
        conn.request("GET", path)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}, path
        conn.close()


# ---- cancellation -------------------------------------------------------------------------
def test_finished_requests_end_ok_at_the_orchestrator(gw, llama_stack):
    """The gateway waits for each call's status: a request it has answered is never
    cancelled afterwards (which the orchestrator would count as CANCELLED)."""

    def count(code: str) -> float:
        return llama_stack.metric("orchestrator", "specdec_requests_total", f'code="{code}"')

    ok, cancelled = count("OK"), count("CANCELLED")
    c = client(gw)
    c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
    list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True))
    list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, stream=True))
    time.sleep(0.5)  # the orchestrator counts a request as its handler returns
    assert count("CANCELLED") == cancelled
    assert count("OK") == ok + 4


# ---- cancellation -------------------------------------------------------------------------
def test_a_client_disconnect_cancels_the_grpc_call_and_frees_the_sessions(gw, llama_stack):
    def cancelled() -> float:
        return llama_stack.metric("orchestrator", "specdec_requests_total", 'code="CANCELLED"')

    before, closed_before = cancelled(), gw.metric("specdec_gateway_requests_total", '"499"')
    body = json.dumps(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "temperature": 1, "stream": True}
    )
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.read(7) == b"data: {"  # generation is under way
    conn.sock.close()  # the client goes away mid-stream
    conn.close()

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (
            cancelled() > before
            and llama_stack.live_sessions("draft") == 0
            and llama_stack.live_sessions("target") == 0
        ):
            break
        time.sleep(0.2)
    assert cancelled() == before + 1, "the orchestrator never saw the call cancelled"
    assert llama_stack.live_sessions("draft") == 0 and llama_stack.live_sessions("target") == 0
    assert gw.metric("specdec_gateway_requests_total", '"499"') == closed_before + 1


# ---- a model with a chat template -----------------------------------------------------------
@pytest.fixture(scope="module")
def template_stack(tmp_path_factory, llama_pair):
    """A stack whose orchestrator tokenizer has a chat template (same vocabulary)."""
    tmp = tmp_path_factory.mktemp("template-stack")
    build_tokenizer(tmp / "tokenizer", chat_template=CHAT_TEMPLATE)
    with local_stack(tmp, *llama_pair, orchestrator__tokenizer=str(tmp / "tokenizer")) as stack:
        with gateway(tmp / "gw", stack.config, stack.orchestrator_address) as g:
            yield stack, g


def test_chat_uses_the_models_chat_template(template_stack):
    stack, gw = template_stack
    raw = client(gw).chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0
    )
    assert raw.headers["x-specdec-chat-template"] == "model"
    c = raw.parse()
    expected, stats = grpc_text(
        stack.orchestrator_address, messages=CHAT, max_new_tokens=10, temperature=0
    )
    rendered = "system; be brief\nuser; hello there\nassistant;"  # CHAT_TEMPLATE's rendering
    by_text, _ = grpc_text(stack.orchestrator_address, text=rendered, max_new_tokens=10)
    assert c.choices[0].message.content == expected == by_text
    assert c.usage.prompt_tokens == stats.prompt_tokens == len(rendered)


def test_chat_with_the_model_template_refuses_a_model_without_one(tmp_path, llama_stack):
    """The orchestrator's 400 for a tokenizer without a template reaches the client."""
    with gateway(
        tmp_path, llama_stack.config, llama_stack.orchestrator_address, chat_template="model"
    ) as g:
        with pytest.raises(openai.BadRequestError) as err:
            client(g).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert err.value.body["param"] == "messages"
    assert "no chat template" in err.value.body["message"]


# ---- graceful shutdown ----------------------------------------------------------------------
def test_sigterm_lets_a_stream_in_flight_finish(tmp_path, llama_stack):
    with gateway(
        tmp_path, llama_stack.config, llama_stack.orchestrator_address, grace_period_s=20
    ) as g:
        body = json.dumps(
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 150, "temperature": 0, "stream": True}
        )
        conn = http.client.HTTPConnection("127.0.0.1", g.port, timeout=60)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.read(7) == b"data: {"
        g.proc.send_signal(signal.SIGTERM)  # mid-stream
        rest = r.read()
        conn.close()
        assert rest.endswith(b"data: [DONE]\n\n")
        events = [json.loads(e[6:]) for e in (b"data: {" + rest).split(b"\n\n")[:-2]]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert g.proc.wait(30) == 0
        with pytest.raises(OSError):  # and it no longer listens
            http.client.HTTPConnection("127.0.0.1", g.port, timeout=5).request("GET", "/health")
