"""The ``specdec`` command: serve one service, start them all locally, or generate.

specdec serve draft|target|orchestrator|gateway [--config FILE] [--set section.key=value ...]
specdec up        [--config FILE] [--set ...]      # all four on this machine
specdec generate  "prompt" [--address HOST:PORT] [--max-new-tokens N] ...
specdec demo      [--config FILE]                  # up, plain vs speculative, samples, stop
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time
from pathlib import Path

import grpc

from specdec.config import ConfigError, load_config
from specdec.errors import SpecdecError
from specdec.local.stack import gateway_url, service_roles, start_local, stop_local

log = logging.getLogger("specdec")
ROLES = ("draft", "target", "orchestrator", "gateway")


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
    demo = sub.add_parser("demo", help="start all three, compare plain and speculative, stop")
    _config_args(demo)
    demo.add_argument("--max-new-tokens", type=int, default=None, help="(default: the demo's)")
    demo.add_argument("--repeats", type=int, default=None, help="timed runs of each mode")
    return ap


# ---- serve --------------------------------------------------------------------------
async def _serve(role: str, config_path: str | None, overrides: list[str]) -> None:
    from specdec import metrics, tracing
    from specdec.transport.server import serve_until_signal

    cfg = load_config(config_path, overrides)
    section = getattr(cfg, role)
    if role == "gateway":
        from gateway.service import serve as serve_gateway
        from gateway.service import serve_until_signal as gateway_until_signal

        gateway = await serve_gateway(cfg)
        metrics.serve_metrics(role, section.metrics_port, section.host)
        print(f"specdec gateway ready on {section.host}:{gateway.port}", flush=True)
        gc.freeze()  # as below
        await gateway_until_signal(gateway, section.grace_period_s)
        return
    tracing.start(role)  # a step timeline (benchmarks.timeline), only with SPECDEC_TRACE_DIR
    # /metrics answers from the start, while a model loads (minutes on a GPU) or the
    # orchestrator waits for the services: Prometheus scrapes pods before they are
    # ready, and a refused scrape is `up == 0`, which SpecdecServiceDown pages on.
    local = role == "orchestrator" and cfg.orchestrator.local_models  # models in this process
    metrics.serve_metrics(role, section.metrics_port, section.host, local)
    if role in ("draft", "target") or local:
        from specdec.runtime.memory import keep_freed

        keep_freed((cfg.target if local else section).keep_freed_mb)  # before a model loads
    if role == "target":
        from specdec.runtime.openmp import long_spins

        t = cfg.target
        long_spins(t.plain_torch_threads, t.torch_threads, t.device)  # (before torch loads)
    if role == "draft":
        from draft_service.servicer import serve

        running, domain = await serve(cfg.draft)
    elif role == "target":
        from target_service.servicer import serve

        running, domain = await serve(cfg.target)
    else:
        from orchestrator.servicer import serve

        running, domain = await serve(cfg)
    log.info(
        "%s serving on %s:%d (metrics :%d)", role, section.host, running.port, section.metrics_port
    )
    print(f"specdec {role} ready on {section.host}:{running.port}", flush=True)
    # What start-up made (torch, transformers, the model) lives until exit: keep it out
    # of the collector's full passes while serving, and out of the one at exit (over a
    # second here, on every stop and restart).
    gc.freeze()
    try:
        await serve_until_signal(running, domain, section.grace_period_s)
    finally:
        tracing.close()


# ---- up -----------------------------------------------------------------------------
def _up(config_path: str | None, overrides: list[str]) -> int:
    from specdec.demo import busy_ports

    cfg = load_config(config_path, overrides)
    busy = busy_ports(cfg, gateway=True)
    if busy:
        print(f"error: already in use: {', '.join(busy)} (another specdec?); choose free "
              "ports with --set", file=sys.stderr)  # fmt: skip
        return 1
    if mismatch := _unwired(cfg):
        print(f"error: {mismatch}", file=sys.stderr)
        return 1
    # A stop signal (kill, systemd, docker stop) stops the services as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    procs = start_local(config_path, overrides, gateway=True)  # (stops its own on a signal)
    try:
        # Inside the try: a stop signal right after this line (a supervisor that waits
        # for it) stops the services too. Outside it, the signal left them running.
        print(
            f"specdec is up: orchestrator (gRPC) {cfg.orchestrator.host}:"
            f"{cfg.orchestrator.port}, OpenAI-compatible API {gateway_url(cfg, '/v1')} "
            "(Ctrl-C stops all four)",
            flush=True,
        )
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        roles = (*service_roles(cfg.orchestrator.local_models), "gateway")  # (start_local's order)
        dead = [(r, p.poll()) for r, p in zip(roles, procs, strict=True) if p.poll() is not None]
    except KeyboardInterrupt:
        return 0
    finally:
        stop_local(procs)
    role, code = dead[0]
    print(f"error: the {role} exited (code {code}); the others are stopped", file=sys.stderr)
    return 1


def _unwired(cfg) -> str:
    """Where ``up``'s services would not find each other: a port moved with --set
    while the address that reaches it was not (the services would wait on in vain)."""
    o, g = cfg.orchestrator, cfg.gateway
    wires = (
        ("orchestrator.draft_address", o.draft_address, "draft.port", cfg.draft.port),
        ("orchestrator.target_address", o.target_address, "target.port", cfg.target.port),
        ("gateway.orchestrator_address", g.orchestrator_address, "orchestrator.port", o.port),
    )[2 if o.local_models else 0 :]  # (no model services to reach: local_models)
    for key, address, port_key, port in wires:
        if address.rpartition(":")[2] != str(port):
            return (
                f"{key} is {address}, but {port_key} is {port}: set both "
                f"(--set {key}=127.0.0.1:{port})"
            )
    return ""


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "config", None):  # services started from here run in the repo's root
        args.config = str(Path(args.config).expanduser().resolve())
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "serve":
            asyncio.run(_serve(args.role, args.config, args.overrides))
        elif args.command == "up":
            return _up(args.config, args.overrides)
        elif args.command == "generate":
            return generate(args)
        elif args.command == "demo":
            from specdec.demo import run_demo

            return run_demo(args.config, args.overrides, args.max_new_tokens, args.repeats)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, SpecdecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
