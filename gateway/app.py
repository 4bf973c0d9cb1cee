"""The gateway's HTTP routes (aiohttp), thin: body in, one orchestrator call, OpenAI's shape out.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health`` (readiness:
200 while the orchestrator answers SERVING and the gateway is not draining,
else 503) and ``GET /health/live`` (liveness: 200 while the process serves HTTP, draining
included).

Four middlewares, outermost first: ``observe`` (the gateway's metrics),
``openai_errors`` (every error as OpenAI's error JSON: ``ApiError``, aiohttp's
own 404/405/413, and anything unexpected as a logged 500), ``cors`` (answers
browsers' preflight requests from ``gateway.cors_allow_origins``; every
response to such an origin carries ``Access-Control-Allow-Origin``) and
``bearer`` (``orchestrator.auth_tokens`` on ``/v1/``, compared in constant
time, never logged; the header is forwarded to the orchestrator, which checks
it again).

Not for: validating or shaping OpenAI objects (``openai_schema``), talking
gRPC (``upstream``), mapping statuses (``errors``), process lifecycle
(``service``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from specdec import metrics
from specdec.config import GatewayConfig
from specdec.transport import auth

from . import errors
from .errors import ApiError
from .openai_schema import (
    CHAT_TEMPLATE_HEADER,
    DONE,
    ChatShape,
    CompletionShape,
    error_event,
    model_not_found,
    model_object,
    models_body,
    parse_json,
)
from .upstream import EmptyStream, Orchestrator, Stream

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Shape = CompletionShape | ChatShape
# Recorded for a client that went away before the response was complete (nginx's code).
CLIENT_CLOSED = 499


@dataclass
class GatewayState:
    """What the routes share: config, the orchestrator client, tokens, drain state."""

    cfg: GatewayConfig
    upstream: Orchestrator
    # "Bearer <token>" for each accepted token; empty: no authentication.
    tokens: list[bytes] = field(default_factory=list)
    started: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    live: int = 0


STATE = web.AppKey("state", GatewayState)


def _state(request: web.Request) -> GatewayState:
    return request.app[STATE]


def _authorization(request: web.Request) -> str | None:
    """The Authorization header to forward, if it is one gRPC metadata can carry."""
    header = request.headers.get("Authorization", "")
    return auth.normalized(header) if header and header.isascii() and header.isprintable() else None


# ---- routes ----------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CompletionShape)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ChatShape)


async def _generate(request: web.Request, shape_cls: type[Shape]) -> web.StreamResponse:
    state = _state(request)
    if state.draining:
        raise ApiError(503, "the gateway is shutting down; retry", code="unavailable")
    authorization = _authorization(request)
    body = parse_json(await request.read())
    names = shape_cls.field_names
    try:
        model = await state.upstream.model_name(authorization)
        generation = shape_cls.parse(body, model, state.cfg)
        names = generation.field_names or names
        stream = await state.upstream.open(generation.request, authorization)
    except grpc.aio.AioRpcError as e:
        raise errors.from_rpc_error(e, names) from None
    except EmptyStream as e:
        raise ApiError(500, str(e), code="internal") from None
    shape = shape_cls(generation.model, generation.include_usage)
    shape.field_names = names
    template = generation.chat_template
    headers = {CHAT_TEMPLATE_HEADER: template} if template else {}
    try:
        if generation.stream:
            return await _stream_events(request, shape, stream, headers)
        return await _collect(shape, stream, headers)
    finally:
        stream.call.cancel()  # a no-op once finished; frees the sessions of a client gone


async def _collect(shape: Shape, stream: Stream, headers: dict) -> web.Response:
    text, stats = [], None
    try:
        async for message in stream.messages():
            if message.HasField("chunk"):
                text.append(message.chunk.text)
            else:
                stats = message.stats
    except grpc.aio.AioRpcError as e:
        raise errors.from_rpc_error(e, shape.field_names) from None
    except EmptyStream as e:
        raise ApiError(500, str(e), code="internal") from None
    return web.json_response(shape.body("".join(text), stats), headers=headers)


async def _stream_events(
    request: web.Request, shape: Shape, stream: Stream, headers: dict
) -> web.StreamResponse:
    """Server-sent events: ``data: <chunk>`` each, ``data: [DONE]`` last.

    An error after the first byte (the status is already 200) is sent as an
    event holding OpenAI's error object, then ``[DONE]``.
    """
    response = web.StreamResponse(
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers}
    )
    response.content_type = "text/event-stream"
    await response.prepare(request)
    for event in shape.start_events():
        await response.write(event)
    first = True
    try:
        async for message in stream.messages():
            if message.HasField("stats"):
                for event in shape.final_events(message.stats):
                    await response.write(event)
            elif message.chunk.text:  # text held back (a possible stop string) comes later
                await response.write(shape.text_event(message.chunk.text))
                if first:
                    first = False
                    metrics.GATEWAY_TIME_TO_FIRST_BYTE.labels(shape.endpoint).observe(
                        time.perf_counter() - request["start"]
                    )
    except grpc.aio.AioRpcError as e:
        await response.write(error_event(errors.from_rpc_error(e, shape.field_names)))
    except EmptyStream as e:
        await response.write(error_event(ApiError(500, str(e), code="internal")))
    await response.write(DONE)
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    state = _state(request)
    authorization = _authorization(request)
    try:
        info = await state.upstream.info(authorization)
        name = await state.upstream.model_name(authorization)
    except grpc.aio.AioRpcError as e:
        raise errors.from_rpc_error(e) from None
    return web.json_response(models_body(name, state.started, info))


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: the served model, or 404 ``model_not_found``."""
    state = _state(request)
    authorization = _authorization(request)
    try:
        name = await state.upstream.model_name(authorization)
        if request.match_info["model"] != name:
            raise model_not_found(request.match_info["model"], name)
        info = await state.upstream.info(authorization)
    except grpc.aio.AioRpcError as e:
        raise errors.from_rpc_error(e) from None
    return web.json_response(model_object(name, state.started, info))


async def health(request: web.Request) -> web.Response:
    state = _state(request)
    ok = not state.draining and await state.upstream.serving()
    return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)


async def live(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


# ---- middlewares ------------------------------------------------------------------------
def _endpoint(request: web.Request) -> str:
    """A bounded label: the route's path, or "other"."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "other"


@web.middleware
async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
    request["start"] = start = time.perf_counter()
    state = _state(request)
    state.live += 1
    metrics.GATEWAY_LIVE_REQUESTS.inc()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        status = CLIENT_CLOSED
        raise
    finally:
        state.live -= 1
        metrics.GATEWAY_LIVE_REQUESTS.dec()
        endpoint = _endpoint(request)
        metrics.GATEWAY_REQUESTS.labels(endpoint, str(status)).inc()
        metrics.GATEWAY_REQUEST_DURATION.labels(endpoint).observe(time.perf_counter() - start)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:  # aiohttp's own: unknown path, method, body too large
        if e.status < 400:
            raise
        message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        code = e.reason.lower().replace(" ", "_")
        body = ApiError(e.status, message, code=code).body()
        kept = {k: v for k, v in e.headers.items() if k == "Allow"}  # a 405's methods
        return web.json_response(body, status=e.status, headers=kept)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        error = ApiError(500, f"internal error: {type(e).__name__}", code="internal")
        return web.json_response(error.body(), status=500)


CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"


def _cors_origin(request: web.Request) -> str | None:
    """The request's Origin if ``gateway.cors_allow_origins`` lets it in ("*": any)."""
    origin = request.headers.get("Origin")
    allowed = _state(request).cfg.cors_allow_origins
    if origin and allowed and ("*" in allowed or origin in allowed):
        return origin
    return None


@web.middleware
async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A browser's preflight (OPTIONS with Access-Control-Request-Method) from an
    allowed origin is answered here, before the bearer check: it never carries the
    token. Other requests go on; ``_cors_headers`` marks their responses."""
    origin = _cors_origin(request)
    if (
        origin is not None
        and request.method == "OPTIONS"
        and "Access-Control-Request-Method" in request.headers
    ):
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Origin": origin,
                "Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": request.headers.get(
                    "Access-Control-Request-Headers", CORS_HEADERS
                ),
                "Access-Control-Max-Age": "600",
                "Vary": "Origin",
            },
        )
    return await handler(request)


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """On every response (streams and errors included) to an allowed origin."""
    origin = _cors_origin(request)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"


@web.middleware
async def bearer(request: web.Request, handler: Handler) -> web.StreamResponse:
    tokens = _state(request).tokens
    if tokens and request.path.startswith("/v1/"):
        if not auth.accepted(request.headers.get("Authorization", ""), tokens):
            raise ApiError(
                401,
                "missing or invalid bearer token: send `Authorization: Bearer <token>`",
                code="invalid_api_key",
            )
    return await handler(request)


def create_app(state: GatewayState) -> web.Application:
    app = web.Application(
        middlewares=[observe, openai_errors, cors, bearer],
        client_max_size=state.cfg.max_body_bytes,
    )
    app[STATE] = state
    app.on_response_prepare.append(_cors_headers)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", live)
    return app
