"""Domain errors: what went wrong, in the domain's words.

Domain code (models, sessions, sampling, the orchestrator's engine) raises
these and knows nothing of transports. The one mapping to gRPC status codes
lives at the edge, in ``specdec.transport.status``; an HTTP edge would map
the same classes to its own codes.
"""

from __future__ import annotations

# In the message of every INVALID_ARGUMENT about a request too long for the model:
# what OpenAI's API says there, and what clients of it look for (the HTTP gateway
# gives such errors OpenAI's code ``context_length_exceeded``).
CONTEXT_LENGTH = "maximum context length"


class SpecdecError(Exception):
    """Base class of every domain error."""


class InvalidArgument(SpecdecError):
    """A request field is invalid. The message starts with the field's name
    and states the allowed range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(SpecdecError):
    """An unknown session or resource."""


class AlreadyExists(SpecdecError):
    """A session id that is already live."""


class FailedPrecondition(SpecdecError):
    """The request does not fit the current state, e.g. a cache length the
    session does not have."""


class ResourceExhausted(SpecdecError):
    """An admission limit is reached (sessions, concurrent requests)."""


class Unavailable(SpecdecError):
    """A dependency is down or the service is shutting down."""


class Unauthenticated(SpecdecError):
    """Missing or invalid credentials."""


class DeadlineExceeded(SpecdecError):
    """A deadline passed: the request's, or a session's idle time."""


class Internal(SpecdecError):
    """A service failed on this request (a bug, not an outage): the request fails,
    the replica is not taken out of rotation."""


class NonFiniteLogits(Internal):
    """A model's logits hold NaN (or +inf where probabilities are formed from them):
    an overflow, most often in float16. Nothing can be drawn from them; the step
    fails instead of emitting a token that means nothing."""


class SessionLost(SpecdecError):
    """A model service no longer holds a session as the caller knows it (it
    restarted, or the cache length disagrees): re-open it from the history."""


class Unsupported(SpecdecError):
    """A model or feature this build cannot serve (refused at start-up)."""


def require(cond: bool, field: str, message: str) -> None:
    """Raise InvalidArgument(field, message) unless cond holds."""
    if not cond:
        raise InvalidArgument(field, message)
