"""Domain exceptions, each with the one gRPC status it maps to.

Domain code raises these; ``specdec.server.ErrorInterceptor`` turns them into
a status and a message. Nothing else in the project picks status codes.
"""

from __future__ import annotations

import grpc


class SpecdecError(Exception):
    """Base class: a failure with a precise gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(SpecdecError):
    """A request field is invalid. The message starts with the field's name."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SpecdecError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SpecdecError):
    """E.g. a request expects a cache length the session does not have."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(SpecdecError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(SpecdecError):
    code = grpc.StatusCode.UNAUTHENTICATED


def require(cond: bool, field: str, message: str) -> None:
    """Raise InvalidArgument(field, message) unless cond holds."""
    if not cond:
        raise InvalidArgument(field, message)
