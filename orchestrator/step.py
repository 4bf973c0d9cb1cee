"""One speculation step, as a pure function over domain values.

Read it against the seed (Leviathan et al. 2023, algorithm 1):

    proposal  = x_1..x_gamma, each drawn from q_i          (the draft)
    verdict   = p_i(x_i), q_i(x_i), residual draws, bonus   (the target, one pass)
    n         = accepted_count(p, q, u)                     (here, with our uniforms)
    emitted   = x_1..x_n, then residual_{n+1} or the bonus

and each model service's **cursor** moves: a cursor is what that service's
cache holds of the request's history (its first ``cache_len`` tokens),
followed by the tokens it has not been fed yet (``pending``). The next call
to the service sends the cursor, so a rollback costs no round trip: the
service trims its cache to ``cache_len`` and feeds ``pending``.

No I/O, no protobuf, no clock: the engine (``orchestrator.engine``) does the
calling, this module only decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.config import MAX_GAMMA
from specdec.rng import Philox, seeds
from specdec.sampling import Verdict, accepted_count, step_tokens


@dataclass(frozen=True)
class Cursor:
    """What a service's cache holds of the history, and what it has yet to see."""

    cache_len: int  # the cache holds history[:cache_len]
    # history[cache_len:], not fed yet. Empty only for a target whose last pass
    # ended at cache_len with every token accepted: it kept p for the next position.
    pending: tuple[int, ...]

    @classmethod
    def fresh(cls, history: Sequence[int]) -> Cursor:
        """A session prefilled with all of the history but its last token (a draft's;
        a target's keeps p after the whole history, ``SessionOpened.next_logits``)."""
        return cls(len(history) - 1, (history[-1],))

    @property
    def end(self) -> int:
        """Length of the history this cursor stands for."""
        return self.cache_len + len(self.pending)


@dataclass(frozen=True)
class StepOutcome:
    """What one step decided."""

    tokens: list[int]  # emitted: x_1..x_n, then the residual or bonus draw
    drafted: int  # gamma of this step (0: no draft)
    accepted: int  # n
    target: Cursor  # the target's cursor after the step
    draft: Cursor | None  # the draft's (None: it has no session)
    # The block drafted ahead is the next proposal (overlapped speculation): it took
    # the bonus position (``chain``), or its first token equals the bonus (``ahead_first``).
    chained: bool = False
    # It emitted a residual or bonus draw; False when the next block's first draft
    # takes the bonus position instead (``chain``).
    bonus: bool = True


def ahead(draft: Cursor, drafts: Sequence[int]) -> Cursor:
    """The draft's cursor for drafting on past x_gamma, as if every draft will be
    accepted: it has fed its pending tokens and x_1..x_{gamma-1}; x_gamma is next."""
    return Cursor(draft.end + len(drafts) - 1, (drafts[-1],))


def settle(
    target: Cursor,
    draft: Cursor | None,
    drafts: Sequence[int],
    verdict: Verdict,
    u: Sequence[float],
    chain: bool = False,
    ahead_first: int | None = None,
) -> StepOutcome:
    """Accept or reject the drafts and move both cursors.

    target, draft: the cursors the proposal and the verdict were made from;
    drafts: x_1..x_gamma (empty for a plain decoding step, which may emit a run of
    tokens: the bonus, then ``verdict.run_tokens``); u: [gamma] uniforms.
    ``chain``: a next proposal was drafted ahead (``ahead``) and may take the
    bonus position: if every draft is accepted, no bonus token is emitted; the
    next proposal's first token is tested at that position against the p the
    target already computed (overlapped speculation, docs/exactness.md).
    ``ahead_first``: the first token y_1 of a block drafted ahead one token longer
    (greedy overlap): if every draft is accepted and the bonus equals y_1, the step
    emits as a sequential one and y_2.. become the next proposal, drafted from the
    draft cursor this returns (``chained``).
    """
    gamma = len(drafts)
    n = accepted_count(verdict.p_draft, verdict.q_draft, u)
    if chain and gamma and n == gamma:
        # The target fed every draft and kept p for the next position: nothing pending.
        return StepOutcome(
            list(drafts),
            gamma,
            n,
            Cursor(target.end + n, ()),
            ahead(draft, drafts),
            chained=True,
            bonus=False,
        )
    emitted = step_tokens(list(drafts), n, verdict.residual_tokens, verdict.bonus_token)
    run = [] if gamma else list(verdict.run_tokens)  # a plain run's further draws
    emitted += run
    # The target fed its pending tokens and every draft (the first n stay valid), or
    # in a plain run every draw but the last.
    new_target = Cursor(target.end + n + len(run), (emitted[-1],))
    matched = draft is not None and gamma > 0 and n == gamma and verdict.bonus_token == ahead_first
    if draft is None:
        new_draft = None
    elif matched:
        # Drafting ahead fed x_gamma and y_1 (the bonus) too: y_2.. were drafted after it.
        new_draft = Cursor(draft.end + gamma, (verdict.bonus_token,))
    elif gamma:
        # The draft fed its pending tokens and x_1..x_{gamma-1} (x_gamma never): of
        # those, the first min(n, gamma - 1) drafts stay valid.
        kept = min(n, gamma - 1)
        new_draft = Cursor(draft.end + kept, tuple(drafts[kept:n]) + (emitted[-1],))
    else:  # the draft saw nothing this step
        new_draft = Cursor(draft.cache_len, draft.pending + tuple(emitted))
    return StepOutcome(emitted, gamma, n, new_target, new_draft, chained=matched)


# ---- pipelined speculation ------------------------------------------------------------
# The draft service paces the steps (``draft_service.pipeline``), the target runs a
# block that follows one accepted in full without being asked (``Verify.chain``), and
# the engine settles the verdicts as they come (``Engine.follow``). All three agree
# on every step's draws and on which blocks exist from these two functions alone.


# The kinds of block a pipelined step may verify: drafted after the step before was
# settled with a rejection (FRESH), drafted ahead as if that step accepted every
# draft (FOLLOWER), or drafted before its verdict for one rejection (GUESS, greedy).
FRESH, FOLLOWER, GUESS = 0, 1, 2


def pipeline_draws(key: int, index: int, kind: int, n: int) -> tuple[int, int, list[float]]:
    """Step ``index``'s draws in the pipeline keyed by ``key``: the draft's seed, the
    verify's seed and the n uniforms of its acceptance test. Each kind of block
    (``FRESH``, ``FOLLOWER``, ``GUESS``) has a stream of its own; at most one block
    of a step is ever verified, and which one depends only on the step before, never
    on these draws."""
    rng = Philox(key, jumps=2 + 3 * index + int(kind))
    return rng.next64(), rng.next64(), rng.random(n)


def paced_draws(rng: Philox, n: int) -> tuple[int, int, list[float]]:
    """A paced step's draws from the request's own stream (``orchestrator.paced``), in
    the order an asked step (``Generation.step``) draws them: a seed it does not use
    (an asked step's block drafted ahead), the verify's seed, the next step's draft
    seed, then the n uniforms of its acceptance test. The orchestrator and the draft
    each draw these from their copy of the stream, so they agree without a message."""
    _, seed, next_draft_seed = seeds(rng, 3)
    return seed, next_draft_seed, rng.random(n)


def pipeline_gamma(left: int, gamma: int, match: bool = False) -> int:
    """Drafts of the next pipelined block when ``left`` tokens are still wanted
    before it (0: the pipeline drafts no more). ``match``: a greedy block that
    follows another is drafted one token longer (its first token is the bonus)."""
    return max(0, min(gamma, left - 1, MAX_GAMMA - int(match)))


def guess_holds(drafts: int, verdict: Verdict, u, rejected_at: int, token: int) -> bool:
    """Whether a greedy guess block is the step after this verdict: the verdict
    rejected draft ``rejected_at`` (1-based; the ones before it accepted) and drew
    ``token`` there (the target's test of ``Chain.rejected_at``)."""
    n = accepted_count(verdict.p_draft, verdict.q_draft, u)
    return n < drafts and n == rejected_at - 1 and verdict.residual_tokens[n] == token


def follows_in_full(target_end: int, drafts: int, verdict: Verdict, u, match: bool, first: int):
    """The cursor a block that follows this step's starts from if every one of its
    ``drafts`` is accepted (with ``match``, and the bonus is ``first``), else None:
    the target's test of ``Verify.chain``, the same as ``settle``'s."""
    if not drafts or accepted_count(verdict.p_draft, verdict.q_draft, u) != drafts:
        return None
    if match:
        return Cursor(target_end + drafts, (first,)) if verdict.bonus_token == first else None
    return Cursor(target_end + drafts, ())
