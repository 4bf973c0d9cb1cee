"""The target model's domain: sessions plus verification.

One forward pass over the pending tokens and the drafts gives p at every
drafted position and one past them; ``specdec.sampling.verify_draft`` turns
that into p_i(x_i), q_i(x_i), a residual draw per position and a bonus draw.
The orchestrator decides acceptance with its own uniforms.
Not for: gRPC (``target_service.servicer``).
"""

from __future__ import annotations

from specdec.errors import require
from specdec.model_service import MAX_GAMMA, ModelService
from specdec.rng import uniforms
from specdec.runtime.forward_loop import Job
from specdec.runtime.ragged import Feed
from specdec.sampling import SparseQ, Verdict, verify_draft
from specdec.sessions import Session


class Verifier(ModelService):
    """Sessions of the target model, and verification."""

    def __init__(self, cfg, model=None, tokenizer=None) -> None:
        super().__init__("target", cfg, model, tokenizer)

    def check_verify(self, session: Session, cache_len: int, pending, drafts) -> tuple[list, list]:
        """Validated pending and drafted tokens (before anything changes)."""
        pending = self.check_tokens("pending_tokens", pending, min_len=1)
        drafts = self.check_tokens("draft_tokens", drafts)
        require(len(drafts) <= MAX_GAMMA, "draft_tokens", f"at most {MAX_GAMMA} drafted tokens")
        self.check_room("draft_tokens", cache_len + len(pending) + len(drafts))
        return pending, drafts

    async def verify(
        self,
        session: Session,
        cache_len: int,
        pending,
        drafts,
        qs: list[SparseQ],
        seed: int,
        dense_p: bool = False,
    ) -> Verdict:
        """Roll back to ``cache_len``, then one forward over pending + drafts."""
        pending, drafts = self.check_verify(session, cache_len, pending, drafts)
        require(
            len(qs) == len(drafts),
            "draft_q",
            f"needs one distribution per drafted token ({len(drafts)}), got {len(qs)}",
        )
        self.roll_back_to(session, cache_len)
        kind = "verify" if drafts else "decode"
        verdict = await self.run(self._verify(session, pending, drafts, qs, seed, dense_p), kind)
        self.sessions.update_gauges()
        return verdict

    def _verify(self, session, pending, drafts, qs, seed, dense_p) -> Job:
        gamma = len(drafts)
        logits = yield Feed(session.kv, pending + drafts, gamma + 1)  # [gamma + 1, vocab]
        verdict = verify_draft(
            logits, drafts, qs, session.params, uniforms(seed, gamma + 1), keep_p=dense_p
        )
        verdict.cache_len = session.length
        return verdict
