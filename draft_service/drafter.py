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

Guesses (greedy, ``guesses``): when the block after a proposal is asked for
ahead, that proposal's verdict is still to come, and the block drafted ahead
serves only if every draft is accepted. So the draft also drafts the next block
for a rejection at each of the proposal's first positions, each on its own copy
of the cache (``SessionKV.fork``): after x_1..x_{i-1}, the token the target
would emit in place of a rejected x_i, guessed as the draft's own second choice
there. Where the next propose asks for one of them (same cursor; a greedy block
does not depend on the seed), it takes that copy as the session's cache and
answers at once; the others are dropped. On the demo pair the target's token is
the draft's second choice at 69% of greedy rejections. At T > 0 the target's
token there is a draw from the residual r, which the draft's argmax hits at 14%
of rejections; instead, in a step that drafts ahead, the draft draws its guess
y_i from q_i without x_i and sends it with the verify (relayed or back to the
orchestrator), and the target draws its token coupled to y_i
(``sampling.guess_coupling``: still distributed as r, and y_i 36% of the time).
A sampled block depends on its seed, so the blocks after these guesses are
drafted only when the proposal's relay tells the next step's gamma and seed
(``DraftOn``), with them.
Opt-in (``sampled_guesses``): a sampled block costs the draft its q and draw at
every position, and on the 2-core demo VM that cost what the guesses saved.
Only while no other session's work waits for the draft's forwards: under load
the guesses' forwards would delay other sessions' drafts (as drafting ahead does).
A guess is only ever a head start: the propose decides, as for drafting on.
Not for: gRPC (``draft_service.servicer``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.step import Cursor, settle
from orchestrator.step import ahead as ahead_cursor
from specdec import metrics
from specdec.config import MAX_GAMMA
from specdec.errors import require
from specdec.hidden_q import hidden_position
from specdec.model_service import ModelService
from specdec.rng import generator, side_generator
from specdec.runtime.forward_loop import Job
from specdec.runtime.ragged import Feed, SessionKV
from specdec.sampling import (
    Proposal,
    SamplingParams,
    SparseQ,
    Verdict,
    draft_position,
    greedy_top2,
    guess_from,
)
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
    finished: float | None = None  # when its drafting ended


@dataclass
class Drafted:
    """The proposal a session's last propose was answered with, and where from."""

    cache_len: int
    feed: tuple[int, ...]
    tokens: list[int]
    alternates: list[int] | None  # the draft's second choice at each position (greedy)
    # Its ask was the block after the proposal before it (drafted ahead); if the block
    # after this one is asked for in turn, this one took the next step (chained), and
    # a greedy one's first token was matched as that step's bonus.
    chained: bool = False
    # Sampled: the next step's (gamma, seed) after a rejection (``DraftOn``), which
    # its guesses are drafted with; None: no guesses.
    next: tuple[int, int] | None = None

    def after(self) -> tuple[int, tuple[int, ...]] | None:
        """The ask (cache_len, feed) of the block after it (``ahead``)."""
        if not self.tokens:
            return None
        return self.cache_len + len(self.feed) + len(self.tokens) - 1, (self.tokens[-1],)


@dataclass
class Guess:
    """A block drafted for one rejection before the verdict (see the module's docstring)."""

    kv: SessionKV  # the session's cache up to the rejected position, then this block's
    started: float
    task: asyncio.Future | None  # -> Proposal; set once made
    # What it was drafted with; None: a greedy block, which draws nothing (any seed).
    seed: int | None = None
    finished: float | None = None  # when its drafting ended


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
    last: Drafted | None = None
    # By the ask (cache_len, feed) that would take them: blocks for rejections.
    guesses: dict[tuple[int, tuple[int, ...]], Guess] = field(default_factory=dict)
    # A pipeline pacing the session's steps (``draft_service.pipeline``): stopped by
    # the caller's next call on the session (but a retune); ``piped``: its object.
    pipeline: asyncio.Task | None = None
    piped: Any = None


class Drafter(ModelService):
    """Sessions of the draft model, and drafting."""

    def __init__(self, cfg, model=None, tokenizer=None) -> None:
        super().__init__("draft", cfg, model, tokenizer)
        for outcome in ("used", "discarded", "skipped"):  # 0 on dashboards, not nothing
            metrics.DRAFTED_ON.labels(outcome)
        for kind in ("first", "follower", "fresh", "guess"):
            metrics.PIPELINE_BLOCKS.labels(kind)

    async def open_draft(
        self, session_id: str, tokens, params: SamplingParams, shape: WireShape
    ) -> Session:
        return await self.open(session_id, tokens, params, extra=DraftState(shape.check()))

    async def propose(
        self,
        session: Session,
        cache_len: int,
        append,
        gamma: int,
        seed: int,
        guess_next: tuple[int, int] | None = None,
        guess: bool = False,
    ) -> Proposal:
        """Roll back to ``cache_len``, feed ``append``, draft ``gamma`` tokens.
        ``guess``: the step drafts ahead; a sampled proposal then guesses its residual
        draws (``alternates``; ``sampled_guesses``). ``guess_next``: the next step's
        (gamma, seed) after a rejection, which the blocks after the guesses are drafted
        with (only then are they drafted)."""
        require(1 <= gamma <= MAX_GAMMA, "gamma", f"must be in [1, {MAX_GAMMA}], got {gamma}")
        feed = self.check_tokens("append_tokens", append, min_len=1)
        self.check_room("gamma", cache_len + len(feed) + gamma)
        start = time.perf_counter()
        state: DraftState = session.extra
        await self.stop_pipeline(session)
        state.proposes += 1
        ask = (cache_len, tuple(feed))
        moot, state.moot = state.moot, None
        if ask == moot and not (state.head is not None and state.head.seed == seed):
            return Proposal([], [], session.length)  # the head start stays
        state.asked, state.drafting = ask, None
        head = await self.settle_head(session, (*ask, gamma, seed))
        if head is not None:
            self.drop_guesses(session)
            proposal = self._from_head(session, head, gamma, start)
            return self._answer(session, ask, proposal, seed, guess, guess_next)
        proposal = await self._take_guess(session, ask, gamma, seed, start)
        if proposal is not None:
            return self._answer(session, ask, proposal, seed, guess, guess_next)
        last = state.last
        chained = last is not None and ask == last.after()
        if chained:  # drafting ahead: last's verdict is to come
            self._guess(session, last, gamma)
        self.roll_back_to(session, cache_len)
        state.drafting = drafted = asyncio.get_running_loop().create_future()
        try:
            proposal = await self.run(self._draft(session, feed, gamma, seed), "propose")
        finally:
            if not drafted.done():
                drafted.set_result(None)
        proposal.compute_s = time.perf_counter() - start
        return self._answer(session, ask, proposal, seed, guess, guess_next, chained)

    def _answer(
        self, session, ask, proposal: Proposal, seed: int, guess, guess_next, chained=False
    ):
        """Remember what a propose is answered with (``DraftState.last``); a sampled
        one whose step drafts ahead gets its guesses of the residual draws."""
        count = self.cfg.sampled_guesses
        guess = guess or guess_next is not None
        sampled = not session.params.greedy and count > 0 and guess
        if sampled and proposal.qs:
            rng = side_generator(seed)  # not the stream its tokens were drawn from
            n = min(len(proposal.tokens), count)
            pairs = zip(proposal.qs[:n], proposal.tokens[:n], strict=True)
            proposal.alternates = [guess_from(q, x, rng) for q, x in pairs]
        nxt = guess_next if sampled else None
        session.extra.last = Drafted(*ask, proposal.tokens, proposal.alternates, chained, nxt)
        return proposal

    def _draft(
        self,
        session: Session,
        feed: list[int],
        gamma: int,
        seed: int,
        limit=None,
        kv: SessionKV | None = None,
    ) -> Job:
        """gamma forwards, each drawing x_i from its q_i; x_gamma is not fed.
        ``limit``: [n], read before each forward: stop after n tokens (the first n
        draws of a longer draft with one seed are those of the shorter one).
        ``kv``: the cache to draft on (a guess's copy); the session's by default."""
        kv = session.kv if kv is None else kv
        rng = None if session.params.greedy else generator(seed)  # greedy: no draws
        shape: WireShape = session.extra.shape
        tokens: list[int] = []
        qs: list[SparseQ] = []
        # greedy: the second choices, for guesses
        alternates = [] if rng is None and self.cfg.guesses else None
        forward_s = batch_tokens = 0.0
        # The hidden-state wire (specdec.hidden_q): q derived from the last hidden state.
        hidden = [] if shape.hidden and rng is not None and self.head is not None else None
        for i in range(gamma):
            if limit is not None and i >= limit[0]:
                break
            # [1, vocab] ([0, vocab] where the runner skipped the output layer)
            logits = yield Feed(kv, feed, 1, hidden, head=hidden is None)
            forward_s += self.loop.last_batch.seconds
            batch_tokens += self.loop.last_batch.tokens
            if hidden is not None:
                x, q = hidden_position(self.head, hidden.pop()[0], session.params, rng)
            elif alternates is not None:  # greedy, with the second choice
                x, second = greedy_top2(logits[0])
                q = SparseQ.point(x, logits.shape[-1])
                alternates.append(second)
            else:
                x, q = draft_position(
                    logits[0], session.params, shape.max_entries, shape.eps, shape.bits, rng
                )
            tokens.append(x)
            qs.append(q)
            feed = [x]
        return Proposal(
            tokens,
            qs,
            kv.length,
            forward_s=forward_s,
            batch_tokens=batch_tokens / len(tokens),
            alternates=alternates,
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
            metrics.labelled(metrics.DRAFTED_ON, "skipped").inc()
            return
        # The target's cursor does not matter here: only the draft's is used.
        outcome = settle(Cursor(0, ()), cursor, drafts, verdict, u)
        nxt = outcome.draft
        fits = nxt is not None and nxt.cache_len <= session.length
        unused = not ahead or outcome.accepted < len(drafts)  # the block drafted ahead
        key = None if nxt is None else (nxt.cache_len, nxt.pending)
        guess = state.guesses.get(key) if unused else None
        guessed = guess is not None and guess.seed in (None, seed)
        self.drop_guesses(session, keep=key if guessed else None)  # the rest are moot
        if guessed:  # its propose takes the guess
            metrics.labelled(metrics.DRAFTED_ON, "skipped").inc()
            return
        if not fits or not unused or nxt.end + gamma > self.max_context:
            metrics.labelled(metrics.DRAFTED_ON, "skipped").inc()  # the propose will say what to do
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
        return await _timed(self.run(job, "propose"), head)

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
                    metrics.labelled(metrics.DRAFTED_ON, "used").inc()
                    return head
                except asyncio.CancelledError:  # the propose's caller is gone: the
                    head.task.cancel()  # session no longer holds it, so stop it here
                    raise
                except Exception:
                    pass
        head.task.cancel()
        await asyncio.wait([head.task])
        metrics.labelled(metrics.DRAFTED_ON, "discarded").inc()
        return None

    def _from_head(
        self, session: Session, head: HeadStart, gamma: int, asked_at: float
    ) -> Proposal:
        """The head start's proposal, cut to ``gamma`` tokens if it drafted more;
        ``asked_at``: when its propose arrived (its lead: the time drafted before)."""
        proposal: Proposal = head.task.result()
        if gamma < len(proposal.tokens):
            self._cut(session, proposal, gamma, head.cache_len + len(head.feed))
        proposal.compute_s, proposal.lead_s = drafted_before(head, asked_at, time.perf_counter())
        return proposal

    # ---- guesses -----------------------------------------------------------------------
    def _guess(self, session: Session, last: Drafted, gamma: int) -> None:
        """``last``'s verdict is to come while the block after it is drafted (asked
        for ``gamma`` tokens): draft the next block for a rejection at each of
        ``last``'s first positions, from the draft's second choice there, each on a
        copy of the cache (see the module's docstring). The propose asking for that
        block has dropped the guesses before (``_take_guess``)."""
        state: DraftState = session.extra
        greedy = session.params.greedy
        count = self.cfg.guesses if greedy else self.cfg.sampled_guesses
        if not count or not last.alternates or (not greedy and last.next is None):
            return
        if self.loop.queued:  # other sessions' work waits: guesses only use idle time
            return
        if greedy:
            # A greedy block asked for ahead is one token longer (its first token is
            # matched as the bonus): the next step, after a rejection, asks one fewer.
            gamma, seed = max(1, gamma - 1), 0
        else:  # drafted as the next step will ask for it
            gamma, seed = last.next
        base = last.cache_len + len(last.feed)  # x_1's position in the history
        # A chained greedy block's x_1 was the bonus (a sampled one's is tested).
        first = 1 if last.chained and greedy else 0
        budget = self.cfg.guess_copy_mb * 2**20  # bytes of cache the copies may take
        per_token = session.kv.bytes_per_token()
        for i in range(first, min(len(last.alternates), first + count)):
            at = base + i  # the history before x_{i+1}: what a rejection of it keeps
            budget -= at * per_token
            if at > session.length or at + 1 + gamma > self.max_context or budget < 0:
                break
            y = last.alternates[i]
            if y < 0:  # (sampled: no guess there)
                continue
            kv = session.kv.fork(at)
            g = Guess(kv, time.perf_counter(), None, None if greedy else seed)
            g.task = asyncio.ensure_future(
                _timed(self.run(self._draft(session, [y], gamma, seed, kv=kv), "guess"), g)
            )
            g.task.add_done_callback(_consume)
            state.guesses[(at, (y,))] = g

    def drop_guesses(self, session: Session, keep=None) -> None:
        """Stop and forget the session's guesses, but the one ``keep`` (an ask) names."""
        state: DraftState = session.extra
        for ask in [a for a in state.guesses if a != keep]:
            state.guesses.pop(ask).task.cancel()
            metrics.labelled(metrics.DRAFT_GUESSES, "unused").inc()

    async def _take_guess(
        self,
        session: Session,
        ask: tuple[int, tuple[int, ...]],
        gamma: int,
        seed: int,
        asked_at: float,
    ) -> Proposal | None:
        """The proposal for ``ask`` from its guess, if there is one (the others are
        dropped): its copy of the cache becomes the session's, the block cut to
        ``gamma`` tokens or (greedy) drafted on to them. None: no such guess, or a
        sampled one drafted with another seed or fewer tokens than asked (its draws
        are not the ones this propose would make)."""
        state: DraftState = session.extra
        guess = state.guesses.pop(ask, None)
        self.drop_guesses(session)
        if guess is None or guess.task.cancelled():  # (stopped with the service)
            return None
        if guess.seed not in (None, seed):
            guess.task.cancel()
            metrics.labelled(metrics.DRAFT_GUESSES, "unused").inc()
            return None
        try:
            proposal: Proposal = await asyncio.shield(guess.task)
        except asyncio.CancelledError:  # the propose's caller is gone (see settle_head)
            guess.task.cancel()
            raise
        except Exception:  # (it failed: drafted anew)
            return None
        if not session.params.greedy and gamma > len(proposal.tokens):
            metrics.labelled(metrics.DRAFT_GUESSES, "unused").inc()
            return None
        metrics.labelled(metrics.DRAFT_GUESSES, "used").inc()
        self.loop.forget(session.kv)
        session.kv = guess.kv
        cache_len, feed = ask
        if gamma < len(proposal.tokens):
            self._cut(session, proposal, gamma, cache_len + len(feed))
        elif gamma > len(proposal.tokens):  # the rest, from x_m (greedy: no seed)
            more = await self.run(
                self._draft(session, proposal.tokens[-1:], gamma - len(proposal.tokens), 0),
                "propose",
            )
            proposal.tokens += more.tokens
            proposal.qs += more.qs
            proposal.alternates = (proposal.alternates or []) + (more.alternates or [])
            proposal.forward_s += more.forward_s
        proposal.cache_len = session.length
        proposal.compute_s, proposal.lead_s = drafted_before(guess, asked_at, time.perf_counter())
        return proposal

    def _cut(self, session: Session, proposal: Proposal, gamma: int, fed: int) -> None:
        """Keep ``proposal``'s first ``gamma`` tokens, and the cache that drafted them;
        ``fed``: the cache's length once the proposal's feed was in (x_1's position)."""
        proposal.forward_s *= gamma / len(proposal.tokens)
        proposal.tokens, proposal.qs = proposal.tokens[:gamma], proposal.qs[:gamma]
        if proposal.alternates is not None:
            proposal.alternates = proposal.alternates[:gamma]
        self.roll_back_to(session, fed + gamma - 1)
        proposal.cache_len = session.length

    # ---- pipelined speculation ----------------------------------------------------------
    def start_pipeline(self, session: Session, pipeline) -> None:
        """Let ``pipeline`` (``draft_service.pipeline.Pipeline``) pace the session's
        steps; its first block is the last propose's, already relayed."""
        state: DraftState = session.extra
        state.last = state.asked = state.moot = None  # the pipeline moves the cache on
        state.piped = pipeline
        state.pipeline = asyncio.ensure_future(pipeline.run())
        state.pipeline.add_done_callback(_consume)
        metrics.labelled(metrics.PIPELINE_BLOCKS, "first").inc()

    async def stop_pipeline(self, session: Session) -> None:
        """Stop the session's pipeline, if any, after its current forward."""
        state: DraftState = session.extra
        task, state.pipeline, state.piped = state.pipeline, None, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])

    def retune_pipeline(self, session: Session, gamma: int) -> int:
        """The running pipeline's blocks have ``gamma`` drafts from the next one it
        drafts on (``Pipeline.retune``); returns that block's index (0: no pipeline
        runs, nothing changed). The pipeline goes on."""
        state: DraftState = session.extra
        if state.piped is None or state.pipeline is None or state.pipeline.done():
            return 0
        return state.piped.retune(gamma)

    async def rollback_draft(self, session: Session, cache_len: int) -> int:
        """``rollback``, after the session's head start (discarded)."""
        await self.stop_pipeline(session)
        session.extra.proposes += 1
        session.extra.moot = None
        self.drop_guesses(session)
        await self.settle_head(session)
        return self.rollback(session, cache_len)

    def close(self, session: Session) -> bool:
        head = session.extra.head if isinstance(session.extra, DraftState) else None
        if head is not None:
            head.task.cancel()
            session.extra.head = None
        if isinstance(session.extra, DraftState):
            self.drop_guesses(session)
            if session.extra.pipeline is not None:
                session.extra.pipeline.cancel()
                session.extra.pipeline = None
        return super().close(session)


def _consume(task: asyncio.Future) -> None:
    """A head start nobody awaits may fail or be cancelled quietly."""
    if not task.cancelled():
        task.exception()


async def _timed(drafting: Any, block: HeadStart | Guess) -> Proposal:
    """``drafting``'s proposal, with the time it ended on ``block``."""
    proposal = await drafting
    block.finished = time.perf_counter()
    return proposal


def drafted_before(block: HeadStart | Guess, asked_at: float, now: float) -> tuple[float, float]:
    """(compute_s, lead_s) of a proposal answered ``now`` from ``block``, drafted before
    its propose came at ``asked_at``: its time from the start of its drafting, and of
    that the part before the propose, both less the time a block drafted in full sat
    waiting for its propose. That wait is no compute: counted as such (before
    2026-12-06), blocks drafted on from an echo over a 10 ms round trip read 15-18 ms
    of draft time, and an orchestrator that also served requests drafting ahead
    priced a drafted token at 3.2-3.5 ms (0.2 measured in calls; 0.9 with this
    fixed, the rest was the guesses its passes carried, see
    ``orchestrator.adaptive.CostModel.observe_draft``): its adaptive requests chose
    gamma 2.5-3 where 5-6 was the fastest. compute_s - lead_s, the time after the
    propose came, is unchanged."""
    finished = now if block.finished is None else block.finished
    idle = max(0.0, asked_at - finished)
    return now - block.started - idle, max(0.0, asked_at - block.started - idle)
