"""Plain runs: with no draft in a step, the target draws several tokens in a row
(``Verify.run_tokens``), one forward each, instead of one per round trip.

* greedy output is still ``generate()``'s, with runs and without;
* a run stops after an EOS token;
* sampled runs have the target's distribution: through the gRPC services, the
  second and third tokens of 3-token requests (the third is a run's second draw)
  against the exact marginals; a planted bug (the run feeds a wrong token before
  its next draw) must fail the same test (in-process, where it is quicker to plant).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.runtime.loading import load_model, load_tokenizer
from specdec.sampling import SamplingParams, probs_from_logits
from target_service.verifier import Feed, Verifier

from .inprocess import in_process
from .stats import CONCURRENT, tv, tv_threshold
from .test_engine import _reference

N = 1500
PROMPT = [3, 7, 1, 4, 0, 12]  # token ids; fixed


def test_greedy_runs_equal_generate_and_ramp_up(llama_pair):
    draft, target = llama_pair
    ids = load_tokenizer(str(target)).encode("plain runs")
    want = _reference(target, ids, 24)

    async def scenario():
        for limit, steps in ((8, 6), (1, 24)):  # 1, 2, 4, 8, 8, 1 tokens; or 24 single ones
            async with in_process(draft, target, plain_run_tokens=limit) as system:
                got, _, stats = await system.generate(
                    prompt=ids, max_new_tokens=24, temperature=0.0, gamma=0
                )
                assert got == want, limit
                assert stats.steps == steps, (limit, stats.steps)

    asyncio.run(scenario())


def test_runs_grow_while_other_requests_generate(llama_pair):
    """A lone request's runs stop at plain_run_tokens (its stream in small chunks);
    while two generate at once, at plain_run_tokens_busy (fewer trips out of the
    target's shared passes). The output is generate()'s either way."""
    draft, target = llama_pair
    ids = load_tokenizer(str(target)).encode("plain runs under load")
    want = _reference(target, ids, 48)

    async def scenario():
        settings = {"plain_run_tokens": 4, "plain_run_tokens_busy": 16}
        async with in_process(draft, target, **settings) as system:
            kw = {"prompt": ids, "max_new_tokens": 48, "temperature": 0.0, "gamma": 0}
            got, _, alone = await system.generate(**kw)
            assert got == want and alone.steps == 14  # 1, 2, 4, then 4s: 41 = 10 x 4 + 1
        async with in_process(draft, target, **settings) as system:
            pair = await asyncio.gather(system.generate(**kw), system.generate(**kw))
            for got, _, stats in pair:
                assert got == want
                assert stats.steps == 7  # 1, 2, 4, 8, 16, 16, 1

    asyncio.run(scenario())


def test_a_run_stops_after_eos(llama_pair):
    draft, target = llama_pair
    ids = load_tokenizer(str(target)).encode("a run, then")
    want = _reference(target, ids, 8)

    async def scenario():
        async with in_process(draft, target) as system:
            v = system.verifier
            greedy = SamplingParams(0.0)
            session = await v.open("run", ids[:-1], greedy)
            full = await v.verify(session, len(ids) - 1, [ids[-1]], [], [], seed=1, run=8)
            assert [full.bonus_token, *full.run_tokens] == want
            assert full.cache_len == len(ids) + 7  # every draw fed but the last
            # Make the first token that differs from all before it an EOS.
            k = next(i for i in range(1, 8) if want[i] not in want[:i])
            v.eos = frozenset({want[k]})
            cut = await v.verify(session, len(ids) - 1, [ids[-1]], [], [], seed=1, run=8)
            assert [cut.bonus_token, *cut.run_tokens] == want[: k + 1]
            assert cut.cache_len == len(ids) + k
            v.close(session)

    asyncio.run(scenario())


def test_the_first_token_comes_from_the_prefill(llama_pair, monkeypatch):
    """A target's prefill keeps p after the prompt (``SessionOpened.next_logits``), as
    ``generate()`` draws its first token from its prefill: a first step that drafts
    nothing sends no pending token, and its first draw needs no pass of its own. An
    older target that keeps none gets the prompt's last token again, from one position
    back; the output is the same either way, greedy and sampled."""
    from orchestrator.ports.local import LocalTargetSession

    draft, target = llama_pair
    ids = load_tokenizer(str(target)).encode("first from the prefill")
    want = _reference(target, ids, 4)

    async def scenario():
        async with in_process(draft, target) as system:
            v = system.verifier
            session = await v.open("first", ids, SamplingParams(0.0))
            assert session.extra.length == len(ids) and session.extra.rows is not None
            one = await v.verify(session, len(ids), [], [], [], seed=1, run=1)
            assert one.bonus_token == want[0] and one.forward_s == 0  # no pass
            run = await v.verify(session, len(ids), [], [], [], seed=1, run=4)
            assert [run.bonus_token, *run.run_tokens] == want
            v.close(session)
            outputs = {}
            for kept in (True, False):
                monkeypatch.setattr(LocalTargetSession, "next_logits", kept)
                for temperature, gamma in ((0.0, 0), (0.0, 3), (1.0, 0), (1.0, 3)):
                    got, _, _ = await system.generate(
                        prompt=ids, max_new_tokens=12, temperature=temperature, gamma=gamma, seed=5
                    )
                    outputs.setdefault((temperature, gamma), []).append(got)
            return outputs

    outputs = asyncio.run(scenario())
    for (temperature, gamma), (kept, not_kept) in outputs.items():
        assert kept == not_kept, (temperature, gamma)
        if temperature == 0:
            assert kept == _reference(target, ids, 12), gamma


# ---- the distribution, through the gRPC services ----------------------------------------
def exact(target_dir, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Marginals of the 2nd and 3rd new token [V] each (after an EOS, only EOS)."""
    model = load_model(str(target_dir))
    vocab = model.config.vocab_size
    eos = model.config.eos_token_id  # the tests' llama pair has none
    one = torch.zeros(vocab, dtype=torch.float64)
    if eos is not None:
        one[eos] = 1.0
    with torch.no_grad():
        l1 = model(torch.tensor([PROMPT])).logits[0, -1]
        l2 = model(torch.tensor([PROMPT + [a] for a in range(vocab)])).logits[:, -1]
        pairs = [PROMPT + [a, b] for a in range(vocab) for b in range(vocab)]
        l3 = model(torch.tensor(pairs)).logits[:, -1]
    p1 = probs_from_logits(l1.float(), params).double()  # [V]
    p2 = probs_from_logits(l2.float(), params).double()  # [V, V]: row = x1
    p3 = probs_from_logits(l3.float(), params).double().reshape(vocab, vocab, vocab)
    if eos is not None:
        p2[eos] = one
        p3[eos, :] = one
        p3[:, eos] = one
    return p1 @ p2, torch.einsum("a,ab,abc->c", p1, p2, p3)


PARAMS = SamplingParams(1.0, top_k=12, top_p=0.9)


def _fields(seed: int) -> dict:
    """A 3-token plain request."""
    p = PARAMS
    return dict(prompt=PROMPT, max_new_tokens=3, temperature=p.temperature, top_k=p.top_k,
                top_p=p.top_p, gamma=0, seed=seed)  # fmt: skip


def _row(ids, stats, eos) -> tuple[int, int, int]:
    """(2nd token, 3rd token, steps) of one request's output."""
    ids = list(ids) + [eos] * (3 - len(ids))  # the request ended at EOS (if it has one)
    return ids[1], ids[2], stats.steps


def check(rows, target_dir) -> dict:
    x2, x3, steps = (torch.tensor(c) for c in zip(*rows, strict=True))
    assert int(steps.max()) == 2, "3 tokens: one step, then a run of 2"
    m2, m3 = exact(target_dir, PARAMS)
    results = {
        "position 2": (tv(x2, m2), tv_threshold(m2, N)),
        "position 3 (a run's second draw)": (tv(x3, m3), tv_threshold(m3, N)),
    }
    print({k: f"tv {d:.4f} (threshold {t:.4f})" for k, (d, t) in results.items()})
    return results


@pytest.mark.slow
def test_sampled_runs_follow_target_distribution(llama_stack, llama_pair):
    eos = load_model(str(llama_pair[1])).config.eos_token_id

    def one(seed):
        ids, _, stats = llama_stack.generate_raw(**_fields(seed))
        return _row(ids, stats, eos)

    with ThreadPoolExecutor(CONCURRENT) as pool:
        rows = list(pool.map(one, range(N)))
    for name, (dist, threshold) in check(rows, llama_pair[1]).items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"


def test_a_run_that_feeds_the_wrong_token_fails_the_same_test(llama_pair, monkeypatch):
    verify = Verifier._verify

    def broken(self, *args):
        job = verify(self, *args)
        try:
            feed, first = next(job), True
        except StopIteration as done:  # a first step drawn from the prefill: no feed
            return done.value
        try:
            while True:
                if not first:
                    feed = Feed(feed.kv, [0], feed.logits)  # BROKEN: not the token drawn
                first = False
                feed = job.send((yield feed))
        except StopIteration as done:
            return done.value

    monkeypatch.setattr(Verifier, "_verify", broken)
    eos = load_model(str(llama_pair[1])).config.eos_token_id

    async def scenario():
        async with in_process(*llama_pair) as system:
            slots = asyncio.Semaphore(CONCURRENT)

            async def one(seed):
                async with slots:
                    ids, _, stats = await system.generate(**_fields(seed))
                return _row(ids, stats, eos)

            return await asyncio.gather(*(one(seed) for seed in range(N)))

    results = check(asyncio.run(scenario()), llama_pair[1])
    failed = [k for k, (d, t) in results.items() if d >= t]
    assert failed == ["position 3 (a run's second draw)"], results
