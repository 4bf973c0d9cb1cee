"""The draft model's domain: sessions plus proposing.

Each drafted token is sampled from q, the draft's warped distribution turned
into a ``SparseQ`` (its most likely tokens with integer counts, the rest of
the mass spread over every other token); that SparseQ is exactly what goes on
the wire, so the orchestrator's acceptance test stays exact.
Not for: gRPC (``draft_service.servicer``).
"""

from __future__ import annotations

import time

from specdec.config import MAX_GAMMA
from specdec.errors import require
from specdec.model_service import ModelService
from specdec.rng import generator
from specdec.runtime.forward_loop import Job
from specdec.runtime.ragged import Feed
from specdec.sampling import Proposal, SamplingParams, SparseQ, draft_position
from specdec.sessions import Session
from specdec.wire import WireShape


class Drafter(ModelService):
    """Sessions of the draft model, and drafting."""

    def __init__(self, cfg, model=None, tokenizer=None) -> None:
        super().__init__("draft", cfg, model, tokenizer)

    async def open_draft(
        self, session_id: str, tokens, params: SamplingParams, shape: WireShape
    ) -> Session:
        return await self.open(session_id, tokens, params, extra=shape.check())

    async def propose(
        self, session: Session, cache_len: int, append, gamma: int, seed: int
    ) -> Proposal:
        """Roll back to ``cache_len``, feed ``append``, draft ``gamma`` tokens."""
        require(1 <= gamma <= MAX_GAMMA, "gamma", f"must be in [1, {MAX_GAMMA}], got {gamma}")
        feed = self.check_tokens("append_tokens", append, min_len=1)
        self.check_room("gamma", cache_len + len(feed) + gamma)
        start = time.perf_counter()
        self.roll_back_to(session, cache_len)
        proposal = await self.run(self._draft(session, feed, gamma, seed), "propose")
        self.sessions.update_gauges()
        proposal.compute_s = time.perf_counter() - start
        return proposal

    def _draft(self, session: Session, feed: list[int], gamma: int, seed: int) -> Job:
        """gamma forwards, each drawing x_i from its q_i; x_gamma is not fed."""
        rng = None if session.params.greedy else generator(seed)  # greedy: no draws
        shape: WireShape = session.extra
        tokens: list[int] = []
        qs: list[SparseQ] = []
        forward_s = batch_tokens = 0.0
        for _ in range(gamma):
            logits = yield Feed(session.kv, feed, 1)  # [1, vocab]
            forward_s += self.loop.last_batch.seconds
            batch_tokens += self.loop.last_batch.tokens
            x, q = draft_position(
                logits[0], session.params, shape.max_entries, shape.eps, shape.bits, rng
            )
            tokens.append(x)
            qs.append(q)
            feed = [x]
        return Proposal(
            tokens, qs, session.length, forward_s=forward_s, batch_tokens=batch_tokens / gamma
        )
