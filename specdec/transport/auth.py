"""Bearer tokens: one reading of the ``Authorization`` header, for the services'
interceptor and the HTTP gateway.

The scheme is matched without regard to case (RFC 9110, section 11.1:
``bearer tok`` is ``Bearer tok``); the token exactly. Every accepted token is
compared in constant time, with no early exit.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable


def expected(tokens: Iterable[str]) -> list[bytes]:
    """The credentials to accept, as ``accepted`` compares them."""
    return [f"Bearer {t}".encode() for t in tokens]


def normalized(header: str) -> str:
    """``header`` with a bearer scheme spelled ``Bearer``; anything else unchanged.
    (An HTTP header, or gRPC metadata under a key without ``-bin``: a string.)"""
    scheme, sep, token = header.partition(" ")
    return "Bearer " + token if sep and scheme.lower() == "bearer" else header


def accepted(header: str, tokens: list[bytes]) -> bool:
    """Whether ``header`` carries one of ``tokens`` (from ``expected``)."""
    given = normalized(header).encode("utf-8", "replace")
    return sum(hmac.compare_digest(given, t) for t in tokens) > 0
