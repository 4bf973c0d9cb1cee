"""The gateway process: start the HTTP(S) server, drain and stop it on SIGTERM.

``serve`` binds ``gateway.host:port`` (0 picks a free port) with server TLS
when ``gateway.tls.cert`` is set (and demands client certificates when
``gateway.tls.ca`` is set, as the gRPC services do). It does not wait for the
orchestrator: ``/health`` says 503 until the orchestrator answers SERVING, so
the gateway can start first. ``serve_until_signal`` turns ``/health`` to 503
and new requests away (503), lets requests in flight finish for at most
``gateway.grace_period_s``, then stops listening, cancels the rest (which
cancels their gRPC calls) and closes the channel. While it drains it still
listens, and ``/health/live`` says 200: a liveness probe that failed during a
long drain would have the container killed before its streams finish.

Not for: routes (``app``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from dataclasses import dataclass

from aiohttp import web

import specdec
from specdec import metrics
from specdec.config import Config, TlsConfig
from specdec.transport import auth

from .app import GatewayState, create_app
from .upstream import Orchestrator

log = logging.getLogger(__name__)


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """HTTPS for the gateway; with ``tls.ca`` set, clients must present certificates."""
    if not tls.cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key or None)
    if tls.ca:
        context.load_verify_locations(tls.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


@dataclass
class RunningGateway:
    runner: web.AppRunner
    port: int
    state: GatewayState


async def serve(cfg: Config) -> RunningGateway:
    """Start the gateway; returns it with the port it listens on."""
    g = cfg.gateway
    state = GatewayState(
        g,
        Orchestrator(g),
        tokens=auth.expected(cfg.orchestrator.auth_tokens),
    )
    runner = web.AppRunner(
        create_app(state),
        # A client that disconnects cancels its handler, and so its gRPC call.
        handler_cancellation=True,
        access_log=None,
        # What is left once the drain (serve_until_signal) is over gets (almost) no
        # more time: aiohttp reads 0 as "no limit".
        shutdown_timeout=0.01,
    )
    await runner.setup()
    site = web.TCPSite(runner, g.host, g.port, ssl_context=server_ssl_context(g.tls))
    await site.start()
    port = runner.addresses[0][1]
    metrics.BUILD_INFO.labels("gateway").info(
        {
            "model_id": g.model_name,
            "dtype": "",
            "device": "",
            "version": specdec.__version__,
        }
    )
    return RunningGateway(runner, port, state)


async def serve_until_signal(running: RunningGateway, grace_s: float) -> None:
    """Block until SIGTERM/SIGINT, then drain (see the module docstring) and stop."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: draining %d request(s) for up to %.1fs", running.state.live, grace_s)
    state = running.state
    state.draining = True
    deadline = loop.time() + grace_s
    while state.live > 0 and loop.time() < deadline:  # (the probes' own requests are short)
        await asyncio.sleep(0.05)
    if state.live:
        log.warning("grace period over with %d request(s) in flight; stopping", state.live)
    await running.runner.cleanup()
    await running.state.upstream.aclose()
    log.info("stopped")
