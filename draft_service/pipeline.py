"""Pipelined speculation: the draft service paces a request's steps.

The caller's propose with a ``Pipeline`` starts it (``draft_service.servicer``):
its block is relayed to the target as usual, and from then on nobody asks for a
step. This loop keeps the target fed:

* after relaying a block it drafts the block that follows it, as if every draft
  of it will be accepted (``step.ahead``), and relays that one too, marked to run
  only if the block before it is accepted in full (``Verify.chain``), up to
  ``depth`` blocks ahead of the one being verified. The target runs a marked
  block the moment its condition holds, with no message in between;
* the target echoes every verdict here; each is settled with the caller's pure
  ``settle`` and uniforms, so this loop and the caller reach the same tokens and
  cursors. After a block accepted in full the next one is already at the target;
  after a rejection the blocks ahead are dropped (the target drops them too) and
  the next block is drafted from the settled cursor and relayed at once.

Every block's seeds and uniforms come from the pipeline's key by step index
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

from orchestrator.step import Cursor, ahead, pipeline_draws, pipeline_gamma, settle
from specdec import metrics
from specdec.sampling import Verdict
from specdec.sessions import Session
from specdec.v1 import target_pb2
from specdec.wire import pack_q

log = logging.getLogger("specdec.draft")


@dataclass
class Block:
    """One relayed block whose verdict is still to be settled here."""

    index: int
    follows: bool  # it follows a block accepted in full (Verify.chain)
    drafts: list[int]  # as relayed (a greedy follower's: without its first token)
    draft: Cursor  # the draft's cursor the drafts count from (``settle``'s)
    left: int  # tokens the request still wants before it
    seed: int  # its verify's seed
    u: list[float]  # its acceptance test's uniforms
    first: int | None = None  # a greedy follower: the bonus it needs (Chain.first_token)
    verdict: asyncio.Future = field(default_factory=lambda: _loop().create_future())

    def echo(self, v: target_pb2.Verdict) -> None:
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
    ) -> None:
        self.drafter = drafter
        self.session = session
        self.relay = relay  # RelayClient
        self.target, self.token = target, token
        self.key, self.gamma, self.depth, self.pit = key, gamma, depth, pit
        self.match = session.params.greedy  # greedy followers keep the bonus
        self.chain: list[Block] = []  # [0]: the block whose verdict comes next
        self.target_cursor: Cursor | None = None  # the one chain[0] runs from

    def first(self, cursor: Cursor, target_cursor: Cursor, drafts, left: int) -> Block:
        """The propose's own block (index 0), before it is relayed."""
        _, seed, u = pipeline_draws(self.key, 0, False, len(drafts))
        block = Block(0, False, list(drafts), cursor, left, seed, u)
        self.chain, self.target_cursor = [block], target_cursor
        return block

    async def run(self) -> None:
        """Draft ahead, settle each verdict, until no more tokens are wanted."""
        try:
            while self.chain:
                while len(self.chain) <= self.depth and await self._follow(self.chain[-1]):
                    pass
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
        draft_seed, seed, u = pipeline_draws(self.key, b.index + 1, True, g)
        start = ahead(b.draft, b.drafts)
        tokens, qs = await self._draft(start, g + match, draft_seed)
        first = tokens[0] if match else None
        cursor = Cursor(b.draft.end + len(b.drafts), (first,)) if match else start
        nxt = Block(
            b.index + 1, True, tokens[match:], cursor, b.left - len(b.drafts) - match, seed, u
        )
        nxt.first = first
        chain = target_pb2.Chain(after_seed=b.seed, uniforms=b.u, match=match)
        if match:
            chain.first_token = first
        if not await self._relay(nxt, qs[match:], chain):
            return False
        metrics.PIPELINE_BLOCKS.labels("follower").inc()
        self.chain.append(nxt)
        return True

    async def _settle(self, b: Block, verdict: Verdict) -> None:
        """Settle ``b`` as the caller will; after a rejection, relay the next block."""
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
        if outcome.chained:  # the target is verifying the next block already
            self.chain.pop(0)
            return
        self.chain = []
        g = pipeline_gamma(left, self.gamma)
        if not g:
            return
        draft_seed, seed, u = pipeline_draws(self.key, b.index + 1, False, g)
        tokens, qs = await self._draft(outcome.draft, g, draft_seed)
        fresh = Block(b.index + 1, False, tokens, outcome.draft, left, seed, u)
        after = target_pb2.Chain(after_seed=b.seed, after_rejection=True)
        if await self._relay(fresh, qs, after, cursor=outcome.target):
            metrics.PIPELINE_BLOCKS.labels("fresh").inc()
            self.chain = [fresh]

    async def _draft(self, cursor: Cursor, gamma: int, seed: int):
        d = self.drafter
        d.roll_back_to(self.session, cursor.cache_len)
        proposal = await d.run(d._draft(self.session, list(cursor.pending), gamma, seed), "propose")
        return proposal.tokens, proposal.qs

    async def _relay(self, b: Block, qs, chain, cursor: Cursor | None = None) -> bool:
        request = target_pb2.RelayedVerify(relay_token=self.token)
        v = request.verify
        v.seed, v.pipeline, v.return_pit = b.seed, self.key, self.pit
        v.chain.CopyFrom(chain)
        if cursor is not None:
            v.cache_len, v.pending_tokens[:] = cursor.cache_len, cursor.pending
        v.draft_tokens[:] = b.drafts
        v.draft_q.CopyFrom(pack_q(qs))
        sent, _ = await self.relay.send(self.target, request, b.echo)
        return sent
