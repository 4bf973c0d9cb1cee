"""Overlapped speculation (the draft drafts block k+1 while the target verifies
block k) keeps the output exactly the target's.

* exact: the emitted distribution of a two-block pipelined step, built from
  the same pieces the engine uses (min(1, p/q) acceptance and
  ``residual_distribution``), equals p in float64; a pipeline that also emits
  the bonus when it chains does not;
* greedy: equal to ``generate()`` for every gamma, overlapped or not, and an
  overlapped greedy step keeps its bonus (the block drafted ahead is used when
  its first token is the bonus);
* statistical, through the gRPC services: the tokens at positions 1, 2 and 3
  of requests that chain (gamma 1, every draft drafted ahead) follow the
  target's marginals, also with drafting on and sampled guesses; the same test
  run against an orchestrator that takes the first token of a block drafted
  ahead without testing it must fail (in-process, where it is quicker to
  plant), and so must a target planted to emit the draft's guess of its
  residual draw whenever it gets one.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.runtime.loading import load_model, load_tokenizer
from specdec.sampling import SamplingParams, probs_from_logits, residual_distribution

from .conftest import WIRE_TOP_K
from .inprocess import in_process
from .stack import drafted_on, guesses_used, local_stack, planted_env
from .stats import CONCURRENT, tv, tv_threshold

# ---- exact: the pipelined step's output distribution ----------------------------------------


def _tables(vocab: int, seed: int):
    """p and q for three positions: p1 [V], p2 [V, V] (row = t1), p3 [V, V, V]; q alike."""
    g = torch.Generator().manual_seed(seed)

    def rows(*shape):
        return (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * 2).softmax(-1)

    p = rows(), rows(vocab), rows(vocab, vocab)
    q = rows(), rows(vocab), rows(vocab, vocab)
    return p, q


def _one_position(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The emitted distribution of one speculated position: accept x ~ q with
    probability min(1, p(x)/q(x)), else draw from ``residual_distribution``."""
    accepted = torch.minimum(p, q)
    return accepted + (1.0 - accepted.sum()) * residual_distribution(p, q)


def pipelined_joint(p, q, broken: bool = False) -> torch.Tensor:
    """P(t1, t2, t3) with gamma 1 and one block drafted ahead at every step.

    x ~ q1 is verified against p1 while y ~ q2[x] is drafted ahead. If x is
    accepted the step chains: y takes position 2, tested against p2[x] (the p the
    target computed after x), and position 3 comes from the next verdict (exact
    from there on, by the sequential identity). If x is rejected, t1 is the
    residual draw, y is discarded and the next steps are ordinary ones.
    ``broken``: on chaining, the bonus b ~ p2[x] is emitted too, so y (tested
    against p2[x]) lands at position 3 where p3[x, b] was due.
    """
    (p1, p2, p3), (q1, q2, _) = p, q
    vocab = p1.shape[0]
    joint = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    accepted = torch.minimum(p1, q1)
    rejected = 1.0 - accepted.sum()
    r1 = residual_distribution(p1, q1)
    for x in range(vocab):
        if broken:
            # t2 = b ~ p2[x]; t3 = y, distributed as the speculated p2[x].
            joint[x] += accepted[x] * p2[x][:, None] * _one_position(p2[x], q2[x])[None, :]
        else:
            # t2 = y tested against p2[x]; t3 exact: p3[x, t2].
            joint[x] += accepted[x] * _one_position(p2[x], q2[x])[:, None] * p3[x]
    joint += rejected * r1[:, None, None] * p2[:, :, None] * p3
    return joint


def _want(p) -> torch.Tensor:
    p1, p2, p3 = p
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize("seed", range(5))
def test_pipelined_step_emits_exactly_p(seed):
    p, q = _tables(5, seed)
    torch.testing.assert_close(pipelined_joint(p, q), _want(p), rtol=0, atol=1e-12)


def test_the_identity_catches_a_pipeline_that_also_emits_the_bonus():
    p, q = _tables(5, 0)
    broken = pipelined_joint(p, q, broken=True)
    assert abs(float(broken.sum()) - 1.0) < 1e-12  # still a distribution ...
    assert (broken - _want(p)).abs().max() > 1e-3  # ... but not the target's


# ---- greedy: every gamma, overlapped or not ---------------------------------------------------


def _reference(target_dir, ids: list[int], n: int) -> list[int]:
    model = load_model(str(target_dir))
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
    )
    return out[0, len(ids) :].tolist()


def test_greedy_equals_generate_overlapped_or_not(llama_pair):
    draft, target = llama_pair
    ids = load_tokenizer(str(target)).encode("we shall overlap")
    want = _reference(target, ids, 30)

    async def scenario():
        async with in_process(draft, target) as system:
            chained = 0
            for gamma in (1, 2, 3, 5, 8):
                for overlap in (False, True):
                    got, _, stats = await system.generate(
                        prompt=ids, max_new_tokens=30, temperature=0.0, gamma=gamma, overlap=overlap
                    )
                    assert got == want, (gamma, overlap)
                    if not overlap:
                        assert stats.overlapped_steps == 0
                    chained += stats.overlapped_steps
            # With the target as its own draft every draft is accepted, so steps chain.
            async with in_process(target, target) as same:
                _, _, stats = await same.generate(
                    prompt=ids, max_new_tokens=30, temperature=0.0, gamma=3, overlap=True
                )
            return chained, stats

    chained, stats = asyncio.run(scenario())
    assert stats.overlapped_steps >= 4 and stats.accepted == stats.drafted
    # Greedy overlap keeps the bonus: every step emits gamma + 1 = 4 of the 30 tokens
    # (a chain that took the bonus position would emit 3 per chained step: 10 steps).
    assert stats.steps == 8 and stats.generated == 30, stats


# ---- statistical, through gRPC ---------------------------------------------------------------

N = 1500
PROMPT = [3, 7, 1, 4, 0, 12]


def _exact_positions(pair, params: SamplingParams):
    """The target's marginals at positions 1, 2 and 3 after PROMPT: [V] each."""
    draft_dir, target_dir = pair
    target = load_model(str(target_dir))
    vocab = target.config.vocab_size
    grid = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V*V, 2]
    seqs = torch.cat([torch.tensor(PROMPT).expand(len(grid), -1), grid], dim=1)
    with torch.no_grad():
        tl = torch.cat([target(chunk).logits[:, -3:].float() for chunk in seqs.split(512)])
    p1 = probs_from_logits(tl[0, 0], params).double()  # [V]
    p2 = probs_from_logits(tl[::vocab, 1], params).double()  # [V, V], row = t1
    p3 = probs_from_logits(tl[:, 2], params).double().reshape(vocab, vocab, vocab)
    m2 = p1 @ p2
    m3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    return p1, m2, m3


def _fields(seed: int, params: SamplingParams, overlap: bool = True) -> dict:
    return dict(prompt=PROMPT, max_new_tokens=4, temperature=params.temperature,
                top_k=params.top_k, top_p=params.top_p, gamma=1, overlap=overlap,
                seed=seed)  # fmt: skip


def _columns(rows):
    x1, x2, x3, chained = (torch.tensor(col) for col in zip(*rows, strict=True))
    return x1, x2, x3, int((chained > 0).sum())


def _sample(stack, params: SamplingParams, overlap: bool = True):
    def one(seed):
        ids, _, st = stack.generate_raw(**_fields(seed, params, overlap))
        return ids[0], ids[1], ids[2], st.overlapped_steps

    with ThreadPoolExecutor(CONCURRENT) as pool:
        return _columns(list(pool.map(one, range(N))))


def _sample_in_process(pair, params: SamplingParams, draft: dict | None = None):
    async def scenario():
        async with in_process(*pair, draft=draft, wire_top_k=WIRE_TOP_K) as system:
            slots = asyncio.Semaphore(CONCURRENT)

            async def one(seed):
                async with slots:
                    ids, _, st = await system.generate(**_fields(seed, params))
                return ids[0], ids[1], ids[2], st.overlapped_steps

            return await asyncio.gather(*(one(seed) for seed in range(N)))

    return _columns(asyncio.run(scenario()))


def _check(stack, pair, params, draft: dict | None = None, overlap: bool = True):
    """``stack``: the gRPC services, or None for the in-process engine (``draft``: its
    draft service's settings). ``overlap``: the requests draft ahead (through the
    services only)."""
    p1, p2, p3 = _exact_positions(pair, params)
    if stack:
        sampled = _sample(stack, params, overlap)
    else:
        sampled = _sample_in_process(pair, params, draft)
    x1, x2, x3, chained = sampled
    results = {
        "position 1": (tv(x1, p1), tv_threshold(p1, N)),
        "position 2": (tv(x2, p2), tv_threshold(p2, N)),
        "position 3": (tv(x3, p3), tv_threshold(p3, N)),
    }
    print({k: f"tv {d:.4f} (threshold {t:.4f})" for k, (d, t) in results.items()}, chained)
    return results, chained


@pytest.mark.slow
def test_overlapped_sampling_follows_the_target(llama_stack, llama_pair):
    results, chained = _check(llama_stack, llama_pair, SamplingParams(1.0))
    assert chained > N // 10, f"only {chained} of {N} requests chained a step"
    for name, (dist, threshold) in results.items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"


@pytest.mark.slow
def test_overlapped_sampling_follows_the_target_when_drafting_on(tmp_path, llama_pair):
    """Every step relayed, with drafting on: after a step that rejects, the next
    proposal comes from a head start the draft drafted on the echoed verdict, while
    the orchestrator also asked for the block drafted ahead (``DraftOn.ahead``), or
    from a guess (``draft.sampled_guesses``): every rejection's residual draw is
    coupled to the draft's guess there (docs/exactness.md, 4f)."""
    with local_stack(
        tmp_path / "stack",
        *llama_pair,
        orchestrator__wire_top_k=WIRE_TOP_K,
        orchestrator__relay_max_requests=0,
        draft__sampled_guesses=4,
    ) as stack:
        results, chained = _check(stack, llama_pair, SamplingParams(1.0))
        used = drafted_on(stack, "used")
        guessed = guesses_used(stack)
    print("head starts used", used, "guesses used", guessed)
    assert chained > N // 10, f"only {chained} of {N} requests chained a step"
    assert used > N // 10, f"only {used} head starts were used"
    assert guessed > N // 100, f"only {guessed} guesses were used"
    for name, (dist, threshold) in results.items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"


@pytest.mark.slow
def test_sampled_guesses_over_the_hidden_wire_with_top_k_and_top_p_follow_the_target(
    tmp_path, llama_pair
):
    """The same with q derived from the draft's hidden states on both sides (the
    draft's guesses are draws from that q without x_i) and a q whose support top-k
    and top-p cut (the guesses never leave it)."""
    draft, target = llama_pair
    params = SamplingParams(0.8, top_k=12, top_p=0.9)
    with local_stack(
        tmp_path / "stack",
        draft,
        target,
        orchestrator__relay_max_requests=0,
        draft__sampled_guesses=4,
        draft__hidden_q=True,
        target__draft_head=str(draft),
    ) as stack:
        results, chained = _check(stack, llama_pair, params)
        guessed = guesses_used(stack)
    print("guesses used", guessed)
    assert chained > N // 10, f"only {chained} of {N} requests chained a step"
    assert guessed > 0, "no guess was used"
    for name, (dist, threshold) in results.items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"


def test_in_process_sampled_guesses_follow_the_target(llama_pair):
    """In one process (no relays: the guesses go with the engine's own verify)."""
    from specdec import metrics

    def coupled() -> float:
        return sum(metrics.RESIDUAL_GUESSES.labels(o)._value.get() for o in ("kept", "redrawn"))

    before = coupled()
    results, chained = _check(None, llama_pair, SamplingParams(1.0), {"sampled_guesses": 4})
    assert coupled() - before > N // 2, "the draws were not coupled to guesses"
    assert chained > N // 10, f"only {chained} of {N} requests chained a step"
    for name, (dist, threshold) in results.items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"


BROKEN_COUPLING = """
import specdec.sampling as s
_coupling = s.guess_coupling
def _always_keep(r, g, y):  # BROKEN: the draft's guess is emitted whenever it is sent
    return 1.0, _coupling(r, g, y)[1]
s.guess_coupling = _always_keep
"""


@pytest.mark.slow
def test_a_broken_coupling_of_the_drafts_guesses_fails_the_same_test(tmp_path, llama_pair):
    """The stack of the test above, with the target emitting the draft's guess of its
    residual draw whenever there is one (``sampling.guess_coupling``, planted)."""
    with local_stack(
        tmp_path / "stack",
        *llama_pair,
        env=planted_env(tmp_path, BROKEN_COUPLING),
        orchestrator__wire_top_k=WIRE_TOP_K,
        orchestrator__relay_max_requests=0,
        draft__sampled_guesses=4,
    ) as stack:
        results, chained = _check(stack, llama_pair, SamplingParams(1.0))
    assert chained > N // 10, f"only {chained} of {N} requests chained a step"
    failed = [k for k, (d, t) in results.items() if d >= t]
    assert failed, f"the broken coupling passed: {results}"


def test_a_pipeline_that_skips_the_chained_test_fails_the_same_test(llama_pair, monkeypatch):
    import orchestrator.engine as engine

    settle = engine.settle

    def broken(target, draft, drafts, verdict, u, chain=False, ahead_first=None):
        if drafts and not target.pending:
            # BROKEN: a draft drafted ahead was made "as if accepted": take its first
            # token without testing it against the p kept for that position.
            u = [0.0] + list(u[1:])
        return settle(target, draft, drafts, verdict, u, chain=chain, ahead_first=ahead_first)

    monkeypatch.setattr(engine, "settle", broken)
    results, chained = _check(None, llama_pair, SamplingParams(1.0))  # in-process: quicker
    assert chained > N // 10, f"only {chained} of {N} requests chained a step"
    failed = [k for k, (d, t) in results.items() if d >= t]
    assert failed, f"the broken pipeline passed: {results}"
