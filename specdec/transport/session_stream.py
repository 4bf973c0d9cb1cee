"""A model service's session is a bidirectional stream; this drives one.

The first message must open the session; each later one is answered by
exactly one reply, in order. The session is freed when the stream ends for
any reason: the caller closes it, cancels it, its connection drops, a bad
message ends it with a status, or it stays idle for longer than the TTL.
Both model services use it with their own ``open`` and ``step`` handlers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from specdec.errors import DeadlineExceeded, require
from specdec.model_service import ModelService
from specdec.sessions import Session

OpenHandler = Callable[[Any], Awaitable[tuple[Session, Any]]]
StepHandler = Callable[[Session, str, Any], Awaitable[Any]]


async def session_stream(
    svc: ModelService,
    requests: AsyncIterator,
    ttl_s: float,
    on_open: OpenHandler,
    on_step: StepHandler,
) -> AsyncIterator[Any]:
    """Replies to the messages of one session stream (see the module docstring)."""
    messages = requests.__aiter__()
    session: Session | None = None
    try:
        while True:
            try:
                async with asyncio.timeout(ttl_s):
                    msg = await messages.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                if session is not None:
                    svc.expired(session)
                    session = None
                raise DeadlineExceeded(
                    f"session: idle for more than session_ttl_s ({ttl_s:g} s); it is freed"
                ) from None
            kind = msg.WhichOneof("kind")
            if session is None:
                require(
                    kind == "open", "open", f"the first message must open the session, got {kind}"
                )
                session, reply = await on_open(msg.open)
            else:
                require(kind != "open", "open", "the session is already open")
                reply = await on_step(session, kind, msg)
            yield reply
    finally:
        if session is not None:
            svc.close(session)
