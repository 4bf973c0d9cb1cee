"""Sampled output through the real gRPC services has the target's distribution.

For a fixed prompt, requests of 3 new tokens with gamma = 2 (each its own
seed) are run through draft, target and orchestrator. We compare:
* the tokens at positions 1 and 2 with the target's exact distributions
  p(x1) and sum_x1 p(x1) p(x2 | x1) under the same warping;
* the accepted count n of the first step with the theory
  P(n >= 1) = alpha_1, P(n = 2) = sum_x min(p1, q1)(x) alpha_2(x).
Distance: total variation; threshold: tests/stats.py (99.9th percentile
under correct sampling at the same sample size). The same test run against a
target whose residual is replaced by p (the classic bug) must fail.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.runtime.loading import load_model
from specdec.sampling import SamplingParams, acceptance_rate, probs_from_logits, sparse_q

from .conftest import WIRE_TOP_K
from .stack import drafted_on, local_stack, planted_env
from .stats import CONCURRENT, tv, tv_threshold

N = 1500
PROMPT = [3, 7, 1, 4, 0, 12]  # token ids; fixed
BROKEN_SITE = """
import specdec.kernels as k
import specdec.sampling as s
s.residual_distribution = lambda p, q: p  # BROKEN: resample from p on rejection
k.ENABLED = False  # (on the reference path, where the bug is planted)
"""


def exact(pair, params: SamplingParams, wire_top_k: int):
    """(p1 [V], p2 marginal [V], P(n) [3]) computed directly from the models (n: the
    first step's accepted count at gamma 2)."""
    draft_dir, target_dir = pair
    target, draft = load_model(str(target_dir)), load_model(str(draft_dir))
    vocab = target.config.vocab_size
    seqs = torch.tensor([PROMPT + [x] for x in range(vocab)])  # [V, L+1]
    with torch.no_grad():
        tl = target(seqs).logits.float()  # [V, L+1, V]
        dl = draft(seqs).logits.float()
    p1 = probs_from_logits(tl[0, -2], params).double()  # [V]
    p2 = probs_from_logits(tl[:, -1], params).double()  # [V, V] row = x1

    def q_of(logits):  # exactly the proposal the draft service samples from and sends
        return sparse_q(logits, params, wire_top_k, eps=0.0).dense()

    q1 = q_of(dl[0, -2])
    q2 = torch.stack([q_of(dl[x, -1]) for x in range(vocab)])
    alpha1 = float(acceptance_rate(p1, q1))
    p_n2 = float((torch.minimum(p1, q1) * acceptance_rate(p2, q2)).sum())
    n_dist = torch.tensor([1 - alpha1, alpha1 - p_n2, p_n2], dtype=torch.float64)
    return p1, p1 @ p2, n_dist


def sample(stack, params: SamplingParams, gamma: int = 2, sequential: bool = False):
    more = {"overlap": False} if sequential else {}

    def one(seed):
        ids, _, st = stack.generate_raw(
            prompt=PROMPT,
            max_new_tokens=3,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            gamma=gamma,
            seed=seed,
            **more,
        )
        # First step's n: n = 2 emits 3 tokens in one step; n = 1 leaves a gamma-0
        # step (2 drafted in all); n = 0 leaves a gamma-1 step (3 drafted). (With
        # gamma 1 the totals do not tell n apart; only positions are checked.)
        n = 2 if st.steps == 1 else (1 if st.drafted_tokens == 2 else 0)
        return ids[0], ids[1], n

    with ThreadPoolExecutor(CONCURRENT) as pool:
        rows = list(pool.map(one, range(N)))
    return [torch.tensor(col) for col in zip(*rows, strict=True)]


def check(stack, pair, params, gamma: int = 2, sequential: bool = False):
    # The theory uses the q the draft really sends: truncated to the stack's wire_top_k.
    p1, p2, n_dist = exact(pair, params, stack.config["orchestrator"]["wire_top_k"])
    x1, x2, n = sample(stack, params, gamma, sequential)
    results = {
        "position 1": (tv(x1, p1), tv_threshold(p1, N)),
        "position 2": (tv(x2, p2), tv_threshold(p2, N)),
    }
    if gamma == 2:
        results["accepted n"] = (tv(n, n_dist), tv_threshold(n_dist, N))
    print({k: f"tv {d:.4f} (threshold {t:.4f})" for k, (d, t) in results.items()})
    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(1.0, top_k=12, top_p=0.9)],
    ids=["t1", "t1-topk12-topp0.9"],
)
def test_sampled_tokens_follow_target_distribution(llama_stack, llama_pair, params):
    for name, (dist, threshold) in check(llama_stack, llama_pair, params).items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"


@pytest.mark.slow
def test_sampled_tokens_follow_target_distribution_when_drafting_on(tmp_path, llama_pair):
    """Every step relayed (``relay_max_requests`` 0), sequential, with drafting on, gamma 1: after
    a rejection, the second token comes from a step the draft drafted on the target's
    echoed verdict before it was asked (``DraftOn``)."""
    with local_stack(
        tmp_path / "stack",
        *llama_pair,
        orchestrator__wire_top_k=WIRE_TOP_K,
        orchestrator__relay_max_requests=0,
        orchestrator__paced=False,  # (paced steps: tests/test_pipeline.py)
    ) as stack:
        results = check(stack, llama_pair, SamplingParams(1.0), gamma=1, sequential=True)
        used = drafted_on(stack, "used")
    for name, (dist, threshold) in results.items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"
    assert used >= N // 20  # the second step of most requests whose first rejected


@pytest.mark.slow
def test_broken_sampler_fails_the_same_test(tmp_path, llama_pair):
    env = planted_env(tmp_path, BROKEN_SITE)
    with local_stack(
        tmp_path / "stack", *llama_pair, env=env, orchestrator__wire_top_k=WIRE_TOP_K
    ) as broken:
        results = check(broken, llama_pair, SamplingParams(1.0))
    failed = [k for k, (d, t) in results.items() if d >= t]
    assert failed, f"the broken sampler passed: {results}"
