"""The engine through in-process ports (no gRPC): fast checks of the loop itself."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdec.runtime.loading import load_model, load_tokenizer

from .inprocess import in_process


def _reference(target_dir, ids: list[int], n: int) -> list[int]:
    model = load_model(str(target_dir))
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False, max_new_tokens=n,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_in_process_greedy_equals_generate_for_every_gamma(llama_pair):
    draft, target = llama_pair
    ids = load_tokenizer(str(target)).encode("in process")
    want = _reference(target, ids, 24)

    async def scenario():
        async with in_process(draft, target) as system:
            for gamma in (0, 1, 2, 4, 7):
                got, _, stats = await system.generate(
                    prompt=ids, max_new_tokens=24, temperature=0.0, gamma=gamma
                )
                assert got == want, gamma
                assert stats.generated == 24 and stats.round_trips == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_same_seed_same_output_and_64_bit_seeds_differ(llama_pair, temperature):
    draft, target = llama_pair

    async def scenario():
        async with in_process(draft, target) as system:
            outs = {}
            for seed in (5, 5, 5 + 2**32, 5 + 2**63):
                ids, _, _ = await system.generate(
                    prompt="seeds", max_new_tokens=20, temperature=temperature, seed=seed
                )
                outs.setdefault(seed, []).append(ids)
            return outs

    outs = asyncio.run(scenario())
    assert outs[5][0] == outs[5][1]
    if temperature:
        assert len({tuple(v[0]) for v in outs.values()}) == 3


def _checked(draft, target):
    """The in-process engine with the measured check against plain decoding on from
    one request (its guard: ``system.orch.cost.guard(True, 1)``)."""
    return in_process(draft, target, adaptive_plain_check=True, adaptive_plain_check_min_requests=1)


def _after_record(guard, hook) -> None:
    """Call ``hook(arm, tokens, seconds, concurrent)`` after each charge ``guard`` records."""
    record = guard.record

    def spy(arm: str, tokens: int, seconds: float, concurrent: int = 1) -> None:
        record(arm, tokens, seconds, concurrent)
        hook(arm, tokens, seconds, concurrent)

    guard.record = spy


def _count_draft_opens(system) -> list[int]:
    """Record the history length of every draft session opened from now on."""
    opened: list[int] = []
    open_draft = system.drafter.open_draft

    async def spy(session_id, tokens, params, shape):
        opened.append(len(tokens))
        return await open_draft(session_id, tokens, params, shape)

    system.drafter.open_draft = spy
    return opened


def test_adaptive_steps_are_charged_to_the_plain_check_and_stay_exact(llama_pair, monkeypatch):
    """Every step of an adaptive request is charged to the PlainGuard arm it was
    chosen under (all its tokens, positive seconds); under the plain arm no step
    drafts and no draft session is opened; greedy output is generate()'s under
    either arm."""
    from orchestrator import adaptive

    monkeypatch.setattr(adaptive, "_EPOCH_STEPS", 10**6)  # one epoch per arm, set below
    draft, target = llama_pair
    ids = load_tokenizer(str(target)).encode("which arm")
    want = _reference(target, ids, 24)

    async def scenario():
        async with _checked(draft, target) as system:
            guard = system.orch.cost.guard(True, 1)  # one request at a time
            charged: list[tuple[str, int, float]] = []

            def charge(arm: str, tokens: int, seconds: float, concurrent: int) -> None:
                charged.append((arm, tokens, seconds))
                assert concurrent == 1  # one request at a time

            _after_record(guard, charge)
            opened = _count_draft_opens(system)
            for arm in ("model", "plain"):
                guard.arm = arm
                opened.clear()
                got, _, stats = await system.generate(
                    prompt=ids, max_new_tokens=24, temperature=0.0
                )
                assert got == want, arm
                assert stats.adaptive
                if arm == "plain":
                    assert stats.drafted == 0 and opened == []
                else:
                    assert stats.drafted > 0 and opened == [len(ids) - 1]
                mine = [c for c in charged if c[0] == arm]
                assert sum(tokens for _, tokens, _ in mine) == 24, arm
                # the prefill (no tokens), then every step
                assert len(mine) == stats.steps + 1 and all(s > 0 for _, _, s in mine), arm
                assert mine[-stats.steps - 1][1] == 0

    asyncio.run(scenario())


def test_a_request_that_starts_plain_opens_its_draft_when_it_first_drafts(llama_pair, monkeypatch):
    """An adaptive request that starts in a plain epoch of the check skips the draft
    prefill; when the model's arm takes over mid-request, its first drafting step
    opens the draft on the history so far, and greedy output stays generate()'s."""
    from orchestrator import adaptive

    monkeypatch.setattr(adaptive, "_EPOCH_STEPS", 10**6)  # epochs change only here
    draft, target = llama_pair
    ids = load_tokenizer(str(target)).encode("plain first")
    want = _reference(target, ids, 24)

    async def scenario():
        async with _checked(draft, target) as system:
            guard = system.orch.cost.guard(True, 1)

            def switch(arm: str, tokens: int, seconds: float, concurrent: int) -> None:
                if tokens:  # the first step is charged: the model's arm from now on
                    guard.arm = "model"

            _after_record(guard, switch)
            guard.arm = "plain"
            # Under the model's arm, draft (whatever tiny models on a CPU would favour).
            monkeypatch.setattr(system.orch.cost, "choose", lambda *args, **kw: (2, False))
            opened = _count_draft_opens(system)
            got, _, stats = await system.generate(prompt=ids, max_new_tokens=24, temperature=0.0)
            assert got == want
            assert stats.drafted > 0 and len(opened) == 1
            assert opened[0] > len(ids) - 1  # the prompt and what the plain steps emitted
            assert stats.fallback_steps == 0

    asyncio.run(scenario())


def test_above_speculate_max_requests_adaptive_requests_decode_plain(llama_pair, monkeypatch):
    """``adaptive_speculate_max_requests`` 2, with the model set on drafting: at a
    load of 2 an adaptive request drafts; at 3 it decodes plain, opens no draft
    session and is charged to no check; greedy output is generate()'s either way,
    and a request that sets gamma drafts at any load."""
    draft, target = llama_pair
    ids = load_tokenizer(str(target)).encode("too busy to draft")
    want = _reference(target, ids, 16)

    async def scenario():
        async with in_process(
            draft, target, adaptive_speculate_max_requests=2, adaptive_plain_check_min_requests=1
        ) as system:
            orch = system.orch
            monkeypatch.setattr(orch.cost, "choose", lambda *args, **kw: (2, False))
            opened = _count_draft_opens(system)
            for load, drafts in ((2, True), (3, False)):
                monkeypatch.setattr(orch, "load", lambda load=load: load)
                opened.clear()
                got, _, stats = await system.generate(
                    prompt=ids, max_new_tokens=16, temperature=0.0
                )
                assert got == want, load
                assert (stats.drafted > 0) == drafts and bool(opened) == drafts, load
            assert set(orch.cost.guards) == {(True, 2)}  # none made for the load of 3
            got, _, stats = await system.generate(
                prompt=ids, max_new_tokens=16, temperature=0.0, gamma=3
            )
            assert got == want and stats.drafted > 0

    asyncio.run(scenario())


def test_a_verify_says_the_draft_is_idle_only_when_it_is(llama_pair, monkeypatch):
    """``Verify.draft_idle``: a step that drafts nothing ahead, with the
    orchestrator's only request, tells the target that no draft works during its
    verify (the pass may take the draft's core, ``target.plain_torch_threads``); a
    step that drafts ahead, and any step while other requests generate, does not.
    Greedy output is generate()'s either way."""
    draft, target = llama_pair
    ids = load_tokenizer(str(target)).encode("an idle draft")
    want = _reference(target, ids, 16)

    async def scenario():
        async with in_process(draft, target) as system:
            said: list[bool] = []
            run = system.verifier.run

            async def spy(job, kind: str, wide: bool = False):
                if kind == "verify":
                    said.append(wide)
                return await run(job, kind, wide)

            system.verifier.run = spy
            got = {}
            for name, load, overlap in (
                ("sequential", 1, False),
                ("ahead", 1, True),
                ("busy", 2, False),
            ):
                monkeypatch.setattr(system.orch, "load", lambda load=load: load)
                said.clear()
                out, _, stats = await system.generate(
                    prompt=ids, max_new_tokens=16, temperature=0.0, gamma=3, overlap=overlap
                )
                assert out == want, name
                got[name] = (said.count(True), said.count(False), stats.overlapped_steps)
            return got

    got = asyncio.run(scenario())
    assert got["sequential"][0] > 0 and got["sequential"][1] == 0, got
    assert got["ahead"][1] > 0, got  # (its last steps draft nothing ahead: idle)
    assert got["busy"][0] == 0 and got["busy"][1] > 0, got


def test_a_request_cancelled_during_its_prefills_cancels_both(llama_pair):
    """The client goes away while its draft and target prefills run: both stop, and the
    request's slot is free at once. (Before, the target's prefill ran on to its end or
    its timeout, target_timeout_s, while the request kept its slot.)"""
    draft, target = llama_pair

    async def scenario():
        async with in_process(draft, target) as system:
            started, stopped = set(), set()

            def blocking(role):
                async def never(*args, **kwargs):
                    started.add(role)
                    try:
                        await asyncio.Event().wait()
                    except asyncio.CancelledError:
                        stopped.add(role)
                        raise

                return never

            system.drafter.open_draft = blocking("draft")
            system.verifier.open = blocking("target")
            request = asyncio.ensure_future(
                system.generate(prompt="gone", max_new_tokens=8, temperature=0.0, gamma=4)
            )
            while started != {"draft", "target"}:
                await asyncio.sleep(0.01)
            request.cancel()
            done, _ = await asyncio.wait([request], timeout=5)
            return bool(done), stopped, system.orch.live

    ended, stopped, live = asyncio.run(scenario())
    assert ended, "the cancelled request was still waiting for its target prefill after 5 s"
    assert stopped == {"draft", "target"} and live == 0


def test_a_cancelled_error_from_inside_a_step_is_an_error_not_a_hang(llama_pair):
    """A CancelledError can come up from below a step without anyone cancelling the
    request (grpc.aio raises one from a call that was cancelled under its reader). The
    request ends at once with an error, and its slot is free. (Before, the generation
    ended without a word to the request's stream, which waited for its deadline.)"""
    from specdec.errors import Internal

    draft, target = llama_pair

    async def scenario():
        async with in_process(draft, target) as system:

            async def cancelled_under_us(*args, **kwargs):
                raise asyncio.CancelledError()

            system.verifier.verify = cancelled_under_us
            with pytest.raises(Internal, match="cancelled from inside"):
                await asyncio.wait_for(
                    system.generate(prompt="x", max_new_tokens=8, temperature=0.0), 10
                )
            return system.orch.live

    assert asyncio.run(scenario()) == 0


def test_a_requests_own_deadline_during_the_draft_prefill_is_no_draft_outage(llama_pair):
    """A client deadline shorter than the draft's prefill cuts that call short: the
    request ends with DEADLINE_EXCEEDED, but the draft did not fail, so its breaker
    (shared by every request) stays closed. (Before, it opened, and speculation
    stopped for everyone for the back-off.)"""
    import time

    from orchestrator.requests import parse
    from specdec.errors import DeadlineExceeded
    from specdec.v1 import orchestrator_pb2

    draft, target = llama_pair

    async def scenario():
        async with in_process(draft, target) as system:
            open_draft = system.drafter.open_draft

            async def slow_prefill(*args, **kwargs):
                await asyncio.sleep(1.0)
                return await open_draft(*args, **kwargs)

            system.drafter.open_draft = slow_prefill
            o = system.orch
            req = orchestrator_pb2.GenerateRequest(text="x", max_new_tokens=8, gamma=4)
            spec = parse(req, o.cfg.orchestrator, o.tokenizer, o.target_info, o.draft_info, 1 << 20)
            with pytest.raises(DeadlineExceeded):
                async for _ in o.generate(spec, time.monotonic(), time.monotonic() + 0.3):
                    pass
            return [r.breaker.failures for r in o.draft_pool.replicas.values()]

    assert asyncio.run(scenario()) == [0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_explicit_rollback_keeps_a_chained_steps_block(llama_pair, temperature):
    """With ``explicit_rollback`` the orchestrator trims both caches after each step.
    After a chained step (overlap: the block drafted ahead is used), the draft's cache
    rightly holds that block beyond the cursor, and trimming it there threw the block
    away: the next propose failed, counted as a draft outage, and the breaker shared
    by every request opened. With the target as its own draft every step chains."""
    _, target = llama_pair
    ids = load_tokenizer(str(target)).encode("rolled back")
    want = _reference(target, ids, 24)

    async def scenario():
        async with in_process(target, target, explicit_rollback=True) as system:
            got, _, stats = await system.generate(
                prompt=ids, max_new_tokens=24, temperature=temperature, gamma=3, overlap=True,
                seed=7,
            )  # fmt: skip
            failures = [r.breaker.failures for r in system.orch.draft_pool.replicas.values()]
            return got, stats, failures

    got, stats, failures = asyncio.run(scenario())
    if not temperature:
        assert got == want
    assert stats.overlapped_steps > 0
    assert stats.fallback_steps == 0 and failures == [0], (stats, failures)


def test_queued_requests_leave_the_queue_when_cancelled_or_out_of_time(llama_pair):
    """With every slot taken, a queued request that is cancelled leaves the queue
    (the next one still gets the slot), and one whose deadline passes while it
    waits ends with DEADLINE_EXCEEDED then, not when a slot frees. (Before, it
    waited for a slot however long that took, and then failed.)"""
    import time

    from orchestrator.requests import parse
    from specdec.errors import DeadlineExceeded
    from specdec.v1 import orchestrator_pb2

    draft, target = llama_pair

    async def scenario():
        async with in_process(
            draft, target, max_concurrent_requests=1, max_queued_requests=4
        ) as system:
            o = system.orch
            req = orchestrator_pb2.GenerateRequest(text="x", max_new_tokens=4, temperature=0.0)
            spec = parse(req, o.cfg.orchestrator, o.tokenizer, o.target_info, o.draft_info, 1 << 20)

            async def run(deadline: float | None = None) -> int:
                n = 0
                async for _ in o.generate(spec, time.monotonic(), deadline):
                    n += 1
                return n

            holder = o.generate(spec, time.monotonic())
            await anext(holder)  # it holds the one slot while it is not read on
            cancelled = asyncio.ensure_future(run())
            waiting = asyncio.ensure_future(run())
            began = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="queued"):
                await asyncio.wait_for(run(time.monotonic() + 0.3), 5)
            out_of_time = time.monotonic() - began
            assert o.queued == 2
            cancelled.cancel()
            await asyncio.gather(cancelled, return_exceptions=True)
            assert o.queued == 1
            await holder.aclose()  # the slot frees: the request still queued gets it
            assert await asyncio.wait_for(waiting, 30) > 0
            return out_of_time, o.live, o.queued

    out_of_time, live, queued = asyncio.run(scenario())
    assert out_of_time < 2.0 and live == 0 and queued == 0, (out_of_time, live, queued)


def test_a_top_k_of_the_whole_vocabulary_is_no_top_k(llama_pair):
    """top_k at or above the vocabulary removes nothing: the request runs as top_k 0
    (so the draft sends q with its tail; before, it went without, and acceptance
    dropped for nothing), and a seeded request's output is the same."""
    from orchestrator.requests import parse
    from specdec.v1 import orchestrator_pb2

    draft, target = llama_pair

    async def scenario():
        async with in_process(draft, target) as system:
            o = system.orch
            req = orchestrator_pb2.GenerateRequest(text="x", max_new_tokens=4, top_k=10**6)
            spec = parse(req, o.cfg.orchestrator, o.tokenizer, o.target_info, o.draft_info, 1 << 20)
            common = dict(prompt="k", max_new_tokens=16, temperature=1.0, gamma=3, seed=5)
            wide, _, _ = await system.generate(**common, top_k=o.target_info.vocab_size)
            none, _, _ = await system.generate(**common, top_k=0)
            return spec.params.top_k, wide, none

    top_k, wide, none = asyncio.run(scenario())
    assert top_k == 0 and wide == none


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_with_fewer_tokens_pairs_once_padded(llama_pair, tmp_path, temperature):
    """Checkpoints of one family are padded differently (Qwen2.5 0.5B: 151,936
    tokens, 7B: 152,064). Such a draft is refused with a hint, and with
    ``draft.pad_vocab`` set to the target's vocabulary it pairs and speculates: greedy
    output is still the target's own, and a sampled request completes."""
    from transformers import AutoConfig, LlamaForCausalLM

    from specdec.errors import FailedPrecondition

    from .tiny import build_model

    _, target = llama_pair
    small = build_model("llama", tmp_path / "small", layers=1, width=32, seed=5)
    cfg = AutoConfig.from_pretrained(small)
    vocab = cfg.vocab_size
    cfg.vocab_size -= 5
    LlamaForCausalLM(cfg).save_pretrained(small)
    ids = load_tokenizer(str(target)).encode("padded")
    want = _reference(target, ids, 24)

    async def refused() -> str:
        try:
            async with in_process(small, target):
                return ""
        except FailedPrecondition as e:
            return str(e)

    async def padded():
        async with in_process(small, target, draft={"pad_vocab": vocab}) as system:
            return await system.generate(
                prompt=ids, max_new_tokens=24, temperature=temperature, gamma=3, seed=3
            )

    message = asyncio.run(refused())
    assert f"set draft.pad_vocab: {vocab}" in message, message
    got, _, stats = asyncio.run(padded())
    assert len(got) == 24 and stats.drafted > 0 and stats.fallback_steps == 0, stats
    if not temperature:
        assert got == want
