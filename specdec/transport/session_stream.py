"""A model service's session is a bidirectional stream; this drives one.

The first message must open the session; each later one is answered by
exactly one reply, in order (but for a relayed pipelined block that does not
follow the verify before it, which is dropped with none: ``Verify.chain``; only
a relayed verify may be chained). The session is
freed when the stream ends for any reason: the caller closes it, cancels it,
its connection drops, a bad message ends it with a status, or it stays idle
for longer than the TTL.
Both model services use it with their own ``open`` and ``step`` handlers.

With ``inboxes`` (the target), the session also takes verifies a draft service
relays on its behalf (``specdec.transport.relay``): the caller's messages and
relayed ones are served from one queue in arrival order, and the reply to
``open`` carries the session's relay token. A relayed verify that asks for an
echo hands its verdict to the relay stream it came on first.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from specdec.errors import DeadlineExceeded, require
from specdec.model_service import ModelService
from specdec.sessions import Session

from .relay import Inbox, Relayed, RelayInboxes

OpenHandler = Callable[[Any], Awaitable[tuple[Session, Any]]]
StepHandler = Callable[[Session, str, Any], Awaitable[Any]]
IdleHandler = Callable[[Session], Awaitable[bool]]  # True: it did some work


async def session_stream(
    svc: ModelService,
    requests: AsyncIterator,
    ttl_s: float,
    on_open: OpenHandler,
    on_step: StepHandler,
    inboxes: RelayInboxes | None = None,
    on_idle: IdleHandler | None = None,
) -> AsyncIterator[Any]:
    """Replies to the messages of one session stream (see the module docstring)."""
    messages = requests.__aiter__()
    session: Session | None = None
    inbox: Inbox | None = None
    reader: asyncio.Task | None = None
    try:
        while True:
            echo, relayed = None, False
            idle = on_idle is not None and inbox is not None and inbox.queue.empty()
            if idle and session is not None and await on_idle(session):
                continue  # (and look at the queue again)
            try:
                async with asyncio.timeout(ttl_s):
                    if inbox is None:
                        msg = await messages.__anext__()
                    else:
                        msg = await inbox.queue.get()
                        if isinstance(msg, BaseException):
                            raise msg
                        if isinstance(msg, Relayed):
                            msg, echo, relayed = msg.request, msg.echo, True
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
            key = msg.verify.pipeline if kind == "verify" and relayed else 0
            if inbox is not None and not relayed and kind == "verify":
                # A chained block that does not follow is dropped without a reply: only
                # a relayed one may be (nobody waits on the relay stream for its reply).
                require(
                    not msg.verify.HasField("chain"),
                    "verify.chain",
                    "only a relayed verify (a pipeline's block) may be chained",
                )
            if key and key in inbox.cancelled:
                continue  # a pipeline's block queued before its caller stopped it
            if session is None:
                require(
                    kind == "open", "open", f"the first message must open the session, got {kind}"
                )
                session, reply = await on_open(msg.open)
                if inboxes is not None:
                    inbox = inboxes.open()
                    reply.opened.relay_token = inbox.token
                    reader = asyncio.get_running_loop().create_task(_read_into(messages, inbox))
            else:
                require(kind != "open", "open", "the session is already open")
                reply = await on_step(session, kind, msg)
                if reply is None:  # a pipelined block that does not follow: dropped
                    continue
                if echo is not None and reply.WhichOneof("kind") == "verdict":
                    # The draft's head start: its copy goes first (a turn of the loop
                    # lets the relay stream write it before this reply).
                    echo(reply.verdict)
                    await asyncio.sleep(0)
            yield reply
    finally:
        if reader is not None:
            reader.cancel()
        if inbox is not None:
            inboxes.close(inbox)
        if session is not None:
            svc.close(session)


async def _read_into(messages: AsyncIterator, inbox: Inbox) -> None:
    """Queue the caller's messages on the session's inbox; then StopAsyncIteration,
    or the error that ended the stream. A verify's ``cancel_relays`` take effect on
    arrival, so that a relay arriving after it is refused."""
    try:
        async for msg in messages:
            if msg.WhichOneof("kind") == "verify" and msg.verify.cancel_relays:
                inbox.cancel(msg.verify.cancel_relays)
            inbox.queue.put_nowait(msg)
        inbox.queue.put_nowait(StopAsyncIteration())
    except Exception as e:
        inbox.queue.put_nowait(e)
