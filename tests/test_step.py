"""The pure step (orchestrator.step): cursors move as the seed says, under any
sequence of accepts, rejects, chained blocks and lost sessions (hypothesis),
and the engine drives it through scripted ports."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.step import Cursor, ahead, settle
from specdec.sampling import Verdict


def verdict(drafts, accept_upto: int, residual: int = 900, bonus: int = 901) -> Verdict:
    """A verdict accepting the first ``accept_upto`` drafts (p = q = 1 for them, p = 0
    at the first rejected one)."""
    gamma = len(drafts)
    p = [1.0 if i < accept_upto else 0.0 for i in range(gamma)]
    return Verdict(
        p_draft=p,
        q_draft=[1.0] * gamma,
        residual_tokens=[residual + i for i in range(gamma)],
        bonus_token=bonus,
    )


def test_a_rejection_emits_the_accepted_drafts_and_the_residual():
    target, draft = Cursor(10, (7,)), Cursor(9, (6, 7))
    out = settle(target, draft, [1, 2, 3], verdict([1, 2, 3], 1), [0.5, 0.5, 0.5])
    assert out.tokens == [1, 901]  # x_1, then the residual drawn at position 2
    assert out.accepted == 1 and not out.chained
    # The target fed 7, 1, 2, 3: keeps 7 and x_1, then the residual is pending.
    assert out.target == Cursor(12, (out.tokens[-1],))
    # The draft fed 6, 7, 1, 2 (x_3 never): keeps 6, 7 and x_1.
    assert out.draft == Cursor(12, (out.tokens[-1],))


def test_all_accepted_emits_the_bonus_or_chains():
    target, draft = Cursor(10, (7,)), Cursor(10, (7,))
    out = settle(target, draft, [1, 2, 3], verdict([1, 2, 3], 3), [0.1] * 3)
    assert out.tokens == [1, 2, 3, 901] and out.target == Cursor(14, (901,))
    assert out.draft == Cursor(13, (3, 901))  # x_3 was never fed to the draft
    chained = settle(target, draft, [1, 2, 3], verdict([1, 2, 3], 3), [0.1] * 3, chain=True)
    assert chained.tokens == [1, 2, 3] and chained.chained
    assert chained.target == Cursor(14, ())  # p after x_3 is kept: nothing pending
    assert chained.draft == ahead(draft, [1, 2, 3]) == Cursor(13, (3,))


def test_a_block_drafted_ahead_whose_first_token_is_the_bonus_is_the_next_proposal():
    """Greedy overlap: the draft drafted y_1..y_4 after x_3 (feeding x_3, y_1..y_3).
    If y_1 is the bonus, the step emits as a sequential one and y_2..y_4 are a draft
    from the history it leaves: the draft's cursor stands right after x_3."""
    target, draft = Cursor(10, (7,)), Cursor(10, (7,))
    v = verdict([1, 2, 3], 3, bonus=901)
    out = settle(target, draft, [1, 2, 3], v, [0.1] * 3, ahead_first=901)
    assert out.tokens == [1, 2, 3, 901] and out.chained and out.bonus
    assert out.target == Cursor(14, (901,))
    assert out.draft == Cursor(14, (901,))  # y_2.. were drafted from here
    missed = settle(target, draft, [1, 2, 3], v, [0.1] * 3, ahead_first=902)
    assert missed.tokens == [1, 2, 3, 901] and not missed.chained
    assert missed.draft == Cursor(13, (3, 901))  # as a sequential step: roll back
    rejected = settle(target, draft, [1, 2, 3], verdict([1, 2, 3], 2), [0.1] * 3, ahead_first=901)
    assert not rejected.chained and rejected.tokens == [1, 2, 902]


# ---- invariants under random sequences -------------------------------------------------
step_kinds = st.sampled_from(
    ["draft", "plain", "lost_target", "lost_draft", "chain", "match", "miss"]
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(step_kinds, st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=30)
)
def test_cursors_always_describe_the_history(steps):
    """After every step: each cursor's cache_len + pending == the history (the target's
    pending may be empty only right after a chained step), and a service fed exactly
    what the cursors say would hold the history's prefix."""
    history = [5, 6, 7]
    target = Cursor.fresh(history)
    draft: Cursor | None = Cursor.fresh(history)
    # What each service has really been fed (simulated caches).
    t_cache, d_cache = history[:-1], history[:-1]
    next_token = 100
    carried: list[int] | None = None  # a block drafted ahead that became the proposal
    for kind, gamma, accept in steps:
        if kind == "lost_target":
            target, t_cache = Cursor.fresh(history), history[:-1]
            continue
        if kind == "lost_draft":
            draft, d_cache, carried = None, [], None
            continue
        if draft is None:
            draft, d_cache = Cursor.fresh(history), history[:-1]
        if carried is not None:  # drafted (and fed to the draft) during the last verify
            drafts, carried = carried, None
        elif kind == "plain":
            drafts = []
        else:
            drafts = list(range(next_token, next_token + gamma))
            d_cache = d_cache[: draft.cache_len] + list(draft.pending) + drafts[:-1]
        next_token += gamma + 2
        n = min(accept, len(drafts))
        v = verdict(drafts, n, residual=next_token, bonus=next_token + 50)
        if not drafts:  # a plain run: `accept` more draws after the bonus
            v.run_tokens = list(range(next_token + 60, next_token + 60 + accept))
        next_token += 100
        if not target.pending:  # chained: the target must have kept p right here
            assert len(t_cache) == target.cache_len
        # The services do what the cursors tell them (a run feeds every draw but its last).
        fed_run = ([v.bonus_token] + v.run_tokens)[:-1] if v.run_tokens else []
        t_cache = t_cache[: target.cache_len] + list(target.pending) + drafts + fed_run
        chain = kind == "chain" and bool(drafts)
        first = None
        if kind in ("match", "miss") and drafts:
            # Draft y_1..y_(gamma+1) ahead, as if every draft will be accepted.
            first = v.bonus_token if kind == "match" else v.bonus_token + 1
            block = [first] + list(range(next_token, next_token + gamma))
            next_token += gamma + 1
            at = ahead(draft, drafts)
            d_cache = d_cache[: at.cache_len] + list(at.pending) + block[:-1]
        out = settle(target, draft, drafts, v, [0.5] * len(drafts), chain=chain, ahead_first=first)
        if first is not None and out.chained:
            carried = block[1:]
        history += out.tokens
        target, draft = out.target, out.draft
        assert target.end == len(history)
        assert t_cache[: target.cache_len] == history[: target.cache_len]
        if draft is not None:
            assert draft.end == len(history) and draft.pending  # the draft keeps no p
            assert d_cache[: draft.cache_len] == history[: draft.cache_len]
        assert out.tokens, "a step always emits"
        assert len(out.tokens) == out.accepted + out.bonus + len(v.run_tokens)
        all_in = bool(drafts) and out.accepted == len(drafts)
        assert out.chained == (all_in and (chain or first == v.bonus_token))


# ---- the engine with scripted ports -----------------------------------------------------
class ScriptedDraft:
    """A draft session that proposes fixed tokens (q = 1 for each)."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script = list(script)
        self.calls: list[Cursor] = []

    async def propose(self, cursor, gamma, seed, timeout):
        from specdec.sampling import Proposal, SparseQ

        self.calls.append(cursor)
        tokens = self.script.pop(0)[:gamma]
        return Proposal(tokens, [SparseQ.point(t, 1000) for t in tokens], compute_s=1e-4)


def test_engine_step_sequence_with_scripted_ports():
    """Three steps against a target that accepts the first two drafts of each step."""
    from orchestrator.step import settle as pure_settle

    async def scenario():
        history = [1, 2, 3]
        target, draft_cursor = Cursor.fresh(history), Cursor.fresh(history)
        draft = ScriptedDraft([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
        for _ in range(3):
            proposal = await draft.propose(draft_cursor, 3, 0, None)
            v = verdict(proposal.tokens, 2, residual=500, bonus=600)
            out = pure_settle(target, draft_cursor, proposal.tokens, v, [0.5] * 3)
            history += out.tokens
            target, draft_cursor = out.target, out.draft
        return history, draft.calls

    history, calls = asyncio.run(scenario())
    assert history == [1, 2, 3, 10, 11, 502, 20, 21, 502, 30, 31, 502]
    # Each proposal starts from the history: rollback rides in cache_len.
    assert [c.end for c in calls] == [3, 6, 9]
    assert calls[1] == Cursor(5, (502,))
