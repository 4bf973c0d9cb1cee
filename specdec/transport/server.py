"""gRPC server plumbing shared by every service.

A server gets: the standard health service (``grpc.health.v1``), reflection,
one interceptor that maps domain exceptions to status codes and times every
RPC into the metrics, optional (mutual) TLS, and graceful shutdown on SIGTERM
(NOT_SERVING first, then in-flight work finishes within the grace period).
Not for: business logic; servicers call one domain method per RPC.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec import metrics
from specdec.config import MIN_KEEPALIVE_S, TlsConfig
from specdec.errors import InvalidArgument, SpecdecError

from . import auth
from .status import code_of

log = logging.getLogger(__name__)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps SpecdecError to its status, anything else to INTERNAL; times every RPC.

    ``service`` labels the metrics ("draft", "target", "orchestrator").
    """

    def __init__(self, service: str, auth_tokens: Iterable[str] = ()) -> None:
        self.service = service
        self._tokens = auth.expected(auth_tokens)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler_call_details.method.startswith(("/grpc.health", "/grpc.reflection")):
            return handler
        if self._tokens:
            md = dict(handler_call_details.invocation_metadata or ())
            if not auth.accepted(md.get("authorization", ""), self._tokens):
                return _abort_handler(
                    handler,
                    grpc.StatusCode.UNAUTHENTICATED,
                    "authorization: missing or invalid bearer token",
                )
        parse = _lenient(handler.request_deserializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method),
                request_deserializer=parse,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method, streaming_request=False),
                request_deserializer=parse,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_stream(handler.stream_stream, method, streaming_request=True),
                request_deserializer=parse,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _observe(self, method: str, start: float, code: grpc.StatusCode) -> None:
        metrics.RPC_DURATION.labels(self.service, method).observe(time.perf_counter() - start)
        metrics.RPC_HANDLED.labels(self.service, method, code.name).inc()

    def _status_of(self, e: Exception, method: str) -> tuple[grpc.StatusCode, str]:
        """The status an exception from a servicer maps to."""
        if isinstance(e, SpecdecError):
            return code_of(e), str(e)
        if isinstance(e, grpc.aio.AioRpcError):  # a call to another service failed
            return grpc.StatusCode.UNAVAILABLE, f"upstream: {e.code().name}: {e.details()}"
        log.exception("%s/%s failed", self.service, method)
        return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"

    def _wrap_unary(self, behavior: Callable, method: str) -> Callable:
        async def wrapper(request, context):
            start, code = time.perf_counter(), grpc.StatusCode.OK
            try:
                return await behavior(_parsed(request), context)
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except grpc.aio.AbortError:
                code = grpc.StatusCode.UNKNOWN
                raise
            except Exception as e:
                code, message = self._status_of(e, method)
                await context.abort(code, message)
            finally:
                self._observe(method, start, code)

        return wrapper

    def _wrap_stream(self, behavior: Callable, method: str, streaming_request: bool) -> Callable:
        async def wrapper(request, context):
            start, code = time.perf_counter(), grpc.StatusCode.OK
            try:
                request = _parsed_stream(request) if streaming_request else _parsed(request)
                async for item in behavior(request, context):
                    yield item
            except (asyncio.CancelledError, GeneratorExit):
                code = grpc.StatusCode.CANCELLED
                raise
            except grpc.aio.AbortError:
                code = grpc.StatusCode.UNKNOWN
                raise
            except Exception as e:
                code, message = self._status_of(e, method)
                await context.abort(code, message)
            finally:
                self._observe(method, start, code)

        return wrapper


class _Unparsable:
    """What a request that does not parse becomes, so that the RPC can answer
    INVALID_ARGUMENT. (grpcio answers a deserializer's exception itself: UNKNOWN
    for a unary request, and the error surfaces as INTERNAL from a stream.)"""

    def __init__(self, error: Exception, size: int) -> None:
        self.error = InvalidArgument(
            "request",
            f"a message of {size} bytes does not parse as the method's request type "
            f"({type(error).__name__}: {error}); send a serialized protobuf message",
        )


def _lenient(deserializer: Callable | None) -> Callable | None:
    """``deserializer``, returning an ``_Unparsable`` instead of raising."""
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:
            return _Unparsable(e, len(data))

    return parse


def _parsed(request):
    """The request, or InvalidArgument naming ``request`` if it did not parse."""
    if isinstance(request, _Unparsable):
        raise request.error
    return request


async def _parsed_stream(requests):
    """The stream of requests, ending with InvalidArgument at one that did not parse."""
    async for request in requests:
        yield _parsed(request)


def _abort_handler(handler, code: grpc.StatusCode, message: str):
    parse = _lenient(handler.request_deserializer)  # refused whether or not it parses

    async def deny_unary(request, context):
        await context.abort(code, message)

    async def deny_stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(
            deny_stream,
            request_deserializer=parse,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream,
            request_deserializer=parse,
            response_serializer=handler.response_serializer,
        )
    return grpc.unary_unary_rpc_method_handler(
        deny_unary,
        request_deserializer=parse,
        response_serializer=handler.response_serializer,
    )


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """TLS for a server; with ``tls.ca`` set, clients must present certificates."""
    if not tls.cert:
        return None
    key = Path(tls.key).read_bytes()
    cert = Path(tls.cert).read_bytes()
    ca = Path(tls.ca).read_bytes() if tls.ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


class Health(health_pb2_grpc.HealthServicer):
    """The standard health service (``grpc.health.v1``), whose Watch streams end
    when the server stops. (grpcio-health-checking's own runs until its client
    leaves, so a client holding one, as gRPC's client-side health checking does,
    made a draining service wait out its whole grace period.)"""

    # Always SERVING while the process serves, draining included: what liveness
    # probes ask (one that failed during a drain would have the container killed
    # before its work is done). Readiness asks "" (or a service's name).
    LIVENESS = "liveness"

    def __init__(self) -> None:
        self._status = {
            "": health_pb2.HealthCheckResponse.SERVING,
            self.LIVENESS: health_pb2.HealthCheckResponse.SERVING,
        }
        self._changed = asyncio.Event()  # set (and replaced) on every change
        self._stopping = False  # NOT_SERVING for good
        self._ended = False  # Watch streams end

    async def Check(self, request, context):
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        last = None
        while True:
            changed = self._changed
            status = self._status.get(request.service, unknown)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._ended:
                return
            await changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def set(self, service: str, status: int) -> None:
        if not self._stopping and service != self.LIVENESS:
            self._status[service] = status
            self._notify()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good (later ``set`` calls are ignored)."""
        self._stopping = True
        for service in self._status:
            if service != self.LIVENESS:
                self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
        self._notify()

    def end_watches(self) -> None:
        """End every Watch stream (after its last status), now and from now on."""
        self._ended = True
        self._notify()


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: Health
    service_names: tuple[str, ...]

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    host: str,
    port: int,
    service: str,
    tls: TlsConfig | None = None,
    max_message_bytes: int = 16 * 1024 * 1024,
    auth_tokens: Iterable[str] = (),
) -> RunningServer:
    """Start a grpc.aio server on host:port (0 picks a free port); returns it with its port.

    ``register`` adds the servicers. Health is SERVING once this returns,
    so call it after the model is loaded.
    """
    names = tuple(service_names)
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(service, auth_tokens)],
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Clients may keep a call's connection alive with pings (the gateway's
            # keepalive_s, at least 1 s apart) even while no data flows, as in a long
            # prefill; gRPC's default takes one in 5 minutes and then sends GOAWAY.
            # (gRPC's name for the server's setting; a misspelt one is silently ignored,
            # and with the 5-minute default, three pings made a quiet call's GOAWAY.)
            ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_KEEPALIVE_S * 1000)),
        ],
    )
    register(server)
    health = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    creds = server_credentials(tls) if tls else None
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    running = RunningServer(server, bound, health, names)
    await running.set_serving(True)
    return running


class Drainable(Protocol):
    """What a service's domain offers for graceful shutdown."""

    def begin_drain(self) -> None: ...  # refuse new work with UNAVAILABLE from now on

    def idle(self) -> bool: ...  # no in-flight work left

    def end_idle_streams(self) -> None: ...  # idle: end streams held open between requests

    async def aclose(self) -> None: ...


async def serve_until_signal(running: RunningServer, domain: Drainable, grace_s: float) -> None:
    """Block until SIGTERM/SIGINT, then shut down gracefully.

    Health turns NOT_SERVING, new work is refused (UNAVAILABLE) while in-flight
    work (live sessions, running requests) finishes, for at most grace_s; then
    the streams a peer holds open between requests end (a draft's relay, and
    health Watch streams: the server would otherwise wait for them to the end of
    grace_s), the server stops and the domain is closed.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: draining for up to %.1fs", grace_s)
    await running.health.enter_graceful_shutdown()
    domain.begin_drain()
    deadline = time.monotonic() + grace_s
    while not domain.idle() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if domain.idle():
        domain.end_idle_streams()
    else:
        log.warning("grace period over with work in flight; stopping anyway")
    running.health.end_watches()
    await running.server.stop(max(0.1, deadline - time.monotonic()))
    await domain.aclose()
    log.info("stopped")
