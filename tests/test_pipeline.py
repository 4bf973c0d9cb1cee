"""Pipelined speculation (``orchestrator.pipeline``): the draft paces the steps,
the target runs each block that follows one accepted in full without being
asked, and the orchestrator settles the verdicts as they come.

Through the real gRPC services: greedy output equals ``generate()``, sampled
output has the target's marginals (and a pipeline whose followers skip their
first acceptance test, planted in every process, fails that test), a stopped
pipeline never leaves a block behind that changes later output, and the pure
pieces the three processes must agree on are tested on their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.step import (
    Cursor,
    follows_in_full,
    guess_holds,
    pipeline_draws,
    pipeline_gamma,
    settle,
)
from specdec.runtime.loading import load_tokenizer
from specdec.sampling import SamplingParams, Verdict

from .conftest import WIRE_TOP_K
from .stack import local_stack, planted_env
from .test_bad_input import wait_for_zero_sessions
from .test_overlap import N, _check, _reference

# At any load (the statistical tests send their requests a few at a time) and at
# any round trip (loopback's is short).
PIPELINE = dict(
    orchestrator__pipeline=True,
    orchestrator__relay_max_requests=0,
    orchestrator__pipeline_max_requests=0,
    orchestrator__pipeline_min_rtt_ms=0.0,
)


def _guesses_used(stack) -> float:
    return stack.metric("draft", "specdec_model_draft_guesses_total", 'outcome="used"')


def _lookahead(stack, outcome: str) -> float:
    return stack.metric("target", "specdec_model_lookahead_tokens_total", f'outcome="{outcome}"')


def _blocks(stack, kind: str) -> float:
    return stack.metric("draft", "specdec_model_pipeline_blocks_total", f'kind="{kind}"')


# ---- the pure pieces ---------------------------------------------------------------------


def test_pipeline_draws_are_a_function_of_key_step_and_kind():
    a = pipeline_draws(7, 3, True, 4)
    assert a == pipeline_draws(7, 3, True, 4)
    assert a[2][:2] == pipeline_draws(7, 3, True, 2)[2]  # more uniforms extend fewer
    others = [pipeline_draws(7, 3, False, 4), pipeline_draws(7, 4, True, 4)]
    others.append(pipeline_draws(8, 3, True, 4))
    assert all(o[0] != a[0] and o[1] != a[1] and o[2] != a[2] for o in others)


def test_pipeline_gamma_never_drafts_past_the_tokens_wanted():
    assert pipeline_gamma(10, 4) == 4
    assert pipeline_gamma(3, 4) == 2  # 2 drafts and a bonus or residual: 3 tokens
    assert pipeline_gamma(1, 4) == 0 and pipeline_gamma(0, 4) == 0
    assert pipeline_gamma(100, 64, match=True) == 63  # a greedy follower drafts one more


@pytest.mark.parametrize("match", [False, True])
def test_the_targets_follow_test_is_settles(match):
    """``follows_in_full`` (the target's) chains exactly when ``settle`` (the draft's
    and the orchestrator's) says the block that follows is used, from the same cursor."""
    target, draft = Cursor(10, (5,)), Cursor(9, (4, 5))
    drafts = [6, 7, 8]
    u = [0.5, 0.5, 0.5]
    for p in ([0.9, 0.9, 0.9], [0.9, 0.2, 0.9], [0.9, 0.9, 0.1]):
        for bonus in (11, 12):
            verdict = Verdict(p, [0.6, 0.6, 0.6], [1, 2, 3], bonus)
            out = settle(
                target,
                draft,
                drafts,
                verdict,
                u,
                chain=not match,
                ahead_first=11 if match else None,
            )
            got = follows_in_full(target.end, len(drafts), verdict, u, match, 11)
            assert (got is not None) == out.chained, (p, bonus)
            if got is not None:
                assert got == out.target


def test_the_targets_guess_test_is_settles():
    """``guess_holds`` (the target's test of a guess for the rejection of draft j with
    token y) holds exactly when ``settle`` rejects draft j and emits y there, and the
    cursors a guess is drafted and run from are the ones ``settle`` returns."""
    target, draft = Cursor(10, (5,)), Cursor(9, (4, 5))
    drafts = [6, 7, 8]
    u = [0.5, 0.5, 0.5]
    residuals = [21, 22, 23]
    for p in ([0.9, 0.9, 0.9], [0.1, 0.9, 0.9], [0.9, 0.2, 0.9], [0.9, 0.9, 0.1]):
        verdict = Verdict(p, [0.6, 0.6, 0.6], residuals, 11)
        out = settle(target, draft, drafts, verdict, u)
        for rejected_at in (1, 2, 3):
            for token in (residuals[rejected_at - 1], 99):
                got = guess_holds(len(drafts), verdict, u, rejected_at, token)
                want = out.accepted == rejected_at - 1 < len(drafts) and out.tokens[-1] == token
                assert got == want, (p, rejected_at, token)
                if got:  # the target's and the draft's cursors for the guess (pipeline.py)
                    assert Cursor(target.end + rejected_at - 1, (token,)) == out.target
                    assert Cursor(draft.end + rejected_at - 1, (token,)) == out.draft


# ---- through the services ----------------------------------------------------------------


@pytest.fixture(scope="module")
def piped(tmp_path_factory, llama_pair):
    with local_stack(
        tmp_path_factory.mktemp("pipeline"),
        *llama_pair,
        orchestrator__wire_top_k=WIRE_TOP_K,
        **PIPELINE,
    ) as stack:
        yield stack


def _greedy_equals_generate(stack, llama_pair, overlap: bool) -> None:
    """Greedy output equals ``generate()``'s for gamma 1-5, drafting ahead or not."""
    _, target = llama_pair
    ids = load_tokenizer(str(target)).encode("we shall pipeline")
    want = _reference(target, ids, 40)
    for gamma in (1, 2, 3, 5):
        got, _, stats = stack.generate_raw(
            prompt=ids, max_new_tokens=40, temperature=0.0, gamma=gamma, overlap=overlap
        )
        assert got == want, gamma
        if not overlap:  # paced: nothing drafted ahead, and the draft's forwards of the
            assert stats.overlapped_steps == 0  # blocks nobody asked for reach the stats
            assert stats.draft_forward_s > 0
    wait_for_zero_sessions(stack)


def test_greedy_equals_generate_pipelined(piped, llama_pair):
    followers = _blocks(piped, "follower")
    _greedy_equals_generate(piped, llama_pair, overlap=True)
    assert _blocks(piped, "follower") > followers


def test_pipelined_steps_feed_the_adaptive_cost_model(piped, llama_pair):
    """A pipeline's steps are timed and priced as their own kind, its first propose's
    costs are learnt, and greedy rejections tell how many the guesses covered: the
    adaptive policy prices drafting ahead as a pipeline's steps from these."""
    _, target = llama_pair
    ids = load_tokenizer(str(target)).encode("the cost of a pipelined step")
    piped.generate_raw(prompt=ids, max_new_tokens=40, temperature=0.0, gamma=3, overlap=True)
    estimate = "specdec_adaptive_estimate"
    assert piped.metric("orchestrator", estimate, 'quantity="step_time_ratio_pipelined"') > 0
    assert piped.metric("orchestrator", estimate, 'quantity="draft_token_seconds"') > 0
    assert 0 <= piped.metric("orchestrator", estimate, 'quantity="pipeline_guess_cover"') <= 1


@pytest.mark.parametrize("lookahead", [0, 2])
def test_greedy_guesses_on_the_demo_pair(tmp_path, lookahead):
    """On the bundled demo pair the draft's second choice is the target's token at
    most greedy rejections, so guessed blocks run at once; output is still
    ``generate()``'s, also where the target decodes on its own while it waits
    (``target.lookahead_tokens``)."""
    demo = Path(__file__).resolve().parent.parent / "models" / "demo"
    draft, target = demo / "draft", demo / "target"
    tok = load_tokenizer(str(target))
    prompts = [tok.encode(t) for t in ("It is a truth", "Emma Woodhouse, handsome")]
    with local_stack(
        tmp_path, draft, target, target__lookahead_tokens=lookahead, **PIPELINE
    ) as stack:
        for ids in prompts:
            want = _reference(target, ids, 48)
            for gamma in (2, 4):
                got, _, _ = stack.generate_raw(
                    prompt=ids, max_new_tokens=48, temperature=0.0, gamma=gamma, overlap=True
                )
                assert got == want, gamma
        assert _guesses_used(stack) > 0  # a rejection's block, run at once
        assert _blocks(stack, "follower") > 0
        assert (_lookahead(stack, "used") > 0) == bool(lookahead)
        wait_for_zero_sessions(stack)


@pytest.mark.parametrize("lookahead", [1, 3])
def test_greedy_equals_generate_with_the_targets_lookahead(tmp_path, llama_pair, lookahead):
    """The target decodes its own continuation while it waits for a block and judges
    the block's drafts against it: on the tiny random pair nearly every block is
    rejected early, so most verdicts come from that continuation with no pass; output
    is still ``generate()``'s for every gamma, and no session is left behind."""
    draft, target = llama_pair
    ids = load_tokenizer(str(target)).encode("the target decodes while it waits")
    want = _reference(target, ids, 40)
    with local_stack(
        tmp_path, draft, target, target__lookahead_tokens=lookahead, **PIPELINE
    ) as stack:
        for gamma in (1, 2, 3, 5):
            got, _, _ = stack.generate_raw(
                prompt=ids, max_new_tokens=40, temperature=0.0, gamma=gamma, overlap=True
            )
            assert got == want, gamma
        assert _lookahead(stack, "used") > 0 and _lookahead(stack, "decoded") > 0
        wait_for_zero_sessions(stack)


def test_greedy_chains_when_every_draft_is_accepted(tmp_path, llama_pair):
    """With the target as its own draft every draft is accepted, so nearly every block
    follows the one before (a greedy follower's first token is the bonus), and the
    output is still ``generate()``'s, at each depth, also when the request ends on a
    stop string in the middle of a pipeline; nothing is left of it afterwards."""
    _, target = llama_pair
    tok = load_tokenizer(str(target))
    ids = tok.encode("all of it")
    want = _reference(target, ids, 33)
    for depth in (1, 3):
        with local_stack(
            tmp_path / f"d{depth}", target, target, orchestrator__pipeline_depth=depth, **PIPELINE
        ) as stack:
            for gamma in (2, 4):
                got, _, stats = stack.generate_raw(
                    prompt=ids, max_new_tokens=33, temperature=0.0, gamma=gamma, overlap=True
                )
                assert got == want, (depth, gamma)
                assert stats.accepted_tokens == stats.drafted_tokens
                assert stats.overlapped_steps >= stats.steps - 2, stats
            stop = tok.decode(want[12:14])
            got, text, stats = stack.generate_raw(
                prompt=ids, max_new_tokens=33, temperature=0.0, gamma=3, overlap=True,
                stop=[stop],
            )  # fmt: skip
            assert stats.finish_reason == "stop" and got == want[: len(got)]
            again, _, _ = stack.generate_raw(
                prompt=ids, max_new_tokens=33, temperature=0.0, gamma=3, overlap=True
            )
            assert again == want
            assert _blocks(stack, "follower") > 10
            wait_for_zero_sessions(stack)


def test_a_pipeline_stops_when_others_start_and_output_does_not_change(tmp_path, llama_pair):
    """A request alone pipelines; once others generate too it goes back to steps it
    asks for (the rest of its pipeline refused): greedy output is unchanged."""
    from concurrent.futures import ThreadPoolExecutor

    _, target = llama_pair
    prompts = [[3, 9, 27, 4 + i] for i in range(4)]
    want = [_reference(target, p, 48) for p in prompts]

    overrides = {**PIPELINE, "orchestrator__pipeline_max_requests": 1}
    with local_stack(tmp_path, *llama_pair, **overrides) as stack:

        def one(i):
            return stack.generate_raw(
                prompt=prompts[i], max_new_tokens=48, temperature=0.0, gamma=3, overlap=True
            )[0]

        alone = one(0)
        first = _blocks(stack, "first")
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, range(4)))
        wait_for_zero_sessions(stack)
    assert alone == want[0] and first >= 1
    assert got == want


@pytest.mark.slow
def test_pipelined_sampling_follows_the_target(piped, llama_pair):
    """T=1, gamma 1: the target's marginals at positions 1-3, with steps whose block
    followed the one before (its first draft tested at the bonus position)."""
    results, chained = _check(piped, llama_pair, SamplingParams(1.0))
    assert chained > N // 10, f"only {chained} of {N} requests chained a step"
    for name, (dist, threshold) in results.items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"


BROKEN_FOLLOWERS = """
import draft_service.pipeline as drafting
import orchestrator.engine as engine
import orchestrator.step as s
_draws = s.pipeline_draws
def _accept_first(key, index, kind, n):  # BROKEN: a follower's first draft always passes
    d, t, u = _draws(key, index, kind, n)
    return d, t, ([0.0] + u[1:]) if kind == s.FOLLOWER and u else u
s.pipeline_draws = drafting.pipeline_draws = engine.pipeline_draws = _accept_first
"""


@pytest.mark.slow
def test_a_pipeline_whose_followers_skip_their_first_test_fails_the_same_test(tmp_path, llama_pair):
    """Planted in every process (so that draft, target and orchestrator still agree):
    the first draft of a block that follows one accepted in full is accepted
    without its test against the p the target kept for that position."""
    with local_stack(
        tmp_path / "stack",
        *llama_pair,
        env=planted_env(tmp_path, BROKEN_FOLLOWERS),
        orchestrator__wire_top_k=WIRE_TOP_K,
        **PIPELINE,
    ) as stack:
        results, chained = _check(stack, llama_pair, SamplingParams(1.0))
    assert chained > N // 10, f"only {chained} of {N} requests chained a step"
    failed = [k for k, (d, t) in results.items() if d >= t]
    assert failed, f"the broken pipeline passed: {results}"


# ---- paced steps (orchestrator.paced: pipelines of depth 0) -------------------------------
# At any load, as PIPELINE; sequential steps start them by default.
PACED = dict(orchestrator__relay_max_requests=0, orchestrator__pipeline_max_requests=0)


@pytest.fixture(scope="module")
def paced(tmp_path_factory, llama_pair):
    with local_stack(
        tmp_path_factory.mktemp("paced"), *llama_pair, orchestrator__wire_top_k=WIRE_TOP_K, **PACED
    ) as stack:
        yield stack


def test_greedy_equals_generate_paced(paced, llama_pair):
    """Sequential steps are paced by the draft: after each verdict it drafts and relays
    the next block itself, a block accepted in full included (no follower exists)."""
    fresh = _blocks(paced, "fresh")
    _greedy_equals_generate(paced, llama_pair, overlap=False)
    assert _blocks(paced, "fresh") > fresh + 10
    assert _blocks(paced, "follower") == 0 and _guesses_used(paced) == 0


def test_paced_with_every_draft_accepted(tmp_path, llama_pair):
    """The target as its own draft: every block is accepted in full and keeps its bonus
    (no follower takes its position), the output is ``generate()``'s, also ended by a
    stop string mid-pipeline, and nothing is left of it afterwards."""
    _, target = llama_pair
    tok = load_tokenizer(str(target))
    ids = tok.encode("all of it, paced")
    want = _reference(target, ids, 33)
    with local_stack(tmp_path, target, target, **PACED) as stack:
        for gamma in (2, 4):
            got, _, stats = stack.generate_raw(
                prompt=ids, max_new_tokens=33, temperature=0.0, gamma=gamma, overlap=False
            )
            assert got == want, gamma
            assert stats.accepted_tokens == stats.drafted_tokens
            assert stats.steps <= -(-33 // (gamma + 1)) + 1, stats
        stop = tok.decode(want[12:14])
        got, _, stats = stack.generate_raw(
            prompt=ids, max_new_tokens=33, temperature=0.0, gamma=3, overlap=False, stop=[stop]
        )
        assert stats.finish_reason == "stop" and got == want[: len(got)]
        again, _, _ = stack.generate_raw(
            prompt=ids, max_new_tokens=33, temperature=0.0, gamma=3, overlap=False
        )
        assert again == want
        assert _blocks(stack, "fresh") > 10 and _blocks(stack, "follower") == 0
        wait_for_zero_sessions(stack)


def _retuned_requests(stack, llama_pair, monkeypatch, overlap: bool, setting: str) -> list[int]:
    """Adaptive requests (gamma unset) of an orchestrator in this process, on the
    stack's draft and target services, whose choices are scripted
    (``RequestPolicy.choose`` cycling through gammas 2, 5, 1, 4, 3, drafting ahead or
    not: ``overlap``): every verdict of their pipeline brings a retune. Greedy output
    stays ``generate()``'s; sampled requests end with no step lost or decoded plain
    (a block whose uniforms the orchestrator and the draft drew for different gammas
    would be: its seed would not be the one the orchestrator waits for). Then, with
    ``orchestrator.<setting>`` off, one greedy request sends no retune. Returns the
    lengths of the blocks the first request's steps verified (its first gamma: 2)."""
    import asyncio
    import dataclasses
    import itertools

    from orchestrator import adaptive
    from orchestrator.engine import Chunk, Orchestrator
    from orchestrator.requests import parse
    from specdec import metrics
    from specdec.config import Config, ModelServiceConfig
    from specdec.v1 import orchestrator_pb2

    draft_dir, target_dir = llama_pair
    ids = load_tokenizer(str(target_dir)).encode("retuned as it goes")
    want = _reference(target_dir, ids, 40)
    gammas = itertools.cycle((2, 5, 1, 4, 3))
    monkeypatch.setattr(
        adaptive.RequestPolicy,
        "choose",
        lambda self, limit, run=1: (min(next(gammas), limit), overlap),
    )
    lengths: list[int] = []
    observe = adaptive.RequestPolicy.observe
    monkeypatch.setattr(
        adaptive.RequestPolicy,
        "observe",
        lambda self, drafted, accepted: (lengths.append(drafted), observe(self, drafted, accepted)),
    )
    config = Config(
        draft=ModelServiceConfig(model=str(draft_dir)),
        target=ModelServiceConfig(model=str(target_dir)),
    )
    config.orchestrator = dataclasses.replace(
        config.orchestrator,
        draft_address=stack.address("draft"),
        target_address=stack.address("target"),
        relay_max_requests=0,
        pipeline=overlap,
        pipeline_max_requests=0,
        pipeline_min_rtt_ms=0.0,
        relay_timeout_s=5.0,
    )

    def count(counter, *labels) -> float:
        return (counter.labels(*labels) if labels else counter)._value.get()

    async def scenario(config, temperatures=(0.0, 0.0, 1.0, 1.0)) -> list[tuple[list[int], object]]:
        orch = Orchestrator(config)
        await orch.connect()
        out = []
        try:
            for temperature in temperatures:  # (unseeded: a seed fixes gamma)
                req = orchestrator_pb2.GenerateRequest(max_new_tokens=40, temperature=temperature)
                req.token_ids.ids.extend(ids)
                spec = parse(
                    req, orch.cfg.orchestrator, orch.tokenizer, orch.target_info, None, 4096
                )
                got, stats = [], None
                async for item in orch.generate(spec, asyncio.get_running_loop().time()):
                    if isinstance(item, Chunk):
                        got += item.token_ids
                    else:
                        stats = item
                out.append((got, stats))
        finally:
            await orch.aclose()
        return out

    retunes, lost = count(metrics.PIPELINE_RETUNES), count(metrics.RELAYED_STEPS, "lost")
    runs = asyncio.run(scenario(config))
    for temperature, (got, stats) in zip((0, 0, 1, 1), runs, strict=True):
        assert stats.adaptive and stats.fallback_steps == 0, stats
        assert stats.generated == len(got) == 40, stats
        if temperature == 0:
            assert got == want
    assert count(metrics.RELAYED_STEPS, "lost") == lost  # (the two sides drew alike)
    assert count(metrics.PIPELINE_RETUNES) - retunes >= 10
    retuned = lengths[: runs[0][1].steps]
    # Off: the pipeline keeps its first gamma.
    config.orchestrator = dataclasses.replace(config.orchestrator, **{setting: False})
    retunes = count(metrics.PIPELINE_RETUNES)
    [(got, stats)] = asyncio.run(scenario(config, (0.0,)))
    assert got == want and stats.adaptive and count(metrics.PIPELINE_RETUNES) == retunes
    wait_for_zero_sessions(stack)
    return retuned


def test_adaptive_paced_requests_retune_the_draft_and_stay_exact(paced, llama_pair, monkeypatch):
    """An adaptive request chooses its gamma after every paced verdict, as its asked
    steps would, and sends a changed one to the draft, which drafts with it from its
    next undecided block on and says which (``DraftRequest.retune``)."""
    fresh = _blocks(paced, "fresh")
    _retuned_requests(paced, llama_pair, monkeypatch, overlap=False, setting="paced_retune")
    assert _blocks(paced, "fresh") > fresh + 10


def test_adaptive_pipelined_requests_retune_and_stay_exact(piped, llama_pair, monkeypatch):
    """The same for pipelines that draft ahead (``orchestrator.pipeline_retune``): the
    draft drafts every block after a retune with the new gamma, and the orchestrator
    reads each block's length from its verdict, so blocks of one pipeline come in
    several lengths, drafted ahead or not."""
    followers = _blocks(piped, "follower")
    lengths = _retuned_requests(
        piped, llama_pair, monkeypatch, overlap=True, setting="pipeline_retune"
    )
    assert _blocks(piped, "follower") > followers
    assert len(set(lengths) - {0}) >= 3, lengths


@pytest.mark.slow
def test_paced_sampling_follows_the_target(paced, llama_pair):
    """T=1, gamma 1, sequential steps paced by the draft: the target's marginals at
    positions 1-3 (a block accepted in full keeps its bonus: none chains)."""
    results, chained = _check(paced, llama_pair, SamplingParams(1.0), overlap=False)
    assert chained == 0
    for name, (dist, threshold) in results.items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"
