"""Exactness does not depend on the batch (continuous batching across sessions).

* 8 concurrent clients with prompts of very different lengths (1 to ~300
  tokens: prefills cut into chunks, verifies and decode steps of several
  sessions in one pass) each get exactly ``generate()``'s greedy output, and
  the passes really were shared; once as calibrated, once with oneDNN's
  linear for every pass (``specdec.runtime.packed_linear``);
* the same check against services with a planted padding error (each session
  attends over as many keys as the longest session of its pass) fails;
* the sampled distribution test passes while other clients load the services.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from specdec.runtime.loading import load_model
from specdec.sampling import SamplingParams

from .conftest import WIRE_TOP_K
from .stack import local_stack, planted_env
from .test_statistical import check

LENGTHS = (1, 3, 17, 40, 90, 150, 220, 300)
NEW_TOKENS = 24

BROKEN_SITE = """
import torch
import torch.nn.functional as F

import specdec.runtime.ragged as ragged


def attend(self, layer, query, scaling, window, softcap):
    heads, n_total, dim = query.shape[1], query.shape[2], query.shape[3]
    out = query.new_empty(1, n_total, heads, dim)
    longest = max(s.past + s.new for s in self.segments)
    for i, s in enumerate(self.segments):
        # BROKEN: keys padded with zeros to the longest session of the pass, padding
        # not masked (zeros, not the buffer's unwritten memory: the same error every run)
        pad = (0, 0, 0, longest - s.past - s.new)
        k = F.pad(s.kv.keys[layer][None, :, : s.past + s.new], pad)
        v = F.pad(s.kv.values[layer][None, :, : s.past + s.new], pad)
        q = query[:, :, s.start : s.start + s.new]
        mask = None
        if s.new > 1:
            q_pos = torch.arange(s.past, s.past + s.new)[:, None]
            mask = torch.arange(k.shape[2])[None, :] <= q_pos
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != heads
        )
        out[0, s.start : s.start + s.new] = o[0].transpose(0, 1)
    return out


ragged.RaggedBatch.attend = attend
# The start-up self-test packs sessions of different lengths too and would refuse
# the model; the plant hides from it, so that what catches it is the test below.
ragged.RaggedRunner.self_test = lambda self: None
"""


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _references(target_dir, prompts) -> list[list[int]]:
    model = load_model(str(target_dir))
    out = []
    for ids in prompts:
        seq = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
        )
        out.append(seq[0, len(ids) :].tolist())
    return out


def _concurrent_greedy(stack, prompts) -> list[list[int]]:
    """All prompts at once (8 clients), each twice with different gammas."""
    barrier = threading.Barrier(len(prompts))

    def one(i: int) -> list[int]:
        barrier.wait()  # start together, so that passes are shared
        outs = []
        for gamma in (i % 5, (i + 2) % 5):
            ids, _, _ = stack.generate_raw(
                prompt=prompts[i], max_new_tokens=NEW_TOKENS, temperature=0.0, gamma=gamma
            )
            outs.append(ids)
        assert outs[0] == outs[1], (i, outs)
        return outs[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def _shared_passes(stack, role: str) -> float:
    """Forward passes that carried more than one session, so far."""
    total = stack.metric(role, "specdec_model_batch_sessions_count", f'role="{role}"')
    single = stack.metric(role, "specdec_model_batch_sessions_bucket", 'le="1.0"')
    return total - single


# Packing: as calibrated at start-up (on these tiny models, whose weights sit in
# cache, oneDNN rarely pays), and oneDNN's linear for every pass of both models.
@pytest.mark.parametrize("packed_from", [0, 1], ids=["calibrated", "packed"])
def test_concurrent_clients_with_mixed_lengths_get_generate_exactly(
    tmp_path, llama_pair, packed_from
):
    draft, target = llama_pair
    vocab = load_model(str(target)).config.vocab_size
    prompts = _prompts(vocab)
    want = _references(target, prompts)
    # A small token budget, so that long prefills are cut into chunks between steps.
    with local_stack(
        tmp_path,
        draft,
        target,
        target__max_batch_tokens=64,
        draft__max_batch_tokens=64,
        target__packed_linear_min_rows=packed_from,
        draft__packed_linear_min_rows=packed_from,
    ) as stack:
        got = _concurrent_greedy(stack, prompts)
        shared = _shared_passes(stack, "target")
    for n, g, w in zip(LENGTHS, got, want, strict=True):
        assert g == w, f"prompt of {n} tokens"
    assert shared > 0, "no forward pass was shared: the test did not exercise batching"


@pytest.mark.slow
def test_a_planted_padding_error_is_caught(tmp_path, llama_pair):
    draft, target = llama_pair
    vocab = load_model(str(target)).config.vocab_size
    prompts = _prompts(vocab)
    want = _references(target, prompts)
    env = planted_env(tmp_path, BROKEN_SITE)
    with local_stack(
        tmp_path / "stack",
        draft,
        target,
        env=env,
        target__max_batch_tokens=64,
        draft__max_batch_tokens=64,
    ) as stack:
        got = _concurrent_greedy_tolerant(stack, prompts)
    wrong = [n for n, g, w in zip(LENGTHS, got, want, strict=True) if g != w]
    assert wrong, "the planted padding error went unnoticed"


def _concurrent_greedy_tolerant(stack, prompts) -> list[list[int] | None]:
    """As _concurrent_greedy, but a broken stack may disagree with itself: no assert."""
    barrier = threading.Barrier(len(prompts))

    def one(i: int):
        barrier.wait()
        ids, _, _ = stack.generate_raw(
            prompt=prompts[i], max_new_tokens=NEW_TOKENS, temperature=0.0, gamma=i % 5
        )
        return ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


@pytest.mark.slow
def test_sampling_follows_the_target_under_background_load(llama_stack, llama_pair):
    stop = threading.Event()
    prompts = _prompts(load_model(str(llama_pair[1])).config.vocab_size)

    def background(i: int) -> int:
        n = 0
        while not stop.is_set():
            llama_stack.generate_raw(
                prompt=prompts[(i + n) % len(prompts)],
                max_new_tokens=30,
                temperature=[0.0, 1.0][n % 2],
                gamma=n % 6,
            )
            n += 1
        return n

    with ThreadPoolExecutor(3) as pool:
        loads = [pool.submit(background, i) for i in range(3)]
        try:
            results = check(llama_stack, llama_pair, SamplingParams(1.0))
        finally:
            stop.set()
        served = sum(f.result() for f in loads)
    assert served > 10, "the background load did not run"
    assert llama_stack.config["orchestrator"]["wire_top_k"] == WIRE_TOP_K
    for name, (dist, threshold) in results.items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"


# ---- keeping sessions in step (ForwardLoop.batch_wait_s) -------------------------------------
def _sessions_per_pass(
    target: Path,
    batch_wait_s: float,
    sessions: int,
    rounds: int = 40,
    kind: str = "step",
    kind_wait_s: dict | None = None,
    skew_s: float = 0.0,
):
    """Sessions run one-feed jobs of ``kind``, each coming back 3 ms (a round trip)
    after its last one finished, the second starting half a pass late; with
    ``skew_s``, session i's trips take ``i * skew_s`` longer, so sessions that left
    one forward come back ``skew_s`` apart (a steady skew: sessions that are not
    waited for drift apart and meet again only by chance).
    Returns the mean number of sessions per forward and the wall time."""
    import asyncio
    import time

    from specdec.runtime.forward_loop import ForwardLoop
    from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

    runner = RaggedRunner(load_model(str(target)))
    seen: list[int] = []

    def job(kv):
        yield Feed(kv, [5], 1)

    async def session(i: int, loop: ForwardLoop) -> None:
        kv = SessionKV()
        await asyncio.sleep(0.0005 * i)
        for _ in range(rounds):
            await loop.run(job(kv), kind)
            await asyncio.sleep(0.003 + skew_s * i)
        loop.forget(kv)

    async def main() -> float:
        loop = ForwardLoop(
            runner, 512, lambda b: seen.append(b.sessions), batch_wait_s, kind_wait_s
        )
        loop.start()
        start = time.perf_counter()
        await asyncio.gather(*(session(i, loop) for i in range(sessions)))
        await loop.aclose()
        return time.perf_counter() - start

    wall = asyncio.run(main())
    return sum(seen) / len(seen), wall


def test_concurrent_sessions_are_kept_in_step(llama_pair):
    together, _ = _sessions_per_pass(llama_pair[1], 0.010, sessions=2)
    assert together >= 1.7, together  # nearly every pass carries both sessions


def test_a_kind_of_job_can_have_its_own_wait(llama_pair):
    """Plain decoding steps ("decode") come back after a round trip only: the loop
    may wait longer for them (decode_batch_wait_ms) than for others. The two
    sessions come back 3 and 23 ms after leaving a forward together: decode's 50 ms
    wait covers both trips, the others' 1 ms covers neither. (The 20 ms skew is
    far longer than a pass, even on a loaded machine, so the session that comes
    back first is done before the other arrives unless the loop waits for it.)"""
    waits = {"decode": 0.050}
    runs = {
        kind: _sessions_per_pass(
            llama_pair[1], 0.001, 2, kind=kind, kind_wait_s=waits, skew_s=0.020
        )[0]
        for kind in ("decode", "verify")
    }
    assert runs["decode"] >= 1.7, runs  # waited for: nearly every pass carries both
    assert runs["verify"] < 1.3, runs  # not waited for: most passes carry one


def test_a_lone_session_never_waits_for_a_batch(llama_pair):
    _, alone = _sessions_per_pass(llama_pair[1], 1.0, sessions=1, rounds=20)
    assert alone < 1.0, alone  # 20 passes, none of them waiting the 1 s window


def test_background_jobs_neither_wait_nor_are_waited_for(llama_pair):
    """The draft's guesses ("guess", ``forward_loop.BACKGROUND``) run in the draft's
    idle time: a guess queued right after a session's job left a forward runs at
    once, not after the 1 s the loop would wait for that session to come back; and
    a session's job after a finished guess does not wait for the guess's cache."""
    import asyncio
    import time

    from specdec.runtime.forward_loop import ForwardLoop
    from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

    runner = RaggedRunner(load_model(str(llama_pair[1])))

    def job(kv, n=1):
        for _ in range(n):
            yield Feed(kv, [5], 1)

    async def main() -> tuple[float, float]:
        loop = ForwardLoop(runner, 512, None, batch_wait_s=1.0)
        loop.start()
        await loop.run(job(SessionKV(), 3), "guess")
        start = time.perf_counter()
        mine = SessionKV()
        await loop.run(job(mine), "propose")  # (the guess's cache never comes back)
        after = time.perf_counter() - start
        start = time.perf_counter()  # "mine" may come back: a session's job would wait
        await loop.run(job(SessionKV(), 3), "guess")
        guessed = time.perf_counter() - start
        await loop.aclose()
        return guessed, after

    guessed, after = asyncio.run(main())
    assert guessed < 0.5 and after < 0.5, (guessed, after)


def test_a_second_job_for_a_busy_session_fails_alone(llama_pair):
    """A session has one job in the forward loop at a time. A second one for the
    same cache (a race in a service's own bookkeeping) fails at once with a message
    naming both kinds, and alone: the first job and another session's job in the
    same forwards finish as if it never came. (Before, it reached the runner, which
    failed the whole forward and with it every session's job in that forward.)"""
    import asyncio

    from specdec.errors import Internal
    from specdec.runtime.forward_loop import ForwardLoop
    from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

    runner = RaggedRunner(load_model(str(llama_pair[1])))

    def job(kv, n):
        for _ in range(n):
            yield Feed(kv, [5], 1)
        return kv.length

    async def main():
        loop = ForwardLoop(runner, 512, None)
        loop.start()
        busy, other = SessionKV(), SessionKV()
        first = asyncio.ensure_future(loop.run(job(busy, 3), "propose"))
        second = asyncio.ensure_future(loop.run(job(other, 3), "propose"))
        await asyncio.sleep(0)  # both queued
        with pytest.raises(Internal, match="a head job came while its propose job"):
            await loop.run(job(busy, 1), "head")
        lengths = await asyncio.gather(first, second)
        await loop.aclose()
        return lengths

    assert asyncio.run(main()) == [3, 3]


def test_a_cancelled_callers_job_stops_and_frees_its_session(llama_pair):
    """A caller cancelled mid-job (a client that went away, a pipeline cancelled, a
    timeout) takes its job out of the loop: no feed of it runs after the cancel, and
    the session's next job runs. (Before, cancelling the caller also cancelled the
    future it awaited, the loop read that as a finished job, and the job ran on: it
    grew the cache behind its owner's back, and the session's next job failed as
    "session busy", or in a forward with every other session's job.)"""
    import asyncio

    from specdec.runtime.forward_loop import ForwardLoop
    from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

    runner = RaggedRunner(load_model(str(llama_pair[1])))
    fed: list[int] = []

    def job(kv, n):
        for i in range(n):
            yield Feed(kv, [5], 1)
            fed.append(i)
        return kv.length

    async def main():
        loop = ForwardLoop(runner, 512, None)
        loop.start()
        kv = SessionKV()
        long = asyncio.ensure_future(loop.run(job(kv, 10_000), "propose"))
        while len(fed) < 3:
            await asyncio.sleep(0.001)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        after_cancel = kv.length
        await asyncio.sleep(0.05)  # room for any forward the dropped job would get
        ran_on = kv.length - after_cancel
        next_job = await loop.run(job(kv, 2), "head")
        await loop.aclose()
        return ran_on, after_cancel, next_job

    ran_on, after_cancel, next_job = asyncio.run(main())
    assert ran_on == 0, f"{ran_on} feeds of a cancelled job ran after the cancel"
    assert next_job == after_cancel + 2


def test_a_fault_outside_the_jobs_never_stops_the_forward_loop(llama_pair):
    """A forward's bookkeeping can fail outside any job (its metrics; on a GPU, a device
    fault that shows only at the synchronize). The jobs keep their results or get the
    error, and the loop serves the next ones. (Before, the exception ended the loop's
    task silently, and every later job waited for ever.)"""
    import asyncio

    from specdec.runtime.forward_loop import ForwardLoop
    from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

    runner = RaggedRunner(load_model(str(llama_pair[1])))

    def job(kv, n):
        for _ in range(n):
            yield Feed(kv, [5], 1)
        return kv.length

    def broken_metrics(stats) -> None:
        raise RuntimeError("a metric failed")

    async def main():
        loop = ForwardLoop(runner, 512, broken_metrics)
        loop.start()
        kv = SessionKV()
        lengths = [await asyncio.wait_for(loop.run(job(kv, 2)), 30) for _ in range(2)]
        await loop.aclose()
        return lengths

    assert asyncio.run(main()) == [2, 4]


def test_a_session_keeps_no_other_sessions_logits_after_a_shared_pass(llama_pair):
    """Sessions that verify in one pass get their rows as views of that pass's logits.
    What a session keeps for its next step (the p after its last token) must not hold
    the whole pass alive, every other session's rows included, until its next pass:
    at a 152k vocabulary that is hundreds of MB a session under load. A session that
    had a pass of its own keeps its rows as they are."""
    import asyncio

    from specdec.config import ModelServiceConfig
    from specdec.runtime.loading import load_tokenizer
    from specdec.sampling import SamplingParams, SparseQ
    from target_service.verifier import Verifier

    target = llama_pair[1]

    def point(token: int) -> SparseQ:
        return SparseQ.point(token, verifier.info.vocab_size)

    verifier = Verifier(
        ModelServiceConfig(max_batch_tokens=512),
        load_model(str(target)),
        load_tokenizer(str(target)),
    )

    async def main():
        verifier.start()
        try:
            params = SamplingParams(temperature=0.0)
            sessions = [await verifier.open(f"s{i}", [3, 9, 27, 4], params) for i in range(3)]
            # Three verifies queued together share one pass.
            await asyncio.gather(
                *(verifier.verify(s, 4, [8], [5, 6], [point(5), point(6)], 1) for s in sessions)
            )
            shared = [s.extra.rows for s in sessions]
            alone = sessions[0]
            await verifier.verify(alone, alone.length, [], [7], [point(7)], 2)
            return shared, alone.extra.rows, verifier.loop.last_batch.sessions
        finally:
            await verifier.aclose()

    shared, own, last_sessions = asyncio.run(main())
    for rows in shared:
        assert rows.untyped_storage().nbytes() == rows.nbytes, "a shared pass kept alive"
    assert last_sessions == 1 and own.shape[0] == 2  # a pass of its own: kept whole


def test_a_long_feed_cut_into_chunks_keeps_the_positions_it_wants_logits_of(llama_pair):
    """A feed longer than the batch budget runs in chunks. A long one that wants
    logits (a Verify of many pending tokens and a draft, sent by a direct client of
    the target's API) was cut at the budget, so its last chunk could hold fewer
    positions than it wanted logits of, and the runner took the rows before it:
    other tokens' logits, silently. Now the rest always holds them, and the runner
    refuses a feed that wants more logits than it has tokens."""
    import asyncio

    from specdec.runtime.forward_loop import ForwardLoop
    from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

    runner = RaggedRunner(load_model(str(llama_pair[1])))
    tokens = [(7 * i) % 40 + 3 for i in range(67)]  # 63 pending + 4 drafts

    def job(kv):
        return (yield Feed(kv, tokens, 5))

    async def logits(budget: int) -> torch.Tensor:
        loop = ForwardLoop(runner, budget, None)
        loop.start()
        try:
            return await loop.run(job(SessionKV()))
        finally:
            await loop.aclose()

    whole, cut = asyncio.run(logits(512)), asyncio.run(logits(64))
    assert whole.shape == cut.shape == (5, whole.shape[-1])
    torch.testing.assert_close(cut, whole, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cannot want 3 logits"):
        runner.forward([Feed(SessionKV(), [5, 6], 3)])


def test_a_forward_that_fails_fails_only_the_job_that_fails_alone(llama_pair):
    """A shared forward that fails (out of device memory, say) runs each of its jobs
    again alone: the others finish as if nothing happened, and only the job whose
    feed fails alone fails, out of memory as ResourceExhausted (a retry may
    succeed later). Nothing of the failed pass outlives it: its tensors are freed at
    once, not when the garbage collector finds the cycle through the exception's
    traceback. (Before, every job in that forward failed, with INTERNAL, and the
    tensors stayed until a collection.)"""
    import asyncio
    import gc
    import weakref

    from specdec.errors import ResourceExhausted
    from specdec.runtime.forward_loop import ForwardLoop
    from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

    runner = RaggedRunner(load_model(str(llama_pair[1])))
    poison, other = SessionKV(), SessionKV()
    held: list[weakref.ref] = []

    class Poisoned:
        def forward(self, feeds):
            if any(f.kv is poison for f in feeds):
                allocated = torch.zeros(1 << 20)  # what the failed pass held
                held.append(weakref.ref(allocated))
                raise torch.OutOfMemoryError("CUDA out of memory (planted)")
            return runner.forward(feeds)

    def job(kv, n):
        for _ in range(n):
            yield Feed(kv, [5], 1)
        return kv.length

    async def main():
        loop = ForwardLoop(Poisoned(), 512, None)
        loop.start()
        try:
            jobs = [loop.run(job(kv, 3)) for kv in (poison, other)]
            return await asyncio.gather(*jobs, return_exceptions=True)
        finally:
            await loop.aclose()

    gc.disable()
    try:
        failed, done = asyncio.run(main())
        alive = [ref() is not None for ref in held]
    finally:
        gc.enable()
    assert isinstance(failed, ResourceExhausted) and "out of memory" in str(failed), failed
    assert done == 3 and poison.length == 0
    assert len(held) == 2 and not any(alive), alive  # shared, then alone


def test_a_forward_that_fails_late_leaves_every_session_as_it_was(llama_pair, monkeypatch):
    """A forward can fail after the model ran: the float copy of bfloat16 logits runs
    out of memory, or a device fault shows at the synchronize. The sessions must not
    have grown then, or the jobs run again alone feed their tokens twice and their
    caches hold them twice: wrong logits from then on, silently. (Found by review:
    the runner grew the lengths before that copy, and the loop kept them.)"""
    import asyncio

    from specdec.runtime.forward_loop import ForwardLoop
    from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

    model = load_model(str(llama_pair[1]))
    runner = RaggedRunner(model.to(torch.bfloat16))
    kv = SessionKV()
    real_float = torch.Tensor.float

    def out_of_memory(self, *args, **kwargs):
        if self.dtype != torch.bfloat16:  # (the logits' copy; not other calls)
            return real_float(self, *args, **kwargs)
        raise torch.OutOfMemoryError("planted in the float copy")

    monkeypatch.setattr(torch.Tensor, "float", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        runner.forward([Feed(kv, [5, 6, 7], 1)])
    monkeypatch.setattr(torch.Tensor, "float", real_float)
    assert kv.length == 0  # the runner: nothing grew

    fail_once = [True]

    class FailsAfterTheRunner:  # as a fault at the synchronize would
        def forward(self, feeds):
            out = runner.forward(feeds)
            if fail_once.pop() if fail_once else False:
                raise RuntimeError("a device fault, seen at the synchronize")
            return out

    def job(kv, n):
        for _ in range(n):
            yield Feed(kv, [5], 1)
        return kv.length

    async def main():
        loop = ForwardLoop(FailsAfterTheRunner(), 512, None)
        loop.start()
        try:
            sessions = [SessionKV(), SessionKV()]
            return await asyncio.gather(*(loop.run(job(s, 2)) for s in sessions))
        finally:
            await loop.aclose()

    assert asyncio.run(main()) == [2, 2]  # the loop: each token fed once


def test_a_pass_of_plain_decoding_steps_alone_takes_the_plain_thread_count(llama_pair):
    """``target.plain_torch_threads``: a pass whose every job is a plain decoding step
    ("decode": no draft works for it) runs on that many torch threads, once no pass
    with a verify (around which the draft drafts) has run for ``WIDE_AFTER_S``; a
    pass with any other job, or one within that time of a verify, on the usual
    count; never more threads than the cores the process may run on now (a service
    pinned after it started); and the usual count is back after a wide pass. The
    thread count is read inside each forward. A verify whose caller says its draft
    is idle (``wide``, ``Verify.draft_idle``) counts as a plain step: wide, and no
    reason for the next passes to stay narrow; but not within that time of another
    session's such verify, nor in a pass with one (each caller knows only its own
    draft, which drafts while the other session's verify runs)."""
    import asyncio
    import os

    from specdec.runtime.forward_loop import WIDE_AFTER_S, ForwardLoop
    from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV

    runner = RaggedRunner(load_model(str(llama_pair[1])))
    seen: list[int] = []
    forward = runner.forward

    def recording(feeds):
        seen.append(torch.get_num_threads())
        return forward(feeds)

    runner.forward = recording

    def job(kv):
        yield Feed(kv, [5], 1)

    async def passes(loop, *kinds, kvs=None) -> list[int]:
        """One pass of a job of each kind ("verify idle": ``wide``), each of a new
        session unless ``kvs`` names theirs."""
        seen.clear()
        kvs = kvs or [SessionKV() for _ in kinds]
        runs = (
            loop.run(job(kv), k.split()[0], k.endswith(" idle"))
            for k, kv in zip(kinds, kvs, strict=True)
        )
        await asyncio.gather(*runs)
        return [*seen, torch.get_num_threads()]  # (the count after the passes)

    async def main():
        loop = ForwardLoop(runner, 512, None, threads=(1, 2))
        loop.start()
        try:
            got = {"alone": await passes(loop, "decode", "decode")}  # (one pass)
            got["mixed"] = await passes(loop, "decode", "verify")
            got["after a verify"] = await passes(loop, "decode")
            await asyncio.sleep(WIDE_AFTER_S + 0.01)
            got["later"] = await passes(loop, "decode")
            got["prefill"] = await passes(loop, "prefill")
            got["after a prefill"] = await passes(loop, "decode")
            got["idle verify"] = await passes(loop, "verify idle")
            got["beside a verify"] = await passes(loop, "verify idle", "verify")
            got["idle, after a verify"] = await passes(loop, "verify idle")
            await asyncio.sleep(WIDE_AFTER_S + 0.01)
            got["idle, later"] = await passes(loop, "verify idle", "decode")
            got["after an idle verify"] = await passes(loop, "decode")
            mine = SessionKV()
            await asyncio.sleep(WIDE_AFTER_S + 0.01)
            got["one session's"] = await passes(loop, "verify idle", kvs=[mine])
            got["one session's"] += await passes(loop, "verify idle", kvs=[mine])
            got["another session's"] = await passes(loop, "verify idle")
            await asyncio.sleep(WIDE_AFTER_S + 0.01)
            got["two sessions' in one pass"] = await passes(loop, "verify idle", "verify idle")
            cores = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {min(cores)})
            try:
                got["pinned"] = await passes(loop, "decode")
            finally:
                os.sched_setaffinity(0, cores)
            return got
        finally:
            await loop.aclose()

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = asyncio.run(main())
    finally:
        torch.set_num_threads(before)
    wide = [2, 1] if len(os.sched_getaffinity(0)) >= 2 else [1, 1]
    assert got == {
        "alone": wide,
        "mixed": [1, 1],
        "after a verify": [1, 1],
        "later": wide,
        "prefill": [1, 1],
        "after a prefill": wide,
        "idle verify": wide,
        "beside a verify": [1, 1],
        "idle, after a verify": [1, 1],
        "idle, later": wide,
        "after an idle verify": wide,
        "one session's": wide + wide,
        "another session's": [1, 1],
        "two sessions' in one pass": [1, 1],
        "pinned": [1, 1],
    }, got


@pytest.mark.parametrize(
    "plain,threads,device,env,torch_first,expected",
    [
        (2, 1, "cpu", {}, False, "3000000"),  # set before torch loads
        (2, 0, "cpu:0", {}, False, "3000000"),
        (1, 1, "cpu", {}, False, None),  # no pass takes more threads
        (2, 2, "cpu", {}, False, None),
        (2, 1, "cuda", {}, False, None),  # the passes run on the GPU
        (2, 1, "cpu", {"OMP_WAIT_POLICY": "passive"}, False, None),  # the user's choice
        (2, 1, "cpu", {"GOMP_SPINCOUNT": "5"}, False, "5"),
        (2, 1, "cpu", {}, True, None),  # too late: libgomp read its settings as it loaded
    ],
)
def test_openmp_idle_workers_spin_through_the_drafts_turn_in_a_target_with_plain_threads(
    plain, threads, device, env, torch_first, expected
):
    """``specdec serve target`` with ``plain_torch_threads`` above ``torch_threads``
    sets GOMP_SPINCOUNT before torch loads (``specdec.runtime.openmp``): with libgomp's
    default the worker slept between a lone request's wide verifies, and each verify
    waited for it to wake."""
    import json
    import os
    import subprocess
    import sys

    code = (
        ("import torch\n" if torch_first else "")
        + "import json, os\nfrom specdec.runtime.openmp import long_spins\n"
        + f"long_spins({plain}, {threads}, {device!r})\n"
        + "print(json.dumps(os.environ.get('GOMP_SPINCOUNT')))\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == expected, out


@pytest.mark.parametrize("role", ["target", "draft"])
def test_only_the_target_service_sets_openmp_spins_and_before_torch_loads(
    tmp_path, llama_pair, role
):
    """``specdec serve target`` calls ``long_spins`` before anything it imports loads
    torch (a module that did would leave the setting without effect), with the
    target's settings; the draft never calls it. The serve path runs in a fresh
    interpreter up to the model service's start, which records what happened and
    ends the process."""
    import subprocess
    import sys

    from specdec.local.stack import write_config

    path, _ = write_config(tmp_path, *llama_pair, target__plain_torch_threads=2)
    code = (
        "import asyncio, os, sys\n"
        "import specdec.runtime.openmp as openmp\n"
        "def record(*args):\n"
        "    print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', args)\n"
        "    sys.stdout.flush()\n"
        "    os._exit(0)\n"
        "openmp.long_spins = record\n"
        + (
            ""  # (the target's servicer is not imported first: it loads torch)
            if role == "target"
            else "def started(*args):\n"
            "    print('no spins set before the model service starts')\n"
            "    sys.stdout.flush()\n"
            "    os._exit(0)\n"
            "import draft_service.servicer as servicer\n"
            "servicer.serve = started\n"
        )
        + "from specdec import cli\n"
        f"asyncio.run(cli._serve({role!r}, {str(path)!r}, []))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    want = (
        "torch not loaded (2, 1, 'cpu')"
        if role == "target"
        else "no spins set before the model service starts"
    )
    assert out.stdout.startswith(want), (out.stdout, out.stderr)
