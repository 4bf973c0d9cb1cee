"""The gateway's one error mapping: gRPC status to HTTP status, and OpenAI's error JSON.

Every error a gateway client sees is an ``ApiError`` rendered as OpenAI renders
errors: ``{"error": {"message", "type", "param", "code"}}``. Errors the gateway
finds itself (bad JSON, a bad field, an unknown model or token) carry their own
``code``; errors from the orchestrator keep their gRPC status as ``code``
(``invalid_argument``, ``resource_exhausted``, ...) and their message, and the
field an INVALID_ARGUMENT message starts with is named in ``param`` under its
OpenAI name (``max_new_tokens: must be in [1, 1024], got 0`` becomes
``max_tokens: ...`` with ``param`` ``max_tokens``), as are the request's other
fields the message names. A request too long for the model (its message says
``maximum context length``, ``specdec.errors.CONTEXT_LENGTH``) gets OpenAI's
code for it, ``context_length_exceeded``, which clients and proxies (LiteLLM's
context-window fallbacks, say) look for.

Not for: validating requests (``openai_schema``) or routing (``app``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import grpc

from specdec.errors import CONTEXT_LENGTH

# The HTTP status of each gRPC status an orchestrator call can end with; any
# other (INTERNAL, UNKNOWN, ...) is a 500. Bad input never gets here as a 500:
# the gateway validates JSON, types and ranges before calling.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

# OpenAI's error ``type`` by HTTP status (client errors not listed are
# invalid_request_error, server errors server_error).
_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
}

# "field: message" or "field[0].sub: message" at the start of a status message.
_LEADING_FIELD = re.compile(r"^([A-Za-z_][\w]*)((?:\[\d+\])?(?:\.\w+)?): ")


class ApiError(Exception):
    """An error response: HTTP status and the four fields of OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002 - OpenAI's name for it
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 for a request field; the message starts with the field, as the gRPC API's do."""
    text = f"{param}: {message}" if param else message
    return ApiError(400, text, param=param, code=code)


def unsupported(param: str, why: str) -> ApiError:
    return invalid(param, f"not supported by specdec ({why})", code="unsupported_parameter")


def from_rpc(
    code: grpc.StatusCode, details: str | None, field_names: Mapping[str, str] | None = None
) -> ApiError:
    """The ApiError for an orchestrator call that ended with ``code``.

    ``field_names`` renames the gRPC request's fields to the endpoint's OpenAI
    fields (``max_new_tokens`` -> ``max_tokens``), in ``param`` and in the message.
    """
    status = HTTP_STATUS.get(code, 500)
    message = details or code.name
    param = None
    code_name = code.name.lower()
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        names = field_names or {}
        m = _LEADING_FIELD.match(message)
        rest = message[m.end() :] if m else message
        for ours, theirs in names.items():  # the other fields it names (identifiers only)
            if "_" in ours and ours != theirs:
                rest = re.sub(rf"\b{ours}\b", theirs, rest)
        if m:
            param = names.get(m.group(1), m.group(1)) + m.group(2)
            message = f"{param}: {rest}"
        else:
            message = rest
        if code == grpc.StatusCode.INVALID_ARGUMENT and CONTEXT_LENGTH in message:
            code_name = "context_length_exceeded"
    return ApiError(status, message, param=param, code=code_name)


def from_rpc_error(
    error: grpc.aio.AioRpcError, field_names: Mapping[str, str] | None = None
) -> ApiError:
    return from_rpc(error.code(), error.details(), field_names)
