"""Ports to draft and target services living in this process (no network).

They call the services' domain objects (``Drafter``, ``Verifier``) directly,
with the same validation and the same forward loop as behind gRPC. The
engine's unit tests run on them in milliseconds, the benchmarks use them as
the "no network" reference, and an orchestrator with ``local_models`` serves
the public API on them (both models in its process).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from draft_service.drafter import Drafter
from specdec.errors import DeadlineExceeded, FailedPrecondition
from specdec.runtime.loading import ModelInfo
from specdec.sampling import Proposal, SamplingParams, Verdict
from specdec.sessions import Session
from specdec.wire import WireShape, unpack_q
from target_service.verifier import Verifier

from ..step import Cursor
from . import RelayTo


@contextlib.asynccontextmanager
async def _deadline(peer: str, timeout: float | None):
    """asyncio's timeout as the domain's DeadlineExceeded (what the remote ports raise)."""
    try:
        async with asyncio.timeout(timeout):
            yield
    except TimeoutError:
        raise DeadlineExceeded(f"{peer}: no answer within {timeout:.3g} s") from None


class LocalDraftSession:
    def __init__(self, svc: Drafter, session: Session) -> None:
        self.svc, self.session = svc, session

    async def propose(
        self,
        cursor: Cursor,
        gamma: int,
        seed: int,
        timeout: float | None = None,
        relay: RelayTo | None = None,  # nothing to relay around in one process
        ahead: bool = False,
        guess: bool = False,
    ) -> Proposal:
        async with _deadline("draft", timeout):
            return await self.svc.propose(
                self.session, cursor.cache_len, cursor.pending, gamma, seed, guess=guess
            )

    async def rollback(self, cache_len: int, timeout: float | None = None) -> int:
        return self.svc.rollback(self.session, cache_len)

    def ended(self) -> None:  # (in one process a session ends only when closed)
        return None

    async def retune(self, gamma: int, timeout: float | None = None) -> int:
        return 0  # (no pipeline runs in one process)

    async def close(self) -> None:
        self.svc.close(self.session)


class LocalTargetSession:
    relay_token = b""  # no relays: the engine calls verify itself
    next_logits = True  # (the verifier's prefill keeps them)

    def __init__(self, svc: Verifier, session: Session) -> None:
        self.svc, self.session = svc, session

    def cancel_relay(self, seed: int) -> None:
        pass

    async def verify(
        self,
        cursor: Cursor,
        proposal: Proposal | None,
        seed: int,
        dense_p: bool = False,
        timeout: float | None = None,
        pit: bool = False,
        run: int = 1,
        follow: tuple[int, ...] = (),
        draft_idle: bool = False,
    ) -> Verdict:
        if follow:  # (relay_token is empty: no pipeline starts in one process)
            raise FailedPrecondition("follow: an in-process target session takes no relays")
        drafts = proposal.tokens if proposal else []
        qs = []
        if proposal is not None:
            qs = proposal.qs
            if qs is None:  # only the wire form is at hand
                qs = unpack_q(
                    proposal.packed,
                    self.svc.vocab_size,
                    drafts,
                    head=self.svc.head,
                    params=self.session.params,
                )
        # (a sampled proposal's guesses of the residual draws; a greedy one's are ignored)
        guesses = (proposal.alternates if proposal is not None else None) or ()
        async with _deadline("target", timeout):
            return await self.svc.verify(
                self.session,
                cursor.cache_len,
                cursor.pending,
                drafts,
                qs,
                seed,
                dense_p,
                pit,
                run,
                guesses,
                draft_idle,
            )

    async def rollback(self, cache_len: int, timeout: float | None = None) -> int:
        return self.svc.rollback(self.session, cache_len)

    async def close(self) -> None:
        self.svc.close(self.session)


class LocalDraft:
    """A draft service in this process."""

    def __init__(self, svc: Drafter) -> None:
        self.svc = svc

    async def info(self, timeout: float | None = None) -> ModelInfo:
        return self.svc.info

    async def open(
        self,
        session_id: str,
        tokens: Sequence[int],
        params: SamplingParams,
        shape: WireShape,
        timeout: float | None = None,
        counter=None,
    ) -> LocalDraftSession:
        async with _deadline("draft", timeout):
            session = await self.svc.open_draft(session_id, tokens, params, shape)
        return LocalDraftSession(self.svc, session)

    async def aclose(self) -> None:
        pass


class LocalTarget:
    """A target service in this process."""

    def __init__(self, svc: Verifier) -> None:
        self.svc = svc

    async def info(self, timeout: float | None = None) -> ModelInfo:
        return self.svc.info

    async def open(
        self,
        session_id: str,
        tokens: Sequence[int],
        params: SamplingParams,
        timeout: float | None = None,
        counter=None,
    ) -> LocalTargetSession:
        async with _deadline("target", timeout):
            session = await self.svc.open(session_id, tokens, params)
        return LocalTargetSession(self.svc, session)

    async def aclose(self) -> None:
        pass


def local_pools(
    drafter: Drafter | None,
    verifier: Verifier,
    retry_after_s: float = 1.0,
    retry_max_s: float = 30.0,
):
    """(target pool, draft pool) of in-process services, for ``Orchestrator``."""
    from ..replicas import ReplicaPool, fixed

    target = ReplicaPool(
        "target",
        "in-process",
        lambda _: LocalTarget(verifier),
        retry_after_s,
        retry_max_s,
        resolver=fixed("in-process"),
    )
    draft = ReplicaPool(
        "draft",
        "in-process",
        lambda _: LocalDraft(drafter),
        retry_after_s,
        retry_max_s,
        resolver=fixed("in-process") if drafter is not None else (lambda spec: []),
    )
    return target, draft
