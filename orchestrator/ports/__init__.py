"""How the engine reaches the draft and the target: two small ports.

A port opens sessions; a session answers the calls of one request. The
engine and the step see only these protocols and domain values (cursors,
proposals, verdicts, ``specdec.errors``), never a transport:

* ``orchestrator.ports.local``: the services' domain objects in this process
  (unit tests in milliseconds; the benchmarks' "no network" reference);
* ``orchestrator.ports.remote``: gRPC session streams to the services.

Resilience (breakers, re-prefill, failover, fallback) wraps sessions in
``orchestrator.resilience``; it is not part of a port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specdec.runtime.loading import ModelInfo
from specdec.sampling import Proposal, SamplingParams, Verdict
from specdec.wire import WireShape

from ..step import Cursor


class WireCounter(Protocol):
    """Where sessions report the bytes and round trips of their calls."""

    def count(self, peer: str, sent: int, received: int) -> None: ...


@dataclass(frozen=True)
class DraftOn:
    """The draft drafts the next step as soon as the target echoes this one's verdict:
    this step's uniforms (it settles the step as ``settle`` will here), and the next
    step's gamma and draft seed as this engine expects to ask for them. ``ahead``:
    this step drafts ahead too, so the draft drafts on only when the verdict rejects
    a draft (the block drafted ahead is then unused)."""

    uniforms: tuple[float, ...]  # [gamma] this step's
    gamma: int
    seed: int
    ahead: bool = False


@dataclass(frozen=True)
class PipelineSpec:
    """The draft paces the steps after this one itself (pipelined speculation,
    ``Pipeline`` in protos/specdec/v1/draft.proto): every step's draws come from
    ``key`` (``step.pipeline_draws``), or paced, from the request's own ``stream``;
    ``tokens``: still wanted before this step; ``depth``: blocks drafted ahead of
    the one being verified, at most (0: paced, ``orchestrator.paced``)."""

    key: int
    tokens: int
    depth: int
    # Paced (depth 0): the request's stream, its seed and the words drawn before this
    # step's draws (``Philox.tell``), from which every step's draws come.
    stream: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class RelayTo:
    """Where a draft sends its proposal straight on (relay), and the rest of the
    verify: the target session's replica and token, its cursor, the verify's seed."""

    target: str  # the target replica's address
    token: bytes  # the target session's relay token
    cursor: Cursor  # the target's cursor
    seed: int
    pit: bool = False
    draft_on: DraftOn | None = None
    pipeline: PipelineSpec | None = None
    draft_idle: bool = False  # (``Verify.draft_idle``)


class DraftSession(Protocol):
    """One request's session on a draft service."""

    async def propose(
        self,
        cursor: Cursor,
        gamma: int,
        seed: int,
        timeout: float | None,
        relay: RelayTo | None = None,
        ahead: bool = False,
        guess: bool = False,
    ) -> Proposal:
        """A draft from ``cursor``; with ``relay``, also sent on to the target (the
        proposal says whether the target took it: ``Proposal.relayed``). ``ahead``: a
        block drafted ahead, which has no tokens if an echoed verdict already made it
        unused (``DraftOn.ahead``). ``guess``: the step drafts ahead, so a sampled
        proposal carries the draft's guesses of the residual draws, if it makes them
        (``Proposal.alternates``, for the verify)."""
        ...

    async def rollback(self, cache_len: int, timeout: float | None) -> int: ...

    async def retune(self, gamma: int, timeout: float | None) -> int:
        """The paced pipeline running on the session drafts ``gamma`` tokens a block
        from its next undecided block on; returns that block's index (0: none runs,
        nothing changed). The pipeline goes on."""
        ...

    def ended(self) -> asyncio.Future | None:
        """Done once the session has ended on its own (the service died, or dropped
        it): a pipeline it paces sends nothing more. None where a session cannot end
        so (in one process)."""
        ...

    async def close(self) -> None: ...


class TargetSession(Protocol):
    """One request's session on a target service."""

    async def verify(
        self,
        cursor: Cursor,
        proposal: Proposal | None,
        seed: int,
        dense_p: bool,
        timeout: float | None,
        pit: bool = False,
        run: int = 1,
        follow: tuple[int, ...] = (),
        draft_idle: bool = False,
    ) -> Verdict:
        """The verdict on ``proposal`` (for a relayed one: the verdict the relay
        produces, with nothing sent from here). ``follow``: the next verdict of a
        pipeline, with one of these seeds, nothing sent (``proposal`` is None;
        ``Verdict.drafts`` says what it judged). ``draft_idle``: no draft works
        meanwhile (``Verify.draft_idle``)."""
        ...

    @property
    def relay_token(self) -> bytes:
        """What names this session to a relaying draft (empty: no relays)."""
        ...

    @property
    def next_logits(self) -> bool:
        """The open kept p for the position after its tokens: the first verify may
        feed no pending token."""
        ...

    def cancel_relay(self, seed: int) -> None:
        """A relayed verify with this seed was not confirmed: the target must never
        run it, and its verdict, if one comes, is not this session's answer."""
        ...

    async def rollback(self, cache_len: int, timeout: float | None) -> int: ...

    async def close(self) -> None: ...


class DraftPort(Protocol):
    """A draft service (one replica)."""

    async def info(self, timeout: float | None) -> ModelInfo: ...

    async def open(
        self,
        session_id: str,
        tokens: Sequence[int],
        params: SamplingParams,
        shape: WireShape,
        timeout: float | None,
        counter: WireCounter | None = None,
    ) -> DraftSession: ...

    async def aclose(self) -> None: ...


class TargetPort(Protocol):
    """A target service (one replica)."""

    async def info(self, timeout: float | None) -> ModelInfo: ...

    async def open(
        self,
        session_id: str,
        tokens: Sequence[int],
        params: SamplingParams,
        timeout: float | None,
        counter: WireCounter | None = None,
    ) -> TargetSession: ...

    async def aclose(self) -> None: ...
