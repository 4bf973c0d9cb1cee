"""Security promises, through REAL services: TLS on every hop (mutual TLS
between the orchestrator and the model services), bearer-token auth on the
public API without leaking the token into logs, and safe model loading
(no remote code unless asked, safetensors preferred).

The stack here is started by this file, not by ``tests.stack.local_stack``:
``specdec.cli.start_local`` waits for health over plaintext, which a TLS
service never answers (reported), and this file needs each service's full
output (stdout and stderr, DEBUG level) to search it for the token.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.config import ModelServiceConfig, config_from_dict, load_config
from specdec.local.stack import spawn
from specdec.v1 import (
    common_pb2,
    draft_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    target_pb2_grpc,
)

from .stack import write_config

ROLES = ("draft", "target", "orchestrator")
TOKEN = "tok-" + secrets.token_hex(12)  # distinctive: searched for in the logs
WRONG_TOKEN = "bad-" + secrets.token_hex(12)
REQUEST = dict(text="secure hello", max_new_tokens=12, temperature=0.0, gamma=3, seed=1)

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


# ---- certificates ---------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
        cwd=d,
    )  # fmt: skip


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        cwd=d,
    )  # fmt: skip


def make_pki(d: Path) -> Path:
    """A throwaway CA, a server and a client certificate, and a rogue CA's client."""
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _leaf(
        d,
        "server",
        "ca",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _ca(d, "rogue")
    _leaf(d, "intruder", "rogue", "extendedKeyUsage=clientAuth\n")
    return d


def read(d: Path, name: str) -> bytes:
    return (d / name).read_bytes()


# ---- a stack started with its output captured -------------------------------------------
@dataclass
class SecureStack:
    pki: Path
    config: dict
    logs: dict[str, Path]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def address(self, role: str) -> str:
        return f"127.0.0.1:{self.config[role]['port']}"

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs.values())

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def channel(self, role: str = "orchestrator", client_cert: str | None = None) -> grpc.Channel:
        """A TLS channel trusting the test CA, presenting ``client_cert`` if given."""
        key = chain = None
        if client_cert:
            key, chain = read(self.pki, f"{client_cert}.key"), read(self.pki, f"{client_cert}.pem")
        creds = grpc.ssl_channel_credentials(read(self.pki, "ca.pem"), key, chain)
        return grpc.secure_channel(self.address(role), creds)


def _wait_ready(stack: SecureStack, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    pending = set(ROLES)
    while pending:
        for role, proc in zip(ROLES, stack.procs, strict=True):
            if proc.poll() is not None:
                raise AssertionError(f"{role} exited:\n{stack.logs[role].read_text()[-3000:]}")
            if role in pending and f"specdec {role} ready" in stack.logs[role].read_text():
                pending.discard(role)
        if time.monotonic() > deadline:
            raise AssertionError(f"not ready after {timeout}s: {sorted(pending)}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def secure(tmp_path_factory, llama_pair):
    tmp = tmp_path_factory.mktemp("secure")
    pki = make_pki(tmp / "pki")
    server = {"cert": str(pki / "server.pem"), "key": str(pki / "server.key")}
    mtls_server = {**server, "ca": str(pki / "ca.pem")}  # demands a client certificate
    path, cfg = write_config(
        tmp,
        *llama_pair,
        draft__tls=mtls_server,
        target__tls=mtls_server,
        orchestrator__tls=server,
        orchestrator__upstream_tls={
            "ca": str(pki / "ca.pem"),
            "cert": str(pki / "client.pem"),
            "key": str(pki / "client.key"),
        },
        # The draft relays proposals to the target as the orchestrator's peer would.
        draft__relay_tls={
            "ca": str(pki / "ca.pem"),
            "cert": str(pki / "client.pem"),
            "key": str(pki / "client.key"),
        },
        orchestrator__auth_tokens=[TOKEN],
        orchestrator__connect_timeout_s=60,
        # The first relay opens an mTLS channel: not a 0.1 s job on a loaded CI machine
        # (a slow one falls back, which the test reads as a failure: see tests/stack.py).
        orchestrator__draft_timeout_s=30.0,
        draft__relay_send_timeout_s=10.0,
        orchestrator__grace_period_s=1,
        draft__grace_period_s=1,
        target__grace_period_s=1,
    )
    logs = {role: tmp / f"{role}.log" for role in ROLES}
    stack = SecureStack(pki, cfg, logs)
    try:
        for role in ROLES:
            with open(logs[role], "wb") as out:
                # verbose: DEBUG logging, the most a service ever writes.
                stack.procs.append(spawn(role, str(path), [], out, verbose=True))
        _wait_ready(stack)
        yield stack
    finally:
        stack.stop()


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def generate(channel: grpc.Channel, metadata=None, timeout: float = 60):
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    msgs = list(
        stub.Generate(
            orchestrator_pb2.GenerateRequest(**REQUEST), timeout=timeout, metadata=metadata
        )
    )
    ids = [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids]
    return ids, msgs[-1].stats


def model_info(channel: grpc.Channel, role: str, timeout: float = 5):
    stub_cls = (
        draft_pb2_grpc.DraftServiceStub if role == "draft" else target_pb2_grpc.TargetServiceStub
    )
    return stub_cls(channel).Info(common_pb2.InfoRequest(), timeout=timeout)


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


# ---- TLS --------------------------------------------------------------------------------
def test_generation_over_tls_on_every_hop(secure):
    with secure.channel() as ch:
        ids, stats = generate(ch, bearer(TOKEN))
    assert stats.generated_tokens == len(ids) == REQUEST["max_new_tokens"]
    # The draft hop works too (mTLS): tokens were drafted, no step fell back to the target.
    assert stats.drafted_tokens > 0 and stats.fallback_steps == 0, stats
    # And the draft's own hop to the target (relay, mTLS with relay_tls).
    port = secure.config["orchestrator"]["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    relayed = [ln for ln in text.splitlines() if ln.startswith("specdec_relayed_steps_total")]
    assert any('outcome="relayed"' in ln and float(ln.split()[-1]) > 0 for ln in relayed), relayed
    assert not any('outcome="not_relayed"' in ln for ln in relayed), relayed


@pytest.mark.parametrize("role", ROLES)
def test_plaintext_clients_are_refused(secure, role):
    with grpc.insecure_channel(secure.address(role)) as ch:
        if role == "orchestrator":
            err = rpc_error(lambda: generate(ch, bearer(TOKEN), timeout=5))
        else:
            err = rpc_error(lambda: model_info(ch, role))
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err


@pytest.mark.parametrize("role", ["draft", "target"])
def test_model_services_demand_a_client_certificate_from_the_ca(secure, role):
    with secure.channel(role, client_cert="client") as ch:
        assert model_info(ch, role).vocab_size > 0  # the orchestrator's certificate is accepted
    for cert in (None, "intruder"):  # no certificate; one from another CA
        with secure.channel(role, client_cert=cert) as ch:
            err = rpc_error(lambda ch=ch: model_info(ch, role))
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (cert, err)


def test_client_must_trust_the_servers_ca(secure):
    """A client that verifies against another CA does not talk to the orchestrator."""
    creds = grpc.ssl_channel_credentials(read(secure.pki, "rogue.pem"))
    with grpc.secure_channel(secure.address("orchestrator"), creds) as ch:
        err = rpc_error(lambda: generate(ch, bearer(TOKEN), timeout=5))
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err


# ---- bearer tokens ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "metadata",
    [None, bearer(WRONG_TOKEN), [("authorization", TOKEN)], bearer(TOKEN + "x"), bearer("")],
    ids=["none", "wrong", "no-scheme", "suffix", "empty"],
)
def test_api_refuses_missing_or_wrong_tokens(secure, metadata):
    with secure.channel() as ch:
        err = rpc_error(lambda: generate(ch, metadata, timeout=10))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
        assert TOKEN not in (err.details() or "")
        info = orchestrator_pb2_grpc.OrchestratorStub(ch).Info
        err = rpc_error(
            lambda: info(orchestrator_pb2.OrchestratorInfoRequest(), timeout=10, metadata=metadata)
        )
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err


def test_right_token_works_and_health_needs_none(secure):
    with secure.channel() as ch:
        ids, stats = generate(ch, bearer(TOKEN))
        assert stats.generated_tokens == len(ids) > 0
        info = orchestrator_pb2_grpc.OrchestratorStub(ch).Info(
            orchestrator_pb2.OrchestratorInfoRequest(), timeout=10, metadata=bearer(TOKEN)
        )
        assert info.vocab_size > 0
        # The scheme is read without regard to case (RFC 9110, 11.1); the token exactly.
        ids, _ = generate(ch, [("authorization", f"bearer {TOKEN}")])
        assert len(ids) > 0
        # Probes (Kubernetes, load balancers) check health without a token.
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_tokens_never_reach_the_logs(secure):
    """Runs last: stops the stack so the logs are complete (including shutdown)."""
    with secure.channel() as ch:  # one more of each, right before the logs are read
        generate(ch, bearer(TOKEN))
        rpc_error(lambda: generate(ch, bearer(WRONG_TOKEN), timeout=10))
    secure.stop()
    text = secure.log_text()
    assert "specdec orchestrator ready" in text and "DEBUG" in text  # the logs were captured
    assert TOKEN not in text
    assert WRONG_TOKEN not in text
    for key in ("server.key", "client.key"):  # nor any private key material
        body = read(secure.pki, key).decode().splitlines()[1]
        assert body not in text


# ---- model loading ----------------------------------------------------------------------
BASE = {"draft": {"model": "d"}, "target": {"model": "t"}}


def test_trust_remote_code_is_off_by_default():
    assert ModelServiceConfig().trust_remote_code is False
    cfg = config_from_dict(BASE, env={})
    assert cfg.draft.trust_remote_code is False and cfg.target.trust_remote_code is False
    shipped = load_config(env={})  # configs/default.yaml
    assert shipped.draft.trust_remote_code is False and shipped.target.trust_remote_code is False


def test_load_model_prefers_safetensors_over_pickles(tmp_path, llama_pair, monkeypatch):
    """A directory with both formats loads the safetensors weights, asked for explicitly."""
    import specdec.runtime.loading as model_mod
    from specdec.runtime.loading import load_model

    src = llama_pair[1]
    both = tmp_path / "both"
    shutil.copytree(src, both)
    assert list(both.glob("*.safetensors"))
    # A pytorch_model.bin whose weights differ: zeros everywhere.
    reference = load_model(str(src))
    torch.save({k: torch.zeros_like(v) for k, v in reference.state_dict().items()},
               both / "pytorch_model.bin")  # fmt: skip

    calls = []
    real = model_mod.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_mod.AutoModelForCausalLM, "from_pretrained", spy)
    loaded = load_model(str(both))
    assert calls[-1]["use_safetensors"] is True
    assert calls[-1]["trust_remote_code"] is False
    for (name, a), b in zip(
        reference.state_dict().items(), loaded.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), f"{name}: not the safetensors weights"


def test_model_code_is_never_run_unless_trusted(tmp_path, llama_pair):
    """A model directory that ships code (auto_map) loads with the library's own class,
    and the shipped code is never imported."""
    from specdec.runtime.loading import load_model

    d = tmp_path / "shipped-code"
    shutil.copytree(llama_pair[1], d)
    marker = tmp_path / "remote-code-ran"
    (d / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    pass\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "evil.EvilConfig",
        "AutoModelForCausalLM": "evil.EvilModel",
    }
    (d / "config.json").write_text(json.dumps(config))
    try:
        model = load_model(str(d))
    except ValueError as e:  # a library may refuse outright: equally safe
        assert "trust_remote_code" in str(e)
    else:
        assert type(model).__name__ == "LlamaForCausalLM"
    assert not marker.exists(), "code shipped with the model was executed"
