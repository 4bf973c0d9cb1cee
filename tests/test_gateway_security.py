"""The gateway's security, through real services: HTTPS (and mutual TLS) towards
clients, TLS towards a TLS orchestrator that demands bearer tokens, the same
tokens checked at the gateway (before any gRPC call) and forwarded, and no
token in the gateway's logs. The stack's orchestrator tokenizer has a chat
template, so chat here goes through the model's template.
"""

from __future__ import annotations

import http.client
import json
import secrets
import shutil
import ssl

import openai
import pytest

from .gateway_stack import MODEL, gateway
from .stack import local_stack
from .test_security import make_pki
from .tiny import CHAT_TEMPLATE, build_tokenizer

TOKEN = "gw-" + secrets.token_hex(12)
WRONG_TOKEN = "bad-" + secrets.token_hex(12)

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


@pytest.fixture(scope="module")
def secure(tmp_path_factory, llama_pair):
    tmp = tmp_path_factory.mktemp("gateway-secure")
    pki = make_pki(tmp / "pki")
    build_tokenizer(tmp / "tokenizer", chat_template=CHAT_TEMPLATE)
    server = {"cert": str(pki / "server.pem"), "key": str(pki / "server.key")}
    with local_stack(
        tmp / "stack",
        *llama_pair,
        draft__tls=server,
        target__tls=server,
        orchestrator__tls=server,
        orchestrator__upstream_tls={"ca": str(pki / "ca.pem")},
        orchestrator__auth_tokens=[TOKEN],
        orchestrator__tokenizer=str(tmp / "tokenizer"),
        orchestrator__grace_period_s=1,
        draft__grace_period_s=1,
        target__grace_period_s=1,
    ) as stack:
        with gateway(
            tmp / "gw",
            stack.config,
            stack.orchestrator_address,
            verbose=True,  # DEBUG: the most the gateway ever logs
            tls=server,
            orchestrator_tls={"ca": str(pki / "ca.pem")},
        ) as gw:
            yield stack, gw, pki


def client(gw, pki, token: str = TOKEN, ca: str = "ca.pem", cert: str | None = None):
    context = ssl.create_default_context(cafile=str(pki / ca))
    if cert:
        context.load_cert_chain(pki / f"{cert}.pem", pki / f"{cert}.key")
    return openai.OpenAI(
        base_url=gw.url + "/v1",
        api_key=token,
        max_retries=0,
        timeout=60,
        http_client=openai.DefaultHttpxClient(verify=context),
    )


def test_https_with_the_token_works_end_to_end(secure):
    _, gw, pki = secure
    assert gw.url.startswith("https://")
    c = client(gw, pki)
    completion = c.completions.create(model=MODEL, prompt="secure hello", max_tokens=6)
    assert completion.usage.completion_tokens == 6
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    assert raw.headers["x-specdec-chat-template"] == "model"  # the tokenizer's template
    chunks = list(raw.parse())
    assert chunks[-1].choices[0].finish_reason == "length"
    assert c.models.list().data[0].id == MODEL


@pytest.mark.parametrize("token", [WRONG_TOKEN, TOKEN + "x"], ids=["wrong", "suffix"])
def test_wrong_tokens_are_refused_at_the_gateway(secure, token):
    stack, gw, pki = secure

    def refused_upstream() -> float:
        return stack.metric("orchestrator", "specdec_requests_total", 'code="UNAUTHENTICATED"')

    before = refused_upstream()
    c = client(gw, pki, token=token)
    with pytest.raises(openai.AuthenticationError) as err:
        c.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert err.value.status_code == 401
    assert err.value.body["code"] == "invalid_api_key"
    assert err.value.body["type"] == "authentication_error"
    assert TOKEN not in err.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    assert refused_upstream() == before  # the orchestrator was never asked


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": TOKEN}, {"Authorization": "Bearer "}, {"Authorization": "Bearer é"}],
    ids=["none", "no-scheme", "empty", "non-ascii"],
)
def test_missing_or_malformed_authorization_is_a_401(secure, headers):
    _, gw, pki = secure
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    conn = http.client.HTTPSConnection("127.0.0.1", gw.port, timeout=10, context=context)
    body = json.dumps({"model": MODEL, "prompt": "x"})
    conn.request("POST", "/v1/completions", body, {k: v.encode() for k, v in headers.items()})
    r = conn.getresponse()
    assert r.status == 401 and b'"invalid_api_key"' in r.read()
    conn.close()


def test_health_needs_no_token(secure):
    _, gw, pki = secure
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    conn = http.client.HTTPSConnection("127.0.0.1", gw.port, timeout=10, context=context)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()


def test_clients_must_trust_the_gateways_ca_and_plaintext_is_refused(secure):
    _, gw, pki = secure
    with pytest.raises(openai.APIConnectionError):
        client(gw, pki, ca="rogue.pem").completions.create(model=MODEL, prompt="x", max_tokens=2)
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        conn.request("GET", "/health")
        conn.getresponse()
    conn.close()


def test_the_gateway_verifies_the_orchestrators_certificate(secure, tmp_path):
    stack, _, pki = secure
    with gateway(
        tmp_path,
        stack.config,
        stack.orchestrator_address,
        wait_for="/health/live",
        orchestrator_tls={"ca": str(pki / "rogue.pem")},  # trusts another CA
    ) as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key=TOKEN, max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as err:
            c.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        assert err.value.status_code == 503


def test_mutual_tls_demands_a_client_certificate_from_the_ca(secure, tmp_path):
    stack, _, pki = secure
    server = {"cert": str(pki / "server.pem"), "key": str(pki / "server.key")}
    with gateway(
        tmp_path,
        stack.config,
        stack.orchestrator_address,
        wait_for="/health/live",
        tls={**server, "ca": str(pki / "ca.pem")},
        # Its client identity, presented to the orchestrator (which does not ask for
        # one) and by start_gateway's health check of this gateway (which does).
        orchestrator_tls={
            "ca": str(pki / "ca.pem"),
            "cert": str(pki / "client.pem"),
            "key": str(pki / "client.key"),
        },
    ) as gw:
        ok = client(gw, pki, cert="client").completions.create(
            model=MODEL, prompt="hello", max_tokens=2
        )
        assert ok.usage.completion_tokens == 2
        for cert in (None, "intruder"):
            with pytest.raises(openai.APIConnectionError):
                client(gw, pki, cert=cert).completions.create(
                    model=MODEL, prompt="hello", max_tokens=2
                )


def test_tokens_never_reach_the_gateways_log(secure):
    """Runs last in this module: stops the gateway so its log is complete."""
    _, gw, pki = secure
    client(gw, pki).completions.create(model=MODEL, prompt="one more", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client(gw, pki, token=WRONG_TOKEN).completions.create(model=MODEL, prompt="x")
    gw.stop()
    text = gw.log.read_text(errors="replace")
    assert "specdec gateway ready" in text and "DEBUG" in text  # the log was captured
    assert TOKEN not in text and WRONG_TOKEN not in text
