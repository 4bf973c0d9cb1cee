"""The one mapping from domain errors to gRPC status codes.

Domain code raises ``specdec.errors`` classes; the interceptor of every
server (``specdec.transport.server``) calls ``status_of`` and nothing else
picks a status code.
"""

from __future__ import annotations

import grpc

from specdec import errors

STATUS = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Unsupported: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SessionLost: grpc.StatusCode.UNAVAILABLE,
    errors.Internal: grpc.StatusCode.INTERNAL,
}
# What a failed call to a model service means to its caller.
_FROM_CODE = {
    grpc.StatusCode.NOT_FOUND: errors.SessionLost,
    grpc.StatusCode.FAILED_PRECONDITION: errors.SessionLost,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unavailable,
    grpc.StatusCode.INTERNAL: errors.Internal,
    grpc.StatusCode.UNKNOWN: errors.Internal,
}


def code_of(e: errors.SpecdecError) -> grpc.StatusCode:
    """The status a domain error maps to (INTERNAL for one without a mapping)."""
    for cls in type(e).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INTERNAL


# Statuses that gRPC's core library makes up itself, never the services (whose
# details never take these forms), by code: how their details start, and what
# they mean to the caller.
_MADE_UP_BY_GRPC = {
    # A connection that died mid-stream (a peer killed with SIGKILL, a reset): a
    # lost peer, not a bug in it.
    grpc.StatusCode.INTERNAL: (
        ("Internal error from Core", "Received RST_STREAM"),
        errors.Unavailable,
    ),
    # A message over the size limit: this call's own failure, not a full service
    # (nothing to wait for or move off).
    grpc.StatusCode.RESOURCE_EXHAUSTED: (
        ("Received message larger than max", "Sent message larger than max"),
        errors.Internal,
    ),
}


def error_of(e: grpc.aio.AioRpcError, peer: str) -> errors.SpecdecError:
    """A failed call to ``peer`` ("draft", "target") as a domain error."""
    cls = _FROM_CODE.get(e.code(), errors.Unavailable)
    made_up = _MADE_UP_BY_GRPC.get(e.code())
    if made_up is not None and (e.details() or "").startswith(made_up[0]):
        cls = made_up[1]
    message = f"{peer}: {e.code().name}: {e.details()}"
    if cls is errors.InvalidArgument:
        return errors.InvalidArgument(peer, f"{e.code().name}: {e.details()}")
    err = cls(message)
    err.code_name = e.code().name  # for metric labels
    return err
