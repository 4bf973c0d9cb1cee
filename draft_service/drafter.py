"""The draft model's domain: sessions plus proposing.

Each drafted token is sampled from q, the draft's warped distribution turned
into a ``SparseQ`` (its most likely tokens with integer counts, the rest of
the mass spread over every other token); that SparseQ is exactly what goes on
the wire, so the orchestrator's acceptance test stays exact.

Drafting on (``draft_on``): when the target echoes a relayed verify's verdict,
the draft settles the step with the orchestrator's own pure ``settle`` and
uniforms and starts the next proposal before the orchestrator asks for it.
``propose`` answers from that head start only when the orchestrator asks for
exactly it (same cursor and seed, at most as many tokens); anything else is
drafted anew. The head start never decides anything.

In a step that also drafts ahead (``ahead``: the orchestrator asks for the block
after x_gamma while the target verifies), that block takes the next step only
if every draft is accepted. So the draft drafts on only on a verdict that
rejects a draft, after the block drafted ahead if that is being drafted; and a
propose for that block that comes after the verdict is answered with no
tokens: the orchestrator, settling the same verdict, would discard it.
Not for: gRPC (``draft_service.servicer``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.step import Cursor, settle
from orchestrator.step import ahead as ahead_cursor
from specdec import metrics
from specdec.config import MAX_GAMMA
from specdec.errors import require
from specdec.hidden_q import hidden_position
from specdec.model_service import ModelService
from specdec.rng import generator
from specdec.runtime.forward_loop import Job
from specdec.runtime.ragged import Feed
from specdec.sampling import Proposal, SamplingParams, SparseQ, Verdict, draft_position
from specdec.sessions import Session
from specdec.wire import WireShape


@dataclass
class HeadStart:
    """A proposal drafted on an echoed verdict, before its propose came."""

    cache_len: int
    feed: tuple[int, ...]
    gamma: int
    seed: int
    started: float  # when its drafting began (after a block drafted ahead, if any)
    task: asyncio.Future | None  # -> Proposal; set once made
    limit: list[int]  # [tokens to draft]: lowered when a propose asks for fewer


@dataclass
class DraftState:
    """What the draft keeps per session besides its cache."""

    shape: WireShape
    # Counts proposes: an echoed verdict drafts on only if no propose came after the
    # one it answers (none is drafting, then, and the cache is the one it left), or
    # only the one drafting ahead from it.
    proposes: int = 0
    head: HeadStart | None = None
    # The last propose's ask (cache_len, feed) and its drafting (done once drafted).
    asked: tuple[int, tuple[int, ...]] | None = None
    drafting: asyncio.Future | None = None
    # A block drafted ahead that an echoed verdict left unused, (cache_len, feed): the
    # propose asking for it gets no tokens.
    moot: tuple[int, tuple[int, ...]] | None = None


class Drafter(ModelService):
    """Sessions of the draft model, and drafting."""

    def __init__(self, cfg, model=None, tokenizer=None) -> None:
        super().__init__("draft", cfg, model, tokenizer)
        for outcome in ("used", "discarded", "skipped"):  # 0 on dashboards, not nothing
            metrics.DRAFTED_ON.labels(outcome)

    async def open_draft(
        self, session_id: str, tokens, params: SamplingParams, shape: WireShape
    ) -> Session:
        return await self.open(session_id, tokens, params, extra=DraftState(shape.check()))

    async def propose(
        self, session: Session, cache_len: int, append, gamma: int, seed: int
    ) -> Proposal:
        """Roll back to ``cache_len``, feed ``append``, draft ``gamma`` tokens."""
        require(1 <= gamma <= MAX_GAMMA, "gamma", f"must be in [1, {MAX_GAMMA}], got {gamma}")
        feed = self.check_tokens("append_tokens", append, min_len=1)
        self.check_room("gamma", cache_len + len(feed) + gamma)
        start = time.perf_counter()
        state: DraftState = session.extra
        state.proposes += 1
        ask = (cache_len, tuple(feed))
        moot, state.moot = state.moot, None
        if ask == moot and not (state.head is not None and state.head.seed == seed):
            return Proposal([], [], session.length)  # the head start stays
        state.asked, state.drafting = ask, None
        head = await self.settle_head(session, (*ask, gamma, seed))
        if head is not None:
            return self._from_head(session, head, gamma, start)
        self.roll_back_to(session, cache_len)
        state.drafting = drafted = asyncio.get_running_loop().create_future()
        try:
            proposal = await self.run(self._draft(session, feed, gamma, seed), "propose")
        finally:
            if not drafted.done():
                drafted.set_result(None)
        self.sessions.update_gauges()
        proposal.compute_s = time.perf_counter() - start
        return proposal

    def _draft(self, session: Session, feed: list[int], gamma: int, seed: int, limit=None) -> Job:
        """gamma forwards, each drawing x_i from its q_i; x_gamma is not fed.
        ``limit``: [n], read before each forward: stop after n tokens (the first n
        draws of a longer draft with one seed are those of the shorter one)."""
        rng = None if session.params.greedy else generator(seed)  # greedy: no draws
        shape: WireShape = session.extra.shape
        tokens: list[int] = []
        qs: list[SparseQ] = []
        forward_s = batch_tokens = 0.0
        # The hidden-state wire (specdec.hidden_q): q derived from the last hidden state.
        hidden = [] if shape.hidden and rng is not None and self.head is not None else None
        for i in range(gamma):
            if limit is not None and i >= limit[0]:
                break
            # [1, vocab] ([0, vocab] where the runner skipped the output layer)
            logits = yield Feed(session.kv, feed, 1, hidden, head=hidden is None)
            forward_s += self.loop.last_batch.seconds
            batch_tokens += self.loop.last_batch.tokens
            if hidden is not None:
                x, q = hidden_position(self.head, hidden.pop()[0], session.params, rng)
            else:
                x, q = draft_position(
                    logits[0], session.params, shape.max_entries, shape.eps, shape.bits, rng
                )
            tokens.append(x)
            qs.append(q)
            feed = [x]
        return Proposal(
            tokens, qs, session.length, forward_s=forward_s, batch_tokens=batch_tokens / len(tokens)
        )

    # ---- drafting on ---------------------------------------------------------------------
    def draft_on(
        self,
        session: Session,
        proposes: int,
        cursor: Cursor,
        drafts: Sequence[int],
        verdict: Verdict,
        u: Sequence[float],
        gamma: int,
        seed: int,
        ahead: bool = False,
    ) -> None:
        """The verdict on ``drafts`` (drafted from ``cursor`` by propose number
        ``proposes``) came back: settle the step as the orchestrator will and start
        drafting ``gamma`` tokens with ``seed`` from the draft's next cursor.
        ``ahead``: the step drafts ahead too (see the module's docstring)."""
        state: DraftState = session.extra
        live = state.head is None and session in self.sessions
        past = ahead_cursor(cursor, drafts)
        block = (past.cache_len, past.pending)
        after = None  # the block drafted ahead, if it is asked for: drafted first
        if ahead and live and state.proposes == proposes + 1 and state.asked == block:
            after = state.drafting
        elif state.proposes != proposes or not live:
            metrics.DRAFTED_ON.labels("skipped").inc()
            return
        # The target's cursor does not matter here: only the draft's is used.
        outcome = settle(Cursor(0, ()), cursor, drafts, verdict, u)
        nxt = outcome.draft
        fits = nxt is not None and nxt.cache_len <= session.length
        unused = not ahead or outcome.accepted < len(drafts)  # the block drafted ahead
        if not fits or not unused or nxt.end + gamma > self.max_context:
            metrics.DRAFTED_ON.labels("skipped").inc()  # the propose will say what to do
            return
        if ahead and state.proposes == proposes:  # its propose may still come
            state.moot = block
        feed, limit = list(nxt.pending), [gamma]
        job = self._draft(session, feed, gamma, seed, limit)
        head = HeadStart(nxt.cache_len, tuple(feed), gamma, seed, time.perf_counter(), None, limit)
        head.task = asyncio.ensure_future(self._head_start(session, head, job, after))
        head.task.add_done_callback(_consume)
        state.head = head

    async def _head_start(
        self, session: Session, head: HeadStart, job: Job, after: asyncio.Future | None
    ) -> Proposal:
        """A head start's drafting: once ``after`` (a block being drafted ahead) is
        done, from the head start's cursor. (Its time counts from then: the
        proposal's compute_s feeds the orchestrator's cost model.)"""
        if after is not None and not after.done():
            await asyncio.wait([after])  # (never cancels it)
            head.started = time.perf_counter()
        self.roll_back_to(session, head.cache_len)
        return await self.run(job, "propose")

    async def settle_head(self, session: Session, asked=None) -> HeadStart | None:
        """Take the session's head start, if any. If it is what ``asked`` (cache_len,
        feed, gamma, seed) asks for (the same cursor and seed, at most as many
        tokens), it is returned once drafted (drafting no more than asked);
        otherwise it is stopped after its current forward, and None returned.
        Every operation on the session's cache comes through here first."""
        state: DraftState = session.extra
        head, state.head = state.head, None
        if head is None:
            return None
        if asked is not None:
            cache_len, feed, gamma, seed = asked
            same = (head.cache_len, head.feed, head.seed) == (cache_len, feed, seed)
            if same and gamma <= head.gamma:
                head.limit[0] = gamma
                try:
                    await asyncio.shield(head.task)
                    metrics.DRAFTED_ON.labels("used").inc()
                    return head
                except Exception:
                    pass
        head.task.cancel()
        await asyncio.wait([head.task])
        metrics.DRAFTED_ON.labels("discarded").inc()
        return None

    def _from_head(
        self, session: Session, head: HeadStart, gamma: int, asked_at: float
    ) -> Proposal:
        """The head start's proposal, cut to ``gamma`` tokens if it drafted more;
        ``asked_at``: when its propose arrived (its lead: the time drafted before)."""
        proposal: Proposal = head.task.result()
        if gamma < len(proposal.tokens):
            proposal.forward_s *= gamma / len(proposal.tokens)
            proposal.tokens, proposal.qs = proposal.tokens[:gamma], proposal.qs[:gamma]
            self.roll_back_to(session, head.cache_len + len(head.feed) + gamma - 1)
            proposal.cache_len = session.length
        proposal.compute_s = time.perf_counter() - head.started
        proposal.lead_s = max(0.0, asked_at - head.started)  # (<= compute_s: asked before now)
        return proposal

    async def rollback_draft(self, session: Session, cache_len: int) -> int:
        """``rollback``, after the session's head start (discarded)."""
        session.extra.proposes += 1
        session.extra.moot = None
        await self.settle_head(session)
        return self.rollback(session, cache_len)

    def close(self, session: Session) -> bool:
        head = session.extra.head if isinstance(session.extra, DraftState) else None
        if head is not None:
            head.task.cancel()
            session.extra.head = None
        return super().close(session)


def _consume(task: asyncio.Future) -> None:
    """A head start nobody awaits may fail or be cancelled quietly."""
    if not task.cancelled():
        task.exception()
