"""Drafting on (``DraftOn``): the draft settles a step from the target's echoed
verdict and drafts the next proposal before the orchestrator asks. A head start
may only ever answer the propose it equals; anything else is drafted anew, and
nothing about it may leak into the cache or outlive the session.

In-process: a real draft and target (the tiny llama pair) on one event loop.
Through gRPC, ``tests/test_relay.py`` checks that drafting on changes no token."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from draft_service.drafter import Drafter
from orchestrator.step import Cursor, ahead, settle
from specdec import metrics
from specdec.config import ModelServiceConfig
from specdec.runtime.loading import load_model, load_tokenizer
from specdec.sampling import SamplingParams, Verdict
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.wire import WireShape
from target_service.verifier import Verifier

PROMPT = [3, 9, 27, 4, 8]
SHAPE = WireShape(16, 0.0, 16)


def _outcome(name: str) -> float:
    return metrics.DRAFTED_ON.labels(name)._value.get()


class Pair:
    """A draft and a target service's domain objects, started on this loop."""

    def __init__(self, pair) -> None:
        draft_dir, target_dir = pair
        tok = load_tokenizer(str(target_dir))
        cfg = ModelServiceConfig(max_batch_tokens=512)
        self.draft = Drafter(cfg, load_model(str(draft_dir)), tok)
        self.target = Verifier(cfg, load_model(str(target_dir)), tok)
        self.draft.start()
        self.target.start()

    async def aclose(self) -> None:
        await self.draft.aclose()
        await self.target.aclose()


async def _first_step(p: Pair, params: SamplingParams, sid: str, gamma: int = 3):
    """Open both sessions and run one step by hand: (draft session, draft cursor,
    drafts, verdict)."""
    d = await p.draft.open_draft(sid, PROMPT[:-1], params, SHAPE)
    t = await p.target.open(sid, PROMPT[:-1], params)
    cursor = Cursor.fresh(PROMPT)
    proposal = await p.draft.propose(d, cursor.cache_len, cursor.pending, gamma, 11)
    verdict = await p.target.verify(
        t, cursor.cache_len, list(cursor.pending), proposal.tokens, proposal.qs, 12
    )
    return d, cursor, proposal.tokens, verdict


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_head_start_answers_exactly_the_propose_it_equals(llama_pair, temperature):
    """The next proposal drafted on an echoed verdict equals the one drafted when
    asked: same tokens, same q, same cache; a shorter ask takes its first tokens.
    It says how long it was drafting before its propose arrived (lead_s), which
    for a block drafted in full before then is its drafting, not the wait after."""
    params = SamplingParams(temperature=temperature)
    u = [0.3, 0.6, 0.9]

    async def go():
        p = Pair(llama_pair)
        try:
            for ask in (3, 2):
                # Reference: the orchestrator's settle, then an ordinary propose.
                ref, cursor, drafts, verdict = await _first_step(p, params, f"ref{ask}")
                nxt = settle(Cursor(0, ()), cursor, drafts, verdict, u).draft
                want = await p.draft.propose(ref, nxt.cache_len, nxt.pending, ask, 21)

                head, cursor, drafts, verdict = await _first_step(p, params, f"head{ask}")
                proposes = head.extra.proposes
                used = _outcome("used")
                p.draft.draft_on(head, proposes, cursor, drafts, verdict, u, 3, 21)
                started = head.extra.head
                assert started is not None
                await asyncio.sleep(0.05)  # the propose comes this long after the echo
                asked = time.perf_counter()
                got = await p.draft.propose(head, nxt.cache_len, nxt.pending, ask, 21)
                answered = time.perf_counter()
                assert _outcome("used") == used + 1
                # How much of its compute came before the propose (the cost model's
                # lead): its drafting, done before the propose came; the 50 ms it then
                # waited is neither lead nor compute.
                drafting = started.finished - started.started
                assert started.finished < asked
                assert want.lead_s == 0.0 and got.lead_s == pytest.approx(drafting, abs=1e-4)
                assert 0.0 <= got.compute_s - got.lead_s <= answered - asked
                assert got.tokens == want.tokens
                assert [(q.ids.tolist(), q.counts.tolist()) for q in got.qs] == [
                    (q.ids.tolist(), q.counts.tolist()) for q in want.qs
                ]
                assert got.cache_len == want.cache_len == head.length == ref.length
        finally:
            await p.aclose()

    asyncio.run(go())


def test_a_head_start_that_is_not_asked_for_is_drafted_anew(llama_pair):
    """Another seed or cursor, or more tokens than drafted: the head start is
    discarded and the propose answered as if it had never been."""
    params = SamplingParams(temperature=1.0)
    u = [0.1, 0.2, 0.3]

    async def go():
        p = Pair(llama_pair)
        try:
            ref, cursor, drafts, verdict = await _first_step(p, params, "ref")
            nxt = settle(Cursor(0, ()), cursor, drafts, verdict, u).draft
            asks = [(nxt.cache_len, nxt.pending, 3, 99), (nxt.cache_len, nxt.pending, 4, 21)]
            wants = []
            for ask in asks:
                wants.append((await p.draft.propose(ref, *ask)).tokens)
            for ask, want in zip(asks, wants, strict=True):
                s, cursor, drafts, verdict = await _first_step(p, params, f"s{ask[2]}{ask[3]}")
                p.draft.draft_on(s, s.extra.proposes, cursor, drafts, verdict, u, 3, 21)
                discarded = _outcome("discarded")
                assert (await p.draft.propose(s, *ask)).tokens == want
                assert _outcome("discarded") == discarded + 1
        finally:
            await p.aclose()

    asyncio.run(go())


def test_a_late_echo_is_skipped_and_a_head_start_never_outlives_its_session(llama_pair):
    """An echo that comes after a newer propose drafts nothing; a rollback waits for
    a head start and drops it; closing a session cancels its head start."""
    params = SamplingParams(temperature=1.0)
    u = [0.5, 0.5, 0.5]

    async def go():
        p = Pair(llama_pair)
        try:
            s, cursor, drafts, verdict = await _first_step(p, params, "late")
            stale = s.extra.proposes
            await p.draft.propose(s, cursor.cache_len, cursor.pending, 2, 5)  # a newer one
            skipped = _outcome("skipped")
            p.draft.draft_on(s, stale, cursor, drafts, verdict, u, 3, 21)
            assert s.extra.head is None and _outcome("skipped") == skipped + 1

            # One whose next step would pass the draft's context drafts nothing either.
            s, cursor, drafts, verdict = await _first_step(p, params, "full")
            limit, p.draft.max_context = p.draft.max_context, cursor.end + 3  # < end + 1 + 3
            try:
                p.draft.draft_on(s, s.extra.proposes, cursor, drafts, verdict, u, 3, 21)
            finally:
                p.draft.max_context = limit
            assert s.extra.head is None and _outcome("skipped") == skipped + 2

            s, cursor, drafts, verdict = await _first_step(p, params, "rolled")
            p.draft.draft_on(s, s.extra.proposes, cursor, drafts, verdict, u, 3, 21)
            assert await p.draft.rollback_draft(s, cursor.cache_len) >= 0
            assert s.extra.head is None and s.length == cursor.cache_len

            s, cursor, drafts, verdict = await _first_step(p, params, "closed")
            p.draft.draft_on(s, s.extra.proposes, cursor, drafts, verdict, u, 3, 21)
            task = s.extra.head.task
            assert p.draft.close(s)
            await asyncio.sleep(0.05)
            assert task.cancelled() or task.done()
            assert p.draft.loop.queued == 0 and len(p.draft.sessions) == 3
        finally:
            await p.aclose()

    asyncio.run(go())


def _verdict(accepted: int, gamma: int = 3) -> Verdict:
    """A verdict accepting the first ``accepted`` drafts (u = 0.5) and rejecting the next."""
    p = [1.0] * accepted + [0.0] * (gamma - accepted)
    return Verdict(p, [0.5] * gamma, [40 + i for i in range(gamma)], 50)


def test_a_step_that_drafts_ahead_drafts_on_only_when_its_block_is_unused(llama_pair):
    """``ahead``: the orchestrator may also ask for the block after x_gamma. On a
    rejection that block is unused: the draft drafts on (after that block, if it is
    being drafted), a propose for it coming after the echo gets no tokens, and the
    next step's propose is answered from the head start exactly as if drafted anew.
    On full acceptance the block drafted ahead may take the next step: no drafting on."""
    params = SamplingParams(temperature=1.0)
    u = [0.5] * 3

    async def go():
        p = Pair(llama_pair)
        try:
            # Reference: the orchestrator's settle of a step rejecting x_2, then a propose.
            d = await p.draft.open_draft("ref", PROMPT[:-1], params, SHAPE)
            cursor = Cursor.fresh(PROMPT)
            drafts = (await p.draft.propose(d, cursor.cache_len, cursor.pending, 3, 11)).tokens
            block = ahead(cursor, drafts)
            want_block = await p.draft.propose(d, block.cache_len, block.pending, 4, 31)
            nxt = settle(Cursor(0, ()), cursor, drafts, _verdict(1), u).draft
            want = await p.draft.propose(d, nxt.cache_len, nxt.pending, 3, 21)

            async def step(sid: str):
                s = await p.draft.open_draft(sid, PROMPT[:-1], params, SHAPE)
                got = await p.draft.propose(s, cursor.cache_len, cursor.pending, 3, 11)
                assert got.tokens == drafts
                return s, s.extra.proposes

            # 1. The echo first: the block asked for afterwards gets no tokens.
            s, n = await step("echo-first")
            p.draft.draft_on(s, n, cursor, drafts, _verdict(1), u, 3, 21, ahead=True)
            assert s.extra.head is not None
            used = _outcome("used")
            empty = await p.draft.propose(s, block.cache_len, block.pending, 4, 31)
            assert empty.tokens == [] and s.extra.head is not None
            got = await p.draft.propose(s, nxt.cache_len, nxt.pending, 3, 21)
            assert _outcome("used") == used + 1
            assert got.tokens == want.tokens and s.length == d.length

            # 2. The block drafted ahead first, still drafting when the echo comes.
            s, n = await step("block-first")
            drafting = asyncio.ensure_future(
                p.draft.propose(s, block.cache_len, block.pending, 4, 31)
            )
            await asyncio.sleep(0)  # it has asked, and its forwards are queued
            p.draft.draft_on(s, n, cursor, drafts, _verdict(1), u, 3, 21, ahead=True)
            assert s.extra.head is not None
            assert (await drafting).tokens == want_block.tokens  # drafted in full, first
            got = await p.draft.propose(s, nxt.cache_len, nxt.pending, 3, 21)
            assert _outcome("used") == used + 2
            assert got.tokens == want.tokens and s.length == d.length

            # 3. Every draft accepted: the block drafted ahead may chain; no drafting on.
            for sid, block_first in (("all-echo-first", False), ("all-block-first", True)):
                s, n = await step(sid)
                if block_first:
                    await p.draft.propose(s, block.cache_len, block.pending, 4, 31)
                skipped = _outcome("skipped")
                p.draft.draft_on(s, n, cursor, drafts, _verdict(3), u, 3, 21, ahead=True)
                assert s.extra.head is None and _outcome("skipped") == skipped + 1
                if not block_first:
                    got = await p.draft.propose(s, block.cache_len, block.pending, 4, 31)
                    assert got.tokens == want_block.tokens
        finally:
            await p.aclose()

    asyncio.run(go())


def test_draft_on_fields_are_validated_by_name(llama_stack):
    """A DraftOn whose uniforms do not match gamma, or whose gamma is out of range,
    is INVALID_ARGUMENT naming the field."""

    async def go():
        async with grpc.aio.insecure_channel(llama_stack.address("draft")) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            cases = [
                (draft_pb2.DraftOn(uniforms=[0.5], gamma=2, seed=1), "relay.draft_on.uniforms"),
                (draft_pb2.DraftOn(uniforms=[0.5] * 2, gamma=0, seed=1), "relay.draft_on.gamma"),
            ]
            for i, (on, field) in enumerate(cases):
                call = stub.Session()
                await call.write(
                    draft_pb2.DraftRequest(
                        open=common_pb2.OpenSession(session_id=f"v{i}", tokens=[1, 2])
                    )
                )
                await call.read()
                relay = draft_pb2.RelayTo(target="127.0.0.1:1", relay_token=b"t" * 16, draft_on=on)
                propose = draft_pb2.Propose(
                    cache_len=1, append_tokens=[2], gamma=2, seed=3, relay=relay
                )
                await call.write(draft_pb2.DraftRequest(propose=propose))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call.read()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field in e.value.details()

    asyncio.run(go())


def test_only_a_block_drafted_ahead_may_come_back_empty():
    """The orchestrator's draft port takes a proposal with no tokens only for a block
    drafted ahead (the draft knew the verdict made it unused); for any other propose
    it is a broken draft, UNAVAILABLE."""
    from orchestrator.ports.remote import RemoteDraftSession
    from specdec.errors import Unavailable

    class Stream:  # answers every propose with no tokens
        counter = None

        async def ask(self, request, timeout, stale=None):
            return draft_pb2.DraftReply(proposal=draft_pb2.Proposal(cache_len=7))

    async def go():
        session = RemoteDraftSession(Stream())
        ahead = await session.propose(Cursor(6, (5,)), 4, 1, None, ahead=True)
        assert ahead.tokens == []
        with pytest.raises(Unavailable, match="sent 0 of 4 tokens"):
            await session.propose(Cursor(6, (5,)), 4, 1, None)

    asyncio.run(go())


# ---- guesses: the next block for a rejection, drafted before the verdict ----------------------


def _guesses(name: str) -> float:
    return metrics.DRAFT_GUESSES.labels(name)._value.get()


async def _ahead_step(p: Pair, sid: str, params: SamplingParams):
    """A session's first proposal (3 tokens), then the block after it asked for ahead
    (4 tokens, as a greedy step asks one more): (session, cursor, first proposal)."""
    s = await p.draft.open_draft(sid, PROMPT[:-1], params, SHAPE)
    cursor = Cursor.fresh(PROMPT)
    first = await p.draft.propose(s, cursor.cache_len, cursor.pending, 3, 11)
    block = ahead(cursor, first.tokens)
    await p.draft.propose(s, block.cache_len, block.pending, 4, 31)
    return s, cursor, first


async def _anew(p: Pair, sid: str, history: list[int], gamma: int):
    """The proposal of a fresh greedy session holding ``history``: what a guess must equal."""
    ref = await p.draft.open_draft(sid, history[:-1], SamplingParams(temperature=0.0), SHAPE)
    return ref, await p.draft.propose(ref, len(history) - 1, history[-1:], gamma, 5)


def test_a_guess_answers_its_rejection_exactly_as_drafted_anew(llama_pair):
    """A greedy step that drafts ahead: when the block after a proposal is asked for,
    the draft also drafts the next block for a rejection at each of the proposal's
    positions, from its second choice there, on a copy of its cache. A propose for
    one of them is answered from it as if drafted anew (tokens, cache length), cut
    to fewer tokens or drafted on to more; the other guesses are dropped."""
    params = SamplingParams(temperature=0.0)

    async def go():
        p = Pair(llama_pair)
        try:
            for pos, ask in ((0, 3), (1, 2), (2, 5)):
                s, cursor, first = await _ahead_step(p, f"g{pos}", params)
                alts = first.alternates
                assert len(alts) == 3 and all(
                    a != x for a, x in zip(alts, first.tokens, strict=True)
                )
                assert sorted(s.extra.guesses) == [(cursor.end + i, (alts[i],)) for i in range(3)]
                # x_{pos+1} rejected, the target's token the draft's second choice
                history = [*PROMPT, *first.tokens[:pos], alts[pos]]
                ref, want = await _anew(p, f"r{pos}", history, ask)
                used, unused = _guesses("used"), _guesses("unused")
                got = await p.draft.propose(s, cursor.end + pos, [alts[pos]], ask, 7)
                assert (_guesses("used"), _guesses("unused")) == (used + 1, unused + 2)
                assert got.tokens == want.tokens and len(got.qs) == ask
                assert got.cache_len == s.length == ref.length == want.cache_len
                assert s.extra.guesses == {} and got.lead_s <= got.compute_s
                # The session goes on from the guess's cache as from its own.
                nxt = Cursor(got.cache_len, (got.tokens[-1],))
                again = await p.draft.propose(s, nxt.cache_len, nxt.pending, 2, 9)
                want_again = await p.draft.propose(ref, nxt.cache_len, nxt.pending, 2, 9)
                assert again.tokens == want_again.tokens
            await asyncio.sleep(0.05)
            assert p.draft.loop.queued == 0
        finally:
            await p.aclose()

    asyncio.run(go())


def test_guesses_that_are_not_asked_for_leave_the_cache_as_it_was(llama_pair):
    """A propose for no guess (another token at the rejected position), a rollback or a
    close drops every guess, and the session drafts from its own cache as if there had
    been none. A sampled request (T > 0) not told the next step's seed has no guesses
    (``test_a_sampled_guess_answers_with_the_next_steps_seed``), nor a step that finds other
    sessions' work waiting for the draft's forwards; the copies of one step stay
    within guess_copy_mb."""

    async def go():
        p = Pair(llama_pair)
        try:
            greedy = SamplingParams(temperature=0.0)
            s, cursor, first = await _ahead_step(p, "other", greedy)
            other = next(t for t in range(p.draft.vocab_size) if t not in first.alternates)
            _, want = await _anew(p, "ref", [*PROMPT, other], 3)
            unused = _guesses("unused")
            got = await p.draft.propose(s, cursor.end, [other], 3, 7)
            assert _guesses("unused") == unused + 3 and s.extra.guesses == {}
            assert got.tokens == want.tokens and s.length == want.cache_len

            # The copies of one step take at most guess_copy_mb: here room for one.
            per_token = s.kv.bytes_per_token()
            p.draft.cfg.guess_copy_mb = 1.5 * cursor.end * per_token / 2**20
            try:
                s, cursor, first = await _ahead_step(p, "budget", greedy)
            finally:
                p.draft.cfg.guess_copy_mb = ModelServiceConfig.guess_copy_mb
            assert list(s.extra.guesses) == [(cursor.end, (first.alternates[0],))]

            s, cursor, _ = await _ahead_step(p, "rolled", greedy)
            assert len(s.extra.guesses) == 3
            await p.draft.rollback_draft(s, cursor.cache_len)
            assert s.extra.guesses == {} and s.length == cursor.cache_len

            s, _, _ = await _ahead_step(p, "closed", greedy)
            tasks = [g.task for g in s.extra.guesses.values()]
            assert tasks and p.draft.close(s)
            await asyncio.sleep(0.05)
            assert all(t.done() for t in tasks) and s.extra.guesses == {}

            s, _, first = await _ahead_step(p, "sampled", SamplingParams(temperature=1.0))
            assert first.alternates is None and s.extra.guesses == {}

            # Another session's work waiting for the draft's forwards: no guesses.
            busy = await p.draft.open_draft("busy", PROMPT[:-1], greedy, SHAPE)
            s = await p.draft.open_draft("loaded", PROMPT[:-1], greedy, SHAPE)
            cursor = Cursor.fresh(PROMPT)
            first = await p.draft.propose(s, cursor.cache_len, cursor.pending, 3, 11)
            other = asyncio.ensure_future(
                p.draft.propose(busy, cursor.cache_len, cursor.pending, 3, 11)
            )
            await asyncio.sleep(0)  # its forwards are queued
            block = ahead(cursor, first.tokens)
            await p.draft.propose(s, block.cache_len, block.pending, 4, 31)
            assert s.extra.guesses == {}
            await other
            await asyncio.sleep(0.05)
            assert p.draft.loop.queued == 0
        finally:
            await p.aclose()

    asyncio.run(go())


def test_an_echo_that_rejects_into_a_guess_starts_no_other_draft(llama_pair):
    """Drafting on in a step that drafts ahead: a verdict whose token at the rejected
    position is a guess's leaves that guess for the next propose (no head start) and
    drops the rest; the propose is answered from it as if drafted anew."""
    params = SamplingParams(temperature=0.0)
    u = [0.5] * 3

    async def go():
        p = Pair(llama_pair)
        try:
            s, cursor, first = await _ahead_step(p, "echo", params)
            alts = first.alternates
            # x_2 rejected; the target's token there is the draft's second choice
            verdict = Verdict([1.0, 0.0, 0.0], [0.5] * 3, [alts[0], alts[1], alts[2]], 50)
            n = s.extra.proposes - 1  # the propose the verdict answers
            p.draft.draft_on(s, n, cursor, first.tokens, verdict, u, 3, 21, ahead=True)
            assert s.extra.head is None and list(s.extra.guesses) == [(cursor.end + 1, (alts[1],))]
            nxt = settle(Cursor(0, ()), cursor, first.tokens, verdict, u).draft
            assert nxt == Cursor(cursor.end + 1, (alts[1],))
            _, want = await _anew(p, "ref", [*PROMPT, first.tokens[0], alts[1]], 3)
            used = _guesses("used")
            got = await p.draft.propose(s, nxt.cache_len, nxt.pending, 3, 21)
            assert _guesses("used") == used + 1 and got.tokens == want.tokens
        finally:
            await p.aclose()

    asyncio.run(go())


def _same_qs(a, b) -> bool:
    return all(
        (x.ids.tolist(), x.counts.tolist(), x.tail) == (y.ids.tolist(), y.counts.tolist(), y.tail)
        for x, y in zip(a, b, strict=True)
    )


def test_a_sampled_guess_answers_with_the_next_steps_seed(llama_pair):
    """T > 0: a proposal whose step drafts ahead, told the next step's gamma and seed,
    guesses the residual draw at each position with y_i ~ q_i without x_i; when the
    block after it is asked for, the draft drafts the next block from each guess with
    that seed. A propose for one of them with that seed is answered from it exactly as
    drafted anew (tokens, q's, cache length), cut to fewer tokens; with another seed,
    or more tokens than guessed, it is drafted anew. An echo that rejects into a
    guess starts no head start. Without the next step's seed, or with
    ``sampled_guesses`` 0 (the default): no guesses."""
    params = SamplingParams(temperature=1.0)

    async def go():
        p = Pair(llama_pair)
        p.draft.cfg.sampled_guesses = 3
        try:
            cases = ((0, 3, 21, True), (1, 2, 21, True), (2, 3, 22, False), (1, 4, 21, False))
            for pos, ask, seed, served in cases:
                s = await p.draft.open_draft(f"s{pos}{ask}{seed}", PROMPT[:-1], params, SHAPE)
                cursor = Cursor.fresh(PROMPT)
                first = await p.draft.propose(s, cursor.cache_len, cursor.pending, 3, 11, (3, 21))
                ys = first.alternates
                assert len(ys) == 3 and min(ys) >= 0
                assert all(y != x for y, x in zip(ys, first.tokens, strict=True))
                block = ahead(cursor, first.tokens)
                await p.draft.propose(s, block.cache_len, block.pending, 3, 31)
                assert sorted(s.extra.guesses) == [(cursor.end + i, (ys[i],)) for i in range(3)]
                history = [*PROMPT, *first.tokens[:pos], ys[pos]]
                ref = await p.draft.open_draft(f"r{pos}{ask}{seed}", history[:-1], params, SHAPE)
                want = await p.draft.propose(ref, len(history) - 1, history[-1:], ask, seed)
                used = _guesses("used")
                got = await p.draft.propose(s, cursor.end + pos, [ys[pos]], ask, seed)
                assert _guesses("used") == used + served, (pos, ask, seed)
                assert got.tokens == want.tokens and _same_qs(got.qs, want.qs)
                assert got.cache_len == want.cache_len == s.length and s.extra.guesses == {}

            # The echo of a verdict whose token at the rejected x_2 is the guess there.
            s = await p.draft.open_draft("echo", PROMPT[:-1], params, SHAPE)
            cursor = Cursor.fresh(PROMPT)
            first = await p.draft.propose(s, cursor.cache_len, cursor.pending, 3, 11, (3, 21))
            block = ahead(cursor, first.tokens)
            await p.draft.propose(s, block.cache_len, block.pending, 3, 31)
            ys, u = first.alternates, [0.5] * 3
            verdict = Verdict([1.0, 0.0, 0.0], [0.5] * 3, ys, 50)
            p.draft.draft_on(s, s.extra.proposes - 1, cursor, first.tokens, verdict, u, 3, 21, True)
            assert s.extra.head is None and list(s.extra.guesses) == [(cursor.end + 1, (ys[1],))]

            s = await p.draft.open_draft("untold", PROMPT[:-1], params, SHAPE)
            first = await p.draft.propose(s, cursor.cache_len, cursor.pending, 3, 11)
            assert first.alternates is None
            p.draft.cfg.sampled_guesses = 0  # (the default) off
            s = await p.draft.open_draft("off", PROMPT[:-1], params, SHAPE)
            first = await p.draft.propose(s, cursor.cache_len, cursor.pending, 3, 11, (3, 21))
            assert first.alternates is None
        finally:
            await p.aclose()

    asyncio.run(go())


def test_the_target_couples_only_guesses_q_can_draw(llama_pair):
    """``guess_tokens``: at most one per draft, each -1 or a token q_i without x_i can
    draw; anything else is INVALID_ARGUMENT naming the field. Greedy ignores them."""
    from specdec.errors import InvalidArgument

    async def go():
        p = Pair(llama_pair)
        p.draft.cfg.sampled_guesses = 2
        try:
            for params in (SamplingParams(1.0), SamplingParams(0.0)):
                d = await p.draft.open_draft(f"d{params.temperature}", PROMPT[:-1], params, SHAPE)
                t = await p.target.open(f"t{params.temperature}", PROMPT[:-1], params)
                c = Cursor.fresh(PROMPT)
                prop = await p.draft.propose(d, c.cache_len, c.pending, 2, 11, (2, 5))
                args = (t, c.cache_len, list(c.pending), prop.tokens, prop.qs, 12)
                x = prop.tokens[0]
                bad = ([x], [-1, -1, 3], [p.target.vocab_size])
                for guesses in bad if params.temperature else ():
                    with pytest.raises(InvalidArgument, match="^guess_tokens"):
                        await p.target.verify(*args, guesses=guesses)
                ok = [-1, prop.alternates[1]] if params.temperature else [x]
                v = await p.target.verify(*args, guesses=ok)
                assert len(v.residual_tokens) == 2
        finally:
            await p.aclose()

    asyncio.run(go())


def test_a_propose_cancelled_while_it_waits_for_its_head_start_stops_it(llama_pair):
    """The propose a head start answers takes it from the session and waits for it; if
    that propose is cancelled (its caller gone), nobody holds the head start any more,
    so it must stop there and then. (Before, it drafted on to its end, on the cache
    of a session that might be closing.)"""
    params = SamplingParams(temperature=0.0)
    u = [0.5, 0.5, 0.5]

    async def go():
        p = Pair(llama_pair)
        try:
            ref, cursor, drafts, verdict = await _first_step(p, params, "ref")
            nxt = settle(Cursor(0, ()), cursor, drafts, verdict, u).draft
            s, cursor, drafts, verdict = await _first_step(p, params, "gone")
            p.draft.draft_on(s, s.extra.proposes, cursor, drafts, verdict, u, 3, 21)
            head = s.extra.head.task
            propose = asyncio.ensure_future(p.draft.propose(s, nxt.cache_len, nxt.pending, 3, 21))
            await asyncio.sleep(0)  # the propose now waits for the head start
            assert s.extra.head is None and not head.done()
            propose.cancel()
            await asyncio.gather(propose, return_exceptions=True)
            await asyncio.sleep(0.05)
            return head.cancelled(), p.draft.loop.queued
        finally:
            await p.aclose()

    cancelled, queued = asyncio.run(go())
    assert cancelled and queued == 0
