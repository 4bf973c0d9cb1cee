"""The target model's domain: sessions plus verification.

One forward pass over the pending tokens and the drafts gives p at every
drafted position and one past them; ``specdec.sampling.verify_draft`` turns
that into p_i(x_i), q_i(x_i), a residual draw per position and a bonus draw.
The orchestrator decides acceptance with its own uniforms.
Not for: gRPC (``target_service.servicer``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec import metrics, tracing
from specdec.config import MAX_GAMMA
from specdec.errors import FailedPrecondition, require
from specdec.model_service import ModelService
from specdec.rng import uniforms
from specdec.runtime.forward_loop import Job
from specdec.runtime.ragged import Feed
from specdec.sampling import (
    SparseQ,
    Verdict,
    accepted_count,
    drafted_probs,
    greedy_tokens,
    step_tokens,
    verify_draft,
)
from specdec.sessions import Session


def _own(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as a session keeps them past its pass. A session's rows out of a pass it
    shared are a view of the pass's logits ([every session's tokens, vocab]), which
    they would keep alive whole until the session's next pass: some hundreds of MB a
    session at a 152k vocabulary under load. Then the last row (all that is read
    later) is copied; a pass of its own is kept as it is (no torch call right after
    the forward, see ``LastLogits``)."""
    if rows.untyped_storage().nbytes() > rows.nbytes:
        return rows[-1:].clone()
    return rows


@dataclass
class LastLogits:
    """The logits a session's last pass computed after its last token: p for the
    next position, kept so that a draft verified right after a fully accepted one
    needs no pending token (overlapped speculation). The pass's rows are kept whole
    and the last one taken only when used: right after a forward each torch call
    costs tens of microseconds (the pass evicted the caches)."""

    rows: torch.Tensor | None = None  # [n, vocab]; the last row is the one kept
    length: int = -1  # the cache length they follow
    # The session's last verify, as a pipelined block that follows it is judged
    # (``target_service.servicer``).
    verify: Any = None
    ahead: Ahead | None = None  # greedy, pipelined: the target's own continuation


@dataclass
class Ahead:
    """Greedy, in a pipeline: the target's own continuation from the cursor its last
    verdict left, (``cache_len``, ``fed[0]``), decoded a token a pass while no block
    waits (``Verifier.decode_ahead``). ``rows[j]`` are the logits after ``fed[j]``,
    and ``fed[j + 1]`` is their argmax; ``fed[:len(rows)]`` are in the cache.

    Why the verdict does not change: a greedy verify of x_1..x_gamma from that cursor
    accepts x_i while it equals the argmax of the p before it and answers the first
    other position with that argmax. Where x_1..x_j equal fed[1..j], the p before
    each of them is ``rows`` (the same tokens after the same cache), so the verify
    reads those rows instead of computing them again; a rejection among them is
    answered with no forward pass at all."""

    cache_len: int
    fed: list[int]
    rows: list[torch.Tensor] = field(default_factory=list)  # each [1, vocab]
    hold: bool = False  # run no pass: a block is likely on its way (``begin_ahead``)


class Verifier(ModelService):
    """Sessions of the target model, and verification."""

    def __init__(self, cfg, model=None, tokenizer=None) -> None:
        super().__init__("target", cfg, model, tokenizer)
        self.eos = frozenset(self.info.eos_token_ids)  # a plain run ends after one
        for outcome in ("kept", "redrawn"):  # 0 on dashboards, not nothing
            metrics.RESIDUAL_GUESSES.labels(outcome)
        for outcome in ("decoded", "used"):
            metrics.LOOKAHEAD_TOKENS.labels(outcome)
        for kind in ("decode", "verify"):  # the passes that may take more threads
            metrics.WIDE_PASSES.labels("target", kind)

    async def open(self, session_id: str, tokens, params, extra=None) -> Session:
        return await super().open(session_id, tokens, params, extra=LastLogits())

    def _prefill(self, session: Session, tokens: list[int]) -> Job:
        """The prompt, keeping p for the next position (``SessionOpened.next_logits``):
        a first step that drafts nothing then needs no pass of its own before its
        first token, as ``generate()`` draws its first token from the prefill."""
        logits = yield Feed(session.kv, tokens, 1)  # [1, vocab]
        last: LastLogits = session.extra
        last.rows, last.length = _own(logits), session.length

    def check_verify(self, session: Session, cache_len: int, pending, drafts) -> tuple[list, list]:
        """Validated pending and drafted tokens (before anything changes)."""
        pending = self.check_tokens("pending_tokens", pending)
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
        pit: bool = False,
        run: int = 1,
        guesses: Sequence[int] = (),
        draft_idle: bool = False,
    ) -> Verdict:
        """Roll back to ``cache_len``, then one forward over pending + drafts (a plain
        run of ``run`` tokens: one forward per token). ``guesses``: the draft's guesses
        of the residual draws (``Verify.guess_tokens``; ignored for greedy requests).
        ``draft_idle``: the caller's draft does no work meanwhile (``Verify.draft_idle``):
        the pass may take more threads (``ForwardLoop.threads``)."""
        pending, drafts = self.check_verify(session, cache_len, pending, drafts)
        require(
            len(qs) == len(drafts),
            "draft_q",
            f"needs one distribution per drafted token ({len(drafts)}), got {len(qs)}",
        )
        guesses = [] if session.params.greedy else self.check_guesses(guesses, drafts, qs)
        run = max(run, 1)
        if run > 1:
            require(
                not drafts and not dense_p,
                "run_tokens",
                "a run is plain decoding: no draft_tokens and no return_dense_p",
            )
            require(run <= MAX_GAMMA, "run_tokens", f"at most {MAX_GAMMA}, got {run}")
            self.check_room("run_tokens", cache_len + len(pending) + run - 1)
        start = time.perf_counter()
        last: LastLogits = session.extra
        ahead, last.ahead = last.ahead, None
        if (
            ahead is not None
            and ahead.rows
            and session.params.greedy
            and run == 1
            and not dense_p
            and (cache_len, list(pending)) == (ahead.cache_len, ahead.fed[:1])
        ):
            verdict = await self._verify_ahead(session, ahead, drafts, qs)
        else:
            if not pending and (last.length != cache_len or last.rows is None):
                raise FailedPrecondition(
                    f"pending_tokens: empty, but the session's last pass did not end at "
                    f"cache_len {cache_len} (it ended at {last.length})"
                )
            self.roll_back_to(session, cache_len)
            kind = "verify" if drafts else "decode"
            verdict = await self.run(
                self._verify(session, pending, drafts, qs, seed, dense_p, pit, run, guesses),
                kind,
                wide=draft_idle,
            )
        verdict.compute_s = time.perf_counter() - start
        return verdict

    def check_guesses(
        self, guesses: Sequence[int], drafts: list[int], qs: list[SparseQ]
    ) -> list[int]:
        """Validated ``guess_tokens``: at most one per drafted token, each -1 (none) or
        a token that q_i without x_i can draw (``sampling.guess_from``)."""
        guesses = [int(y) for y in guesses]
        require(
            len(guesses) <= len(drafts),
            "guess_tokens",
            f"at most one per drafted token ({len(drafts)}), got {len(guesses)}",
        )
        for i, y in enumerate(guesses):
            if y < 0:
                continue
            x, q = drafts[i], qs[i]
            require(
                y < self.vocab_size and y != x and q.prob(y) > 0 and q.prob(x) < 1,
                "guess_tokens",
                f"[{i}] = {y}: not a token that draft_q[{i}] without draft_tokens[{i}] "
                f"({x}) can draw",
            )
        return guesses

    def after_verdict(
        self, session: Session, end: int, drafts: list[int], verdict: Verdict, alternates
    ) -> None:
        """A pipelined verify from a cursor ending at ``end`` sent ``verdict``: with
        ``lookahead_tokens``, greedy, begin the continuation from where it leaves the
        target, held if it drew the draft's second choice there (``alternates``)."""
        if not self.cfg.lookahead_tokens or not session.params.greedy:
            return
        n = accepted_count(verdict.p_draft, verdict.q_draft, [0.0] * len(drafts))  # p is 1 or 0
        token = step_tokens(drafts, n, verdict.residual_tokens, verdict.bonus_token)[-1]
        hold = n < len(alternates) and alternates[n] == token
        self.begin_ahead(session, end + n, token, hold)

    def begin_ahead(self, session: Session, cache_len: int, token: int, hold: bool) -> None:
        """Greedy, pipelined: the verdict just sent left the target's cursor at
        (``cache_len``, ``token``); decode from there while no block waits, unless
        ``hold``: the draft's guess for this rejection may be on its way, and a pass
        under way when it comes would hold it up (passes run on the event loop)."""
        a: Ahead | None = session.extra.ahead
        if a is not None and (a.cache_len, a.fed[0]) == (cache_len, token):
            a.hold = hold  # the rest of the continuation it answered from
            return
        if self.cfg.lookahead_tokens and session.params.greedy and token not in self.eos:
            session.extra.ahead = Ahead(cache_len, [token], hold=hold)

    async def decode_ahead(self, session: Session) -> bool:
        """Decode the session's next token of its own continuation (``Ahead``), if it
        has one with room for more; returns whether it ran a pass."""
        a: Ahead | None = session.extra.ahead
        if a is None or a.hold or len(a.rows) >= self.cfg.lookahead_tokens:
            return False
        if a.fed[-1] in self.eos:
            return False
        at = a.cache_len + len(a.rows)  # the cache holds fed[:len(rows)] after cache_len
        if at + 1 > self.max_context or at > session.length:
            session.extra.ahead = None
            return False
        self.roll_back_to(session, at)  # (the first time: the verify's rejected drafts)
        # (not "decode": the draft works meanwhile, on the next blocks)
        logits, _ = await self.run(self._feed(session, a.fed[-1:]), "lookahead")  # [1, vocab]
        metrics.labelled(metrics.LOOKAHEAD_TOKENS, "decoded").inc()
        if session.extra.ahead is a:
            a.rows.append(_own(logits))
            a.fed.append(int(greedy_tokens(logits)[0]))
        return True

    async def _verify_ahead(self, session: Session, a: Ahead, drafts, qs) -> Verdict:
        """A greedy verify from the cursor ``a`` starts at (see ``Ahead``)."""
        gamma, k, t = len(drafts), len(a.rows), a.fed[1:]  # t: the argmax after each row
        last: LastLogits = session.extra
        end = a.cache_len + 1 + gamma  # the cache length a verify reports
        i = next((i for i in range(min(gamma, k)) if drafts[i] != t[i]), None)
        if i is not None or gamma < k:  # the verdict is all in the rows: no pass
            # x_{i+1} rejected, or every draft accepted and the bonus known: the target
            # goes on from t[n] (n: the tokens accepted), and its continuation after
            # that is the rest of this one, already in the cache.
            n = gamma if i is None else i
            metrics.labelled(metrics.LOOKAHEAD_TOKENS, "used").inc(n + 1)
            # Positions past the first rejection are never read (residual_tokens is used
            # only there, bonus_token only if none is rejected); they repeat its token.
            verdict = Verdict(
                p_draft=[1.0] * n + [0.0] * (gamma - n),
                q_draft=drafted_probs(qs, drafts),
                residual_tokens=t[:n] + [t[n]] * (gamma - n),
                bonus_token=t[n],
            )
            last.ahead = Ahead(a.cache_len + 1 + n, a.fed[n + 1 :], a.rows[n + 1 :])
            last.rows, last.length = None, -1  # (no pass ended at the reported length)
            verdict.cache_len = end
            return verdict
        # x_1..x_k are the rows' tokens: feed x_k..x_gamma for the rest
        metrics.labelled(metrics.LOOKAHEAD_TOKENS, "used").inc(k)
        more, forward = await self.run(self._feed(session, drafts[k - 1 :]), "verify")
        logits = torch.cat([*a.rows, more])  # [gamma + 1, vocab]
        last.rows, last.length = logits, session.length
        verdict = verify_draft(logits, drafts, qs, session.params, None)
        verdict.cache_len = session.length
        verdict.forward_s, verdict.batch_tokens = forward.seconds, forward.tokens
        return verdict

    def _feed(self, session: Session, tokens: list[int]) -> Job:
        logits = yield Feed(session.kv, tokens, len(tokens))  # [len(tokens), vocab]
        return logits, self.loop.last_batch

    def roll_back_to(self, session: Session, cache_len: int) -> int:
        removed = super().roll_back_to(session, cache_len)
        if removed:  # the kept logits followed a token that is gone now
            session.extra.length = -1
        return removed

    def _verify(self, session, pending, drafts, qs, seed, dense_p, pit, run=1, guesses=()) -> Job:
        gamma = len(drafts)
        last: LastLogits = session.extra
        forward = None
        if pending:
            logits = yield Feed(session.kv, pending + drafts, gamma + 1)  # [gamma + 1, vocab]
            forward = self.loop.last_batch
        else:  # p for x_1 was computed by the last pass
            rows = [last.rows[-1:]]
            if gamma:
                rows.append((yield Feed(session.kv, drafts, gamma)))  # [gamma, vocab]
                forward = self.loop.last_batch
            logits = torch.cat(rows)  # [gamma + 1, vocab]
        last.rows, last.length = _own(logits), session.length
        pit = pit and not session.params.greedy
        n = max(gamma + 1, run)
        # Greedy draws nothing (p is one-hot): no uniforms. A guess's uniform follows
        # the draws' (the draws stay those of a verify without guesses).
        u = None if session.params.greedy else uniforms(seed, n + len(guesses))
        verdict = verify_draft(
            logits,
            drafts,
            qs,
            session.params,
            None if u is None else u[: gamma + 1],
            keep_p=dense_p,
            pit=pit,
            guesses=guesses,
            u_keep=None if u is None else u[n:],
        )
        tracing.mark("judged")
        for y, z in zip(guesses, verdict.residual_tokens, strict=False):
            if y >= 0:  # (a draw not kept is never the guess: h(y) = 0 there)
                metrics.labelled(metrics.RESIDUAL_GUESSES, "kept" if z == y else "redrawn").inc()
        passes = [forward] if forward is not None else []
        # A plain run: feed each draw and draw the next from the p after it.
        token = verdict.bonus_token
        for i in range(1, run):
            if token in self.eos:
                break
            logits = yield Feed(session.kv, [token], 1)  # [1, vocab]
            passes.append(self.loop.last_batch)
            last.rows, last.length = _own(logits), session.length
            draw = verify_draft(
                logits, [], [], session.params, None if u is None else u[i : i + 1], pit=pit
            )
            token = draw.bonus_token
            verdict.run_tokens.append(token)
            if pit:
                verdict.mass_above += draw.mass_above
                verdict.p_at += draw.p_at
        verdict.cache_len = session.length
        if passes:
            verdict.forward_s = sum(b.seconds for b in passes)
            verdict.batch_tokens = round(sum(b.tokens for b in passes) / len(passes))
            verdict.wide = all(b.wide for b in passes)
        return verdict
