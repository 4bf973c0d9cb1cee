"""Relay: the draft service passes a proposal straight to the target.

In a sequential step the proposal used to travel draft -> orchestrator ->
target: two messages, and the orchestrator woken in between. With a relay the
orchestrator's Propose names the target session (its replica address and
relay token) and carries the rest of the Verify; the draft sends the verify
to the target's ``Relay`` stream, and the verdict comes back to the
orchestrator on its own target session stream. The orchestrator still decides
acceptance with its own uniforms; only the route changes.

Two pieces, one per side:

* ``RelayInboxes`` (target): each open session's inbox, found by its relay
  token. The session's stream serves its caller's messages and relayed
  verifies from one queue, in arrival order.
* ``RelayClient`` (draft): one ``Relay`` stream per target address, shared by
  every session. A relay is one message: the draft writes it and answers the
  orchestrator at once; the target answers only refusals. A relay the draft
  cannot write comes back with q as usual and the orchestrator verifies itself;
  one written and then lost (refused, or the target died) is bounded by the
  orchestrator's ``relay_timeout_s``, after which the step decodes plain.

A relay may ask for its verdict back (``echo``): the target hands it to the
relay stream it came on before the session's reply goes out, and the draft
settles the step with it and drafts on (``DraftOn`` in draft.proto). An echo
is only ever a head start: the orchestrator's next propose decides.

Exactness never depends on the route. A relayed verify is the verify the
orchestrator would have sent; the one hazard is a relay that arrives after the
orchestrator gave up on it and moved on. The orchestrator names such relays by
their seed in its next verify (``cancel_relays``), the inbox refuses them if
they arrive later, and a verdict that did go out for one is skipped by its
seed (``Verdict.seed``) on the orchestrator's side.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from specdec import metrics
from specdec.config import TlsConfig
from specdec.v1 import target_pb2, target_pb2_grpc

from .channels import open_channel

log = logging.getLogger(__name__)

_CANCELLED_KEPT = 8  # per session: seeds of relays its caller gave up on
_ECHOES_KEPT = 1024  # per target link: relays whose verdict is still to come


Echo = Callable[[Any], None]  # a relayed verify's verdict, back to the draft that sent it


@dataclass(frozen=True)
class Relayed:
    """A relayed request, and who else gets its verdict (``echo``: its sender, if it
    asked)."""

    request: Any
    echo: Echo | None = None


class Inbox:
    """One target session's queue: its caller's messages and relayed verifies."""

    def __init__(self) -> None:
        self.token = secrets.token_bytes(16)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled: collections.deque[int] = collections.deque(maxlen=_CANCELLED_KEPT)

    def cancel(self, seeds) -> None:
        """The caller gave up on relayed verifies with these seeds."""
        self.cancelled.extend(seeds)


class RelayInboxes:
    """The target's open sessions that accept relayed verifies, by relay token."""

    def __init__(self) -> None:
        self._by_token: dict[bytes, Inbox] = {}

    def __len__(self) -> int:
        return len(self._by_token)

    def open(self) -> Inbox:
        inbox = Inbox()
        self._by_token[inbox.token] = inbox
        return inbox

    def close(self, inbox: Inbox) -> None:
        self._by_token.pop(inbox.token, None)

    def deliver(self, token: bytes, request: Any, ids, echo: Echo | None = None) -> str:
        """Queue a relayed request on its session; '' if queued, else why not.
        ``ids``: its seed and its pipeline's key (0: none), either of which the
        caller may have cancelled. ``echo``: also hand the reply's verdict to it
        (before the reply goes out)."""
        inbox = self._by_token.get(token)
        if inbox is None:
            return "no session with this relay token here"
        if any(i and i in inbox.cancelled for i in ids):
            return "the session's caller cancelled this relay"
        inbox.queue.put_nowait(Relayed(request, echo))
        return ""


_RETRY_S = (1.0, 30.0)  # a target relays failed to: none to it for 1 s, doubling to 30


class RelayClient:
    """The draft's side: relayed verifies to target replicas, one stream each.

    A relay costs one message: the draft writes it and answers its caller at once
    (``sent``); the target answers only a refusal. A target the draft cannot write
    to in time, whose stream broke, or that refused a relay for want of the
    session (the address reached another replica) gets no relays for a while, so
    a relay that cannot work costs its caller one bounded wait per back-off
    (``orchestrator.relay_timeout_s``), not one per step."""

    def __init__(
        self,
        tls: TlsConfig,
        max_message_bytes: int,
        write_timeout_s: float,
        keepalive_s: float | None = None,
    ) -> None:
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        self.write_timeout_s = write_timeout_s
        self.keepalive_s = keepalive_s  # a stream whose target went silent breaks in 2x
        self._links: dict[str, _Link] = {}
        self._resting: dict[str, tuple[float, float]] = {}  # address -> (until, back-off)

    def rest(self, address: str, why: str) -> None:
        """No relays to ``address`` for a while (doubling while it keeps failing).

        Already resting: the other sends that were in flight when its stream broke
        fail too, and they are the same failure, not more (each doubled the
        back-off: four in flight made one broken stream rest it 8 s, not 1)."""
        loop = asyncio.get_running_loop()
        until, backoff = self._resting.get(address, (0.0, 0.0))
        if loop.time() < until:
            return
        backoff = min(max(backoff * 2, _RETRY_S[0]), _RETRY_S[1])
        self._resting[address] = (loop.time() + backoff, backoff)
        log.warning("relay to %s: %s; none for %.0f s", address, why, backoff)

    async def send(
        self,
        address: str,
        request: target_pb2.RelayedVerify,
        on_verdict: Callable[[target_pb2.Verdict], None] | None = None,
        late: bool = False,
    ) -> tuple[bool, int]:
        """Relay ``request`` (a verify and its session's relay token) to ``address``:
        (sent, bytes). ``on_verdict``: the target echoes the verdict, and this gets it
        (called on the event loop; never if the relay is refused or lost). ``late``:
        nobody waits for it (a pipeline's block), so a refusal for want of the session
        means the request ended, not another replica: no rest for the address."""
        loop = asyncio.get_running_loop()
        until, _ = self._resting.get(address, (0.0, 0.0))
        if loop.time() < until:
            return False, 0
        link = self._links.get(address)
        if link is None or link.broken:
            if link is not None:
                await link.aclose()
            channel = open_channel(address, self.tls, self.max_message_bytes, self.keepalive_s)
            link = self._links[address] = _Link(channel, lambda why: self.rest(address, why))
        if not await link.send(request, self.write_timeout_s, on_verdict, late):
            self.rest(address, "could not send")
            return False, 0
        return True, request.ByteSize()

    async def aclose(self) -> None:
        for link in self._links.values():
            await link.aclose()
        self._links.clear()


class _Link:
    """One Relay stream: writes serialized; refusals read in the background."""

    def __init__(self, channel: grpc.aio.Channel, on_trouble) -> None:
        self.channel = channel
        self.on_trouble = on_trouble  # why -> None: the address should rest
        self.call = target_pb2_grpc.TargetServiceStub(channel).Relay()
        self.tags = itertools.count(1)
        self.write_lock = asyncio.Lock()
        self.broken = False
        self.echoes: dict[int, Callable] = {}  # tag -> who gets its verdict (oldest first)
        self.late: collections.deque[int] = collections.deque(maxlen=_ECHOES_KEPT)  # tags
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            while (ack := await self.call.read()) is not grpc.aio.EOF:
                on_verdict = self.echoes.pop(ack.tag, None)
                if ack.accepted:
                    if on_verdict is not None:
                        try:
                            on_verdict(ack.verdict)
                        except Exception:  # a head start lost; the relays go on
                            log.exception("relay: acting on an echoed verdict failed")
                    continue
                metrics.RELAY_REFUSALS.inc()
                late = ack.tag in self.late  # (a pipeline's block after its request ended)
                if ack.reason.startswith("no session") and not late:  # another replica here
                    self.on_trouble(f"refused ({ack.reason})")
                else:
                    log.debug("relay refused: %s", ack.reason)
        except grpc.aio.AioRpcError as e:
            self.on_trouble(f"stream ended ({e.code().name})")
        except asyncio.CancelledError:
            pass
        finally:
            self.broken = True

    async def send(
        self, request: target_pb2.RelayedVerify, timeout: float, on_verdict, late: bool = False
    ) -> bool:
        request.tag = next(self.tags)
        if late:
            self.late.append(request.tag)
        if on_verdict is not None:
            request.echo = True
            self.echoes[request.tag] = on_verdict
            if len(self.echoes) > _ECHOES_KEPT:  # verdicts that never came (lost relays)
                del self.echoes[next(iter(self.echoes))]
        # The write is a task of its own: grpc.aio cancels the whole call when a write
        # is cancelled, and this stream is every session's. A sender cancelled mid-write
        # (its propose's caller gone, its pipeline stopped) leaves the write to finish;
        # only a write stuck past ``timeout`` gives the stream up.
        write = asyncio.ensure_future(self._write(request))
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(write)
        except TimeoutError:
            write.cancel()
            self.broken = True
        except asyncio.CancelledError:
            # Nobody waits for it now: a refusal for want of its session means its
            # request ended, not that the address reached another replica (no rest).
            self.late.append(request.tag)
            raise
        if self.broken:
            self.echoes.pop(request.tag, None)
            return False
        return True

    async def _write(self, request: target_pb2.RelayedVerify) -> None:
        try:
            async with self.write_lock:
                await self.call.write(request)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            # (InvalidStateError: the stream ended, its target gone, before the reader
            # marked the link broken)
            self.broken = True

    async def aclose(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        await self.channel.close()
