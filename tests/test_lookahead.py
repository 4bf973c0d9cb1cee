"""The target's own continuation (``target.lookahead_tokens``, docs/exactness.md 4h),
in process: a verdict answered from it is the one an ordinary verify gives, up to
the first rejection, and the session goes on from the same cursor.

Greedy output through the gRPC services with it on: ``tests/test_pipeline.py``."""

from __future__ import annotations

import asyncio

import pytest

from specdec.config import ModelServiceConfig
from specdec.runtime.loading import load_model, load_tokenizer
from specdec.sampling import SamplingParams, SparseQ, accepted_count
from target_service.verifier import Verifier

PROMPT = [3, 9, 27, 4, 8]
GREEDY = SamplingParams(temperature=0.0)
AHEAD = 3


def _accepted(p_draft) -> int:  # greedy: p is 1 or 0
    return accepted_count(p_draft, [1.0] * len(p_draft), [0.0] * len(p_draft))


def _blocks(t: list[int], vocab: int) -> list[list[int]]:
    """Drafts against the continuation t_1..t_8: rejected at 1 and at 3 (inside the
    rows), accepted in full inside the rows, and matching the rows then going on
    past them (a pass over the rest)."""
    other = [(x + 1) % vocab for x in t]
    return [[other[0], t[1]], t[:2] + [other[2], t[3]], t[:2], t[:4], t[:3] + [other[3]]]


@pytest.mark.parametrize("case", range(5))
def test_a_verdict_from_the_continuation_is_an_ordinary_verify(llama_pair, case):
    _, target_dir = llama_pair
    tok = load_tokenizer(str(target_dir))
    cfg = ModelServiceConfig(max_batch_tokens=512, lookahead_tokens=AHEAD)

    async def go():
        svc = Verifier(cfg, load_model(str(target_dir)), tok)
        svc.start()
        try:
            cache_len, a = len(PROMPT) - 1, PROMPT[-1]
            ref = await svc.open("ref", PROMPT[:-1], GREEDY)
            plain = await svc.verify(ref, cache_len, [a], [], [], 0, run=8)
            t = [plain.bonus_token, *plain.run_tokens]  # the target's own t_1..t_8
            drafts = _blocks(t, svc.vocab_size)[case]
            qs = [SparseQ.point(x, svc.vocab_size) for x in drafts]

            plainly = await svc.open("plain", PROMPT[:-1], GREEDY)
            want = await svc.verify(plainly, cache_len, [a], drafts, qs, 0)
            ahead = await svc.open("ahead", PROMPT[:-1], GREEDY)
            svc.begin_ahead(ahead, cache_len, a, hold=True)  # a guess may come: no pass
            assert not await svc.decode_ahead(ahead)
            svc.begin_ahead(ahead, cache_len, a, hold=False)
            for _ in range(AHEAD):
                assert await svc.decode_ahead(ahead)
            assert not await svc.decode_ahead(ahead)  # at most lookahead_tokens
            got = await svc.verify(ahead, cache_len, [a], drafts, qs, 0)

            n = _accepted(want.p_draft)
            assert _accepted(got.p_draft) == n
            assert got.p_draft[: n + 1] == want.p_draft[: n + 1]
            if n < len(drafts):
                assert got.residual_tokens[n] == want.residual_tokens[n] == t[n]
            else:
                assert got.bonus_token == want.bonus_token == t[n]
            assert got.cache_len == want.cache_len
            assert (got.forward_s > 0) == (n >= AHEAD)  # a pass only past the rows

            # Both sessions go on from the cursor the verdict leaves, a token a verify
            # (the continuation's rest, carried over, answers the first ones).
            for s in (plainly, ahead):
                token, at, out = t[n], cache_len + 1 + n, []
                for _ in range(3):
                    svc.begin_ahead(s, at, token, hold=False)
                    token = (await svc.verify(s, at, [token], [], [], 0)).bonus_token
                    at, out = at + 1, out + [token]
                assert out == t[n + 1 : n + 4], s.session_id
        finally:
            await svc.aclose()

    asyncio.run(go())
