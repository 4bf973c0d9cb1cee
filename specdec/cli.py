"""The ``specdec`` command: serve one service, start them all locally, or generate.

specdec serve draft|target|orchestrator|gateway [--config FILE] [--set section.key=value ...]
specdec up        [--config FILE] [--set ...]      # all four on this machine
specdec generate  "prompt" [--address HOST:PORT] [--max-new-tokens N] ...
specdec demo      [--config FILE]                  # up, generate a few completions, stop
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
import subprocess
import sys
import time
from urllib.error import URLError
from urllib.request import urlopen

import grpc

from specdec.config import ConfigError, load_config
from specdec.errors import SpecdecError
from specdec.server import channel_credentials

log = logging.getLogger("specdec")
ROLES = ("draft", "target", "orchestrator", "gateway")
DEMO_PROMPTS = (
    "It is a truth universally acknowledged, that",
    "Mr. Darcy looked at Elizabeth and",
    "The morning was fine, and Emma",
)


def _config_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable)",
    )


def _generate_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--address", default=os.environ.get("SPECDEC_ADDRESS", "127.0.0.1:50050"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument(
        "--gamma", type=int, default=None, help="drafted tokens per step (default: server's)"
    )
    ap.add_argument("--stop", action="append", default=[])
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=120.0, help="request deadline in seconds")
    ap.add_argument(
        "--token-env",
        default="SPECDEC_TOKEN",
        help="environment variable holding a bearer token, if the API needs one",
    )
    ap.add_argument("--ca", default="", help="CA certificate for a TLS orchestrator")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description="Distributed speculative decoding.")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("role", choices=ROLES)
    _config_args(serve)
    up = sub.add_parser("up", help="run draft, target, orchestrator and gateway on this machine")
    _config_args(up)
    gen = sub.add_parser("generate", help="stream a completion from an orchestrator")
    gen.add_argument("prompt")
    _generate_args(gen)
    demo = sub.add_parser("demo", help="start the services, generate a few completions, stop")
    _config_args(demo)
    demo.add_argument("--max-new-tokens", type=int, default=60)
    return ap


# ---- serve --------------------------------------------------------------------------
async def _serve(role: str, config_path: str | None, overrides: list[str]) -> None:
    from specdec import metrics
    from specdec.server import serve_until_signal

    cfg = load_config(config_path, overrides)
    section = getattr(cfg, role)
    if role == "gateway":
        from gateway.service import serve as serve_gateway
        from gateway.service import serve_until_signal as gateway_until_signal

        gateway = await serve_gateway(cfg)
        metrics.serve_metrics(role, section.metrics_port, section.host)
        print(f"specdec gateway ready on {section.host}:{gateway.port}", flush=True)
        await gateway_until_signal(gateway, section.grace_period_s)
        return
    if role == "draft":
        from draft_service.server import serve

        running, domain = await serve(cfg.draft)
    elif role == "target":
        from target_service.server import serve

        running, domain = await serve(cfg.target)
    else:
        from orchestrator.server import serve

        running, domain = await serve(cfg)
    metrics.serve_metrics(role, section.metrics_port, section.host)
    log.info(
        "%s serving on %s:%d (metrics :%d)", role, section.host, running.port, section.metrics_port
    )
    print(f"specdec {role} ready on {section.host}:{running.port}", flush=True)

    await serve_until_signal(running, domain, section.grace_period_s)


# ---- up -----------------------------------------------------------------------------
def wait_healthy(
    address: str,
    timeout: float,
    procs: list[subprocess.Popen],
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Poll the health service at ``address`` until SERVING (TLS with ``credentials``)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    channel = (
        grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    )
    with channel as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a service exited during start-up (see its output above)")
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"{address} did not become healthy within {timeout:.0f}s")


def wait_http_healthy(
    url: str,
    timeout: float,
    procs: list[subprocess.Popen],
    client_cert: tuple[str, str] | None = None,
) -> None:
    """Poll an HTTP(S) health URL until it answers 200, presenting ``client_cert``
    (certificate and key files) to a server that demands one.

    The certificate of an HTTPS URL is not verified: this only asks a child
    process on this machine whether it is up, and sends nothing secret.
    """
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    if context is not None and client_cert:
        context.load_cert_chain(*client_cert)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a service exited during start-up (see its output above)")
        try:
            with urlopen(url, timeout=2.0, context=context) as r:
                if r.status == 200:
                    return
        except (URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout:.0f}s")


def gateway_url(cfg, path: str = "") -> str:
    """The gateway's base URL as seen from this machine (``http(s)://host:port``)."""
    g = cfg.gateway
    host = "127.0.0.1" if g.host in ("0.0.0.0", "") else g.host
    return f"{'https' if g.tls.cert else 'http'}://{host}:{g.port}{path}"


def start_gateway(
    config_path: str | None,
    overrides: list[str],
    quiet: bool = False,
    env: dict[str, str] | None = None,
    stdout=None,
    verbose: bool = False,
    wait_for: str = "/health",
) -> subprocess.Popen:
    """Start ``specdec serve gateway``; returns it once ``wait_for`` answers 200
    (``/health`` needs the orchestrator up, ``/health/live`` only the gateway).
    With ``stdout`` (a file), stdout and stderr go there; ``verbose`` logs at
    DEBUG level."""
    cfg = load_config(config_path, overrides)
    args = ["--config", config_path] if config_path else []
    for o in overrides:
        args += ["--set", o]
    out = subprocess.DEVNULL if quiet else stdout
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec", *(["-v"] if verbose else []), "serve", "gateway", *args],
        stdout=out,
        stderr=subprocess.STDOUT if stdout is not None else None,
        env=env,
    )
    try:
        # A gateway demanding client certificates is asked with its own client
        # identity (towards the orchestrator), as start_local checks the orchestrator.
        o_tls = cfg.gateway.orchestrator_tls
        identity = (o_tls.cert, o_tls.key) if cfg.gateway.tls.ca and o_tls.cert else None
        wait_http_healthy(gateway_url(cfg, wait_for), 300, [proc], identity)
    except BaseException:
        stop_local([proc])
        raise
    return proc


def start_local(
    config_path: str | None,
    overrides: list[str],
    quiet: bool = False,
    env: dict[str, str] | None = None,
    gateway: bool = False,
) -> list[subprocess.Popen]:
    """Start draft, target and orchestrator as child processes, and the HTTP
    gateway after them with ``gateway``; returns them once all are healthy."""
    cfg = load_config(config_path, overrides)
    args = []
    if config_path:
        args += ["--config", config_path]
    for o in overrides:
        args += ["--set", o]
    procs: list[subprocess.Popen] = []
    out = subprocess.DEVNULL if quiet else None
    try:
        # All three start at once: the orchestrator waits for draft and target itself.
        for role in ("draft", "target", "orchestrator"):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "specdec", "serve", role, *args], stdout=out, env=env
                )
            )
        # Checked as the orchestrator sees the model services (its upstream TLS),
        # and the API with the same CA (and client certificate) when it has TLS.
        upstream = channel_credentials(cfg.orchestrator.upstream_tls)
        for section in (cfg.draft, cfg.target):
            wait_healthy(f"{section.host}:{section.port}", 300, procs, upstream)
        api = upstream if cfg.orchestrator.tls.cert else None
        o = cfg.orchestrator
        wait_healthy(f"{o.host}:{o.port}", 300, procs, api)
        if gateway:
            procs.append(start_gateway(config_path, overrides, quiet, env))
    except BaseException:
        stop_local(procs)
        raise
    return procs


def stop_local(procs: list[subprocess.Popen], timeout: float = 20.0) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()


def _up(config_path: str | None, overrides: list[str]) -> None:
    procs = start_local(config_path, overrides, gateway=True)
    cfg = load_config(config_path, overrides)
    print(
        f"specdec is up: orchestrator (gRPC) {cfg.orchestrator.host}:{cfg.orchestrator.port}, "
        f"OpenAI-compatible API {gateway_url(cfg, '/v1')} (Ctrl-C stops all four)",
        flush=True,
    )
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stop_local(procs)


# ---- generate -----------------------------------------------------------------------
def generate(args: argparse.Namespace, out=sys.stdout) -> int:
    from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    request = orchestrator_pb2.GenerateRequest(
        text=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop=args.stop,
    )
    if args.gamma is not None:
        request.gamma = args.gamma
    if args.seed is not None:
        request.seed = args.seed
    metadata = []
    if os.environ.get(args.token_env):
        metadata.append(("authorization", f"Bearer {os.environ[args.token_env]}"))
    if args.ca:
        with open(args.ca, "rb") as f:
            channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        out.write(args.prompt)
        try:
            for msg in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                if msg.HasField("chunk"):
                    out.write(msg.chunk.text)
                    out.flush()
                else:
                    s = msg.stats
                    out.write(
                        f"\n\n[{s.generated_tokens} tokens in {s.total_time_s:.2f}s = "
                        f"{s.tokens_per_second:.1f} tok/s | gamma {s.gamma} | steps {s.steps} | "
                        f"acceptance {s.acceptance_rate:.2f} | mean accepted "
                        f"{s.mean_accepted_length:.2f} | TTFT {s.time_to_first_token_s * 1000:.0f}"
                        f" ms | {s.wire_bytes_per_token:.0f} wire B/token | "
                        f"finish {s.finish_reason}]\n"
                    )
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def _demo(config_path: str | None, overrides: list[str], max_new_tokens: int) -> int:
    cfg = load_config(config_path, overrides)
    print("starting draft, target and orchestrator ...", flush=True)
    procs = start_local(config_path, overrides, quiet=True)
    rc = 0
    try:
        ap = build_parser()
        for temperature, prompt in zip((0.0, 0.8, 0.8), DEMO_PROMPTS, strict=True):
            print(f"\n--- temperature {temperature} ---")
            args = ap.parse_args(
                [
                    "generate",
                    prompt,
                    "--max-new-tokens",
                    str(max_new_tokens),
                    "--temperature",
                    str(temperature),
                    "--seed",
                    "1",
                    "--address",
                    f"{cfg.orchestrator.host}:{cfg.orchestrator.port}",
                ]
            )
            rc = rc or generate(args)
    finally:
        stop_local(procs)
    return rc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "serve":
            asyncio.run(_serve(args.role, args.config, args.overrides))
        elif args.command == "up":
            _up(args.config, args.overrides)
        elif args.command == "generate":
            return generate(args)
        elif args.command == "demo":
            return _demo(args.config, args.overrides, args.max_new_tokens)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, SpecdecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
