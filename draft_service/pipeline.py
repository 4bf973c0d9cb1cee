"""Pipelined speculation: the draft service paces a request's steps.

The caller's propose with a ``Pipeline`` starts it (``draft_service.servicer``):
its block is relayed to the target as usual, and from then on nobody asks for a
step. This loop keeps the target fed:

* after relaying a block it drafts the block that follows it, as if every draft
  of it will be accepted (``step.ahead``), and relays that one too, marked to run
  only if the block before it is accepted in full (``Verify.chain``), up to
  ``depth`` blocks ahead of the one being verified. The target runs a marked
  block the moment its condition holds, with no message in between;
* greedy, it also drafts, each on its own copy of the cache, the block for a
  rejection at each of the first positions of the block being verified, from
  the draft's second choice there (as ``draft.guesses`` does for steps the
  caller asks for), and relays them marked to run only if that rejection
  happens with that token (``Chain.rejected_at``);
* the target echoes every verdict here; each is settled with the caller's pure
  ``settle`` and uniforms, so this loop and the caller reach the same tokens and
  cursors. After a block accepted in full the next one is already at the target,
  and so is the guess for a rejection that drew the guessed token (its copy of
  the cache becomes the session's); otherwise the blocks ahead are dropped (the
  target drops them too) and the next block is drafted from the settled cursor
  and relayed at once.

A paced pipeline (depth 0, ``orchestrator.paced``) does only the last: it drafts
nothing while a block is verified, and after every verdict, a block accepted in
full included, drafts the next block from the settled cursor and relays it. Its
draws are the request's own, from its stream (``Pipeline.stream_position``), in
the order the caller's asked steps draw them: the same seed gives the same
output paced or asked.

Otherwise every block's seeds and uniforms come from the pipeline's key by step index
(``step.pipeline_draws``) and every block's length from the tokens still wanted
(``step.pipeline_gamma``), so nothing here is decided that the caller does not
decide the same way. It ends when no more tokens are wanted, when a relay
cannot be sent, or when the caller calls on the session again (the drafter
stops it first). Exactness: docs/exactness.md, section 4g.
Not for: gRPC messages beyond building the relayed verifies.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from orchestrator.step import (
    FOLLOWER,
    FRESH,
    GUESS,
    Cursor,
    ahead,
    paced_draws,
    pipeline_draws,
    pipeline_gamma,
    settle,
)
from specdec import metrics, tracing
from specdec.rng import Philox
from specdec.runtime.ragged import SessionKV
from specdec.sampling import Verdict
from specdec.sessions import Session
from specdec.v1 import target_pb2
from specdec.wire import pack_q

log = logging.getLogger("specdec.draft")


@dataclass
class Block:
    """One relayed block whose verdict is still to be settled here."""

    index: int
    kind: int  # FRESH, FOLLOWER or GUESS (``step.pipeline_draws``)
    drafts: list[int]  # as relayed (a greedy follower's: without its first token)
    draft: Cursor  # the draft's cursor the drafts count from (``settle``'s)
    left: int  # tokens the request still wants before it
    seed: int  # its verify's seed
    u: list[float]  # its acceptance test's uniforms
    first: int | None = None  # a greedy follower: the bonus it needs (Chain.first_token)
    alternates: list[int] | None = None  # greedy: the draft's second choice at each draft
    guessed: bool = False  # its guesses are drafted (or none will be)
    forward_s: float = 0.0  # the draft's forward passes that drafted it (Verify.draft_forward_s)
    verdict: asyncio.Future = field(default_factory=lambda: _loop().create_future())

    def echo(self, v: target_pb2.Verdict) -> None:
        tracing.mark("pipeline-echo")
        if not self.verdict.done():
            judged = Verdict(
                list(v.p_draft), list(v.q_draft), list(v.residual_tokens), v.bonus_token
            )
            self.verdict.set_result(judged)


def _loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


class Pipeline:
    """One session's pipeline (see the module's docstring)."""

    def __init__(
        self,
        drafter,
        session: Session,
        relay,
        target: str,
        token: bytes,
        key: int,
        gamma: int,
        depth: int,
        pit: bool,
        draft_idle: bool = False,
        stream: tuple[int, int] | None = None,
    ) -> None:
        self.drafter = drafter
        self.session = session
        self.relay = relay  # RelayClient
        self.target, self.token = target, token
        self.key, self.gamma, self.depth, self.pit = key, gamma, depth, pit
        # Paced (depth 0): nothing is drafted while a block is verified, so its
        # verifies say the draft is idle when the first one did (Verify.draft_idle).
        self.draft_idle = draft_idle and depth == 0
        # Paced: the draws come from the request's stream (seed, words drawn before the
        # first block's), as the caller's asked steps draw them (``Generation.step``).
        self.stream = Philox.at(*stream) if stream is not None and depth == 0 else None
        self.next_draft_seed = 0
        # Paced: the index of the next block whose gamma is not decided yet (a
        # retune applies from it: ``retune``).
        self.next_block = 1
        self.match = session.params.greedy  # greedy followers keep the bonus
        self.chain: list[Block] = []  # [0]: the block whose verdict comes next
        self.target_cursor: Cursor | None = None  # the one chain[0] runs from
        # Greedy: chain[0]'s guesses by rejected position, each with its copy of the cache.
        self.guesses: dict[int, tuple[Block, SessionKV]] = {}

    def first(self, cursor: Cursor, target_cursor: Cursor, proposal, left: int) -> Block:
        """The propose's own block (index 0), before it is relayed; ``left``: tokens
        still wanted before it."""
        drafts = list(proposal.tokens)
        if self.stream is not None:
            seed, self.next_draft_seed, u = paced_draws(self.stream, self.gamma)
            u = u[: len(drafts)]
        else:
            _, seed, u = pipeline_draws(self.key, 0, FRESH, len(drafts))
        block = Block(0, FRESH, drafts, cursor, left, seed, u)
        block.alternates = proposal.alternates
        self.chain, self.target_cursor = [block], target_cursor
        return block

    def retune(self, gamma: int) -> int:
        """The caller chose ``gamma`` (an adaptive request): every block drafted from
        now on has it. Returns the index of the first block it applies to.

        Paced: ``next_block``, the next block whose gamma is not decided yet; the
        caller learns it from the reply, so that both draw a block's uniforms for
        the same number of drafts. Drafting ahead: the block after the last one
        relayed (a block of a lower index drafted later, the guess or fresh block
        for a rejection, has it too). There the caller needs no index: it reads
        each block's length from its verdict and draws that many uniforms, the
        first of a longer block's (``step.pipeline_draws``)."""
        self.gamma = gamma
        if self.depth and self.chain:
            return self.chain[-1].index + 1
        return self.next_block

    async def run(self) -> None:
        """Draft ahead, settle each verdict, until no more tokens are wanted."""
        try:
            while self.chain and not self.depth:  # paced: nothing drafted meanwhile
                await self._settle(self.chain[0], await self.chain[0].verdict)
            while self.chain:
                # The head's guesses and, if none is relayed yet, the block that follows
                # it, drafted together: the forward loop runs all their feeds in one
                # pass per position. (Greedy, a rejection the guesses cover is several
                # times likelier than a block accepted in full with its bonus matched.)
                async with asyncio.TaskGroup() as drafting:
                    if len(self.chain) == 1:
                        drafting.create_task(self._follow(self.chain[-1]))
                    drafting.create_task(self._guess(self.chain[0]))
                while len(self.chain) <= self.depth and not self.chain[0].verdict.done():
                    if not await self._follow(self.chain[-1]):
                        break
                await self._settle(self.chain[0], await self.chain[0].verdict)
        except asyncio.CancelledError:
            raise
        except Exception:  # the caller's next call finds the session as it is
            log.exception("pipeline of session %s stopped", self.session.session_id)

    async def _follow(self, b: Block) -> bool:
        """Draft and relay the block that follows ``b`` if ``b`` is accepted in full."""
        match = self.match
        g = pipeline_gamma(b.left - len(b.drafts) - match, self.gamma, match)
        if not g:
            return False
        draft_seed, seed, u = pipeline_draws(self.key, b.index + 1, FOLLOWER, g)
        start = ahead(b.draft, b.drafts)
        proposal = await self._draft(start, g + match, draft_seed)
        tokens = proposal.tokens
        first = tokens[0] if match else None
        cursor = Cursor(b.draft.end + len(b.drafts), (first,)) if match else start
        left = b.left - len(b.drafts) - match
        nxt = Block(b.index + 1, FOLLOWER, tokens[match:], cursor, left, seed, u, first)
        if proposal.alternates is not None:
            nxt.alternates = proposal.alternates[match:]
        chain = target_pb2.Chain(after_seed=b.seed, uniforms=b.u, match=match)
        if match:
            chain.first_token = first
        if not await self._relay(nxt, proposal.qs[match:], chain):
            return False
        metrics.labelled(metrics.PIPELINE_BLOCKS, "follower").inc()
        self.chain.append(nxt)
        return True

    async def _guess(self, b: Block) -> None:
        """Greedy: draft and relay the block for a rejection at each of ``b``'s first
        positions (``draft.guesses`` of them), from the draft's second choice there,
        each on a copy of the cache, while ``b``'s verdict is to come.

        The guesses are drafted at once: the forward loop runs their feeds in one pass
        per position, so all of them cost about what one drafted alone costs, and the
        later positions' guesses reach the target before its verdict too. (Drafted one
        after the other, a block of 4 took the draft about four blocks' time, past the
        verify they are for.)"""
        count = self.drafter.cfg.guesses
        if b.guessed or not self.match or not count or not b.alternates:
            return
        b.guessed = True
        if b.verdict.done():
            return
        budget = self.drafter.cfg.guess_copy_mb * 2**20
        per_token = self.session.kv.bytes_per_token()
        d = self.drafter
        starts: list[tuple[int, int, int, int, SessionKV]] = []  # (j, y, left, gamma, kv)
        for j in range(min(len(b.drafts), count)):
            y, left, at = b.alternates[j], b.left - j - 1, b.draft.end + j
            g = pipeline_gamma(left, self.gamma)
            budget -= at * per_token
            if not g or budget < 0 or at > self.session.length:
                break
            starts.append((j, y, left, g, self.session.kv.fork(at)))
        jobs = [
            d.run(d._draft(self.session, [y], g, 0, kv=kv), "guess") for j, y, _, g, kv in starts
        ]
        proposals = await asyncio.gather(*jobs)
        t = self.target_cursor
        for (j, y, left, g, kv), proposal in zip(starts, proposals, strict=True):
            _, seed, u = pipeline_draws(self.key, b.index + 1, GUESS, g)
            at = b.draft.end + j
            guess = Block(b.index + 1, GUESS, proposal.tokens, Cursor(at, (y,)), left, seed, u)
            guess.alternates = proposal.alternates
            chain = target_pb2.Chain(
                after_seed=b.seed,
                uniforms=b.u,
                after_rejection=True,
                rejected_at=j + 1,
                residual_token=y,
            )
            if not await self._relay(guess, proposal.qs, chain, Cursor(t.end + j, (y,))):
                return
            metrics.labelled(metrics.PIPELINE_BLOCKS, "guess").inc()
            self.guesses[j] = (guess, kv)

    async def _settle(self, b: Block, verdict: Verdict) -> None:
        """Settle ``b`` as the caller will; after a rejection, the guess for it if the
        target runs it, else the next block drafted and relayed now."""
        tracing.mark("pipeline-settle")
        nxt = self.chain[1] if len(self.chain) > 1 else None
        outcome = settle(
            self.target_cursor,
            b.draft,
            b.drafts,
            verdict,
            b.u,
            chain=nxt is not None and not self.match,
            ahead_first=nxt.first if nxt is not None and self.match else None,
        )
        left = b.left - len(outcome.tokens)
        self.target_cursor = outcome.target
        guesses, self.guesses = self.guesses, {}
        if outcome.chained:  # the target is verifying the next block already
            metrics.labelled(metrics.DRAFT_GUESSES, "unused").inc(len(guesses))
            self.chain.pop(0)
            return
        n = outcome.accepted
        guess, kv = guesses.pop(n, (None, None))
        drew = verdict.residual_tokens[n] if n < len(b.drafts) else None
        metrics.labelled(metrics.DRAFT_GUESSES, "unused").inc(len(guesses))
        if guess is not None and drew == guess.draft.pending[0]:  # (the target runs it)
            metrics.labelled(metrics.DRAFT_GUESSES, "used").inc()
            self.drafter.loop.forget(self.session.kv)
            self.session.kv = kv  # the copy it was drafted on, now the session's
            self.chain = [guess]
            return
        if guess is not None:
            metrics.labelled(metrics.DRAFT_GUESSES, "unused").inc()
        self.chain = []
        g = pipeline_gamma(left, self.gamma)
        self.next_block = b.index + 2  # (block b.index + 1 has its gamma now)
        if not g:
            return
        if self.stream is not None:  # paced: the caller's asked step's draws
            draft_seed = self.next_draft_seed
            seed, self.next_draft_seed, u = paced_draws(self.stream, g)
        else:
            draft_seed, seed, u = pipeline_draws(self.key, b.index + 1, FRESH, g)
        proposal = await self._draft(outcome.draft, g, draft_seed)
        tracing.mark("pipeline-drafted")
        fresh = Block(b.index + 1, FRESH, proposal.tokens, outcome.draft, left, seed, u)
        fresh.alternates, fresh.forward_s = proposal.alternates, proposal.forward_s
        after = target_pb2.Chain(after_seed=b.seed, after_rejection=True)
        if await self._relay(fresh, proposal.qs, after, cursor=outcome.target):
            tracing.mark("pipeline-relayed")
            metrics.labelled(metrics.PIPELINE_BLOCKS, "fresh").inc()
            self.chain = [fresh]

    async def _draft(self, cursor: Cursor, gamma: int, seed: int):
        d = self.drafter
        d.roll_back_to(self.session, cursor.cache_len)
        return await d.run(d._draft(self.session, list(cursor.pending), gamma, seed), "propose")

    async def _relay(self, b: Block, qs, chain, cursor: Cursor | None = None) -> bool:
        request = target_pb2.RelayedVerify(relay_token=self.token)
        v = request.verify
        v.seed, v.pipeline, v.return_pit = b.seed, self.key, self.pit
        v.draft_idle, v.draft_forward_s = self.draft_idle, b.forward_s
        v.chain.CopyFrom(chain)
        if cursor is not None:
            v.cache_len, v.pending_tokens[:] = cursor.cache_len, cursor.pending
        v.draft_tokens[:] = b.drafts
        if b.alternates is not None:  # (greedy: which rejections a guess may follow)
            v.alternates[:] = b.alternates
        v.draft_q.CopyFrom(pack_q(qs))
        sent, _ = await self.relay.send(self.target, request, b.echo, late=True)
        return sent
