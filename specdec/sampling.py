"""The math of speculative sampling (Leviathan et al. 2023), free of I/O.

Names follow the paper: p is the target model's distribution, q the draft
model's, gamma the number of drafted tokens x_1..x_gamma, n the number the
target accepts. One step:

* accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the
  first rejection;
* on the first rejection at i, emit a token drawn from the residual
  norm(max(0, p_i - q_i)) and stop;
* if all gamma are accepted, emit a bonus token drawn from p_{gamma+1}.

The emitted tokens are distributed exactly as the target alone would produce
them, for any q. Greedy decoding (temperature 0) is the special case where p
and q are one-hot at their argmax: a draft is accepted iff it equals the
target's argmax, and the residual is the target's argmax.

The same warping (temperature, then top-k, then top-p, the order of
transformers' ``generate``) is applied wherever p or q is formed.
Not for: models, caches or the wire; see ``specdec.model`` and the services.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. temperature 0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to logits; removed entries become -inf.

    logits: [..., vocab]. Requires temperature > 0. Ties at the top-k boundary
    are kept; top-p keeps the smallest high-probability set whose mass
    reaches top_p (always at least one token).
    """
    scores = logits / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1)  # ascending
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - params.top_p)
        remove_sorted[..., -1] = False  # the most likely token always stays
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The warped distribution; one-hot at the argmax when greedy.

    logits: [..., vocab] -> probs [..., vocab], in float32 or wider.
    """
    if params.greedy:
        probs = torch.zeros_like(logits, dtype=_prob_dtype(logits))
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return warp_logits(logits.to(_prob_dtype(logits)), params).softmax(dim=-1)


def _prob_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row. probs: [..., vocab] (need not be normalized) -> [...] int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator)
    return out.reshape(probs.shape[:-1])


def truncate_top(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely entries of one distribution, renormalized.

    probs: [vocab] -> (token_ids [k'], probs [k']) with k' = min(k, support).
    Sampling from the result and reporting it as q keeps speculation exact:
    the proposal distribution is whatever the draft really sampled from.
    """
    k = min(k, probs.shape[-1])
    vals, ids = torch.topk(probs, k)
    keep = vals > 0
    vals, ids = vals[keep], ids[keep]
    return ids, vals / vals.sum()


def draft_distribution(
    logits: torch.Tensor, params: SamplingParams, wire_top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's proposal q for one position, as (token_ids [k], probs [k]).

    logits: [vocab]. Greedy: one-hot at the argmax, no softmax. With top_p = 1
    only the top entries are exponentiated (top-k of logits, then a softmax
    over them equals truncating the warped distribution). wire_top_k 0 keeps
    the whole vocabulary (dense diagnostics).
    """
    vocab = logits.shape[-1]
    if params.greedy:
        return logits.argmax(dim=-1, keepdim=True), torch.ones(1, device=logits.device)
    k = wire_top_k if wire_top_k > 0 else vocab
    if params.top_k > 0:
        k = min(k, params.top_k)
    if params.top_p >= 1.0 and k < vocab:
        scores = logits.float() / params.temperature
        vals, ids = torch.topk(scores, k)  # [k] each, descending
        # Ties at the top_k boundary beyond k are dropped here; q may differ
        # from the warped p, which costs acceptance, never exactness.
        return ids, vals.softmax(dim=-1)
    return truncate_top(probs_from_logits(logits, params), k)


def sparse_to_dense(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids: [k], probs: [k] -> [vocab]."""
    dense = torch.zeros(vocab, dtype=probs.dtype, device=probs.device)
    return dense.index_put_((ids,), probs, accumulate=True)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) row by row. p, q: [..., vocab] -> [..., vocab].

    NOTE: a row with no residual mass (q >= p everywhere, so q == p) can never
    be rejected; it gets p so that sampling it stays well defined.
    """
    r = (p - q).clamp_min(0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


@dataclass
class VerifyResult:
    """What the target returns for one step (everything the orchestrator needs)."""

    p_draft: torch.Tensor  # [gamma] p_i(x_i)
    residual_tokens: torch.Tensor  # [gamma] a draw from norm(max(0, p_i - q_i))
    bonus_token: int  # a draw from p_{gamma+1}
    p: torch.Tensor | None = None  # [gamma + 1, vocab] when asked for (dense diagnostics)


def verify_draft(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    keep_p: bool = False,
) -> VerifyResult:
    """The target's half of a step.

    logits: [gamma + 1, vocab], target logits at the positions that predict
        x_1..x_gamma and the bonus token.
    draft_tokens: [gamma] int64, x_1..x_gamma.
    q: [gamma, vocab] dense proposal distributions (rows sum to 1).
    """
    gamma = draft_tokens.shape[0]
    if params.greedy:
        # p one-hot at a: p_i(x_i) = [x_i == a_i], residual = a_i (see residual_distribution).
        argmax = logits.argmax(dim=-1)  # [gamma + 1]
        p = probs_from_logits(logits, params) if keep_p else None
        return VerifyResult(
            p_draft=(argmax[:gamma] == draft_tokens).float(),
            residual_tokens=argmax[:gamma],
            bonus_token=int(argmax[gamma]),
            p=p,
        )
    p = probs_from_logits(logits, params)  # [gamma + 1, vocab]
    p_draft = p[:gamma].gather(-1, draft_tokens[:, None]).squeeze(-1)  # [gamma]
    rows = torch.cat([residual_distribution(p[:gamma], q.to(p.dtype)), p[gamma:]])
    drawn = sample(rows, generator)  # [gamma + 1]
    return VerifyResult(
        p_draft=p_draft,
        residual_tokens=drawn[:gamma],
        bonus_token=int(drawn[gamma]),
        p=p if keep_p else None,
    )


def accepted_count(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> int:
    """n: how many drafts are accepted, in order, until the first rejection.

    p_draft, q_draft, u: [gamma]; u ~ U[0, 1). x_i is accepted iff
    u_i < p_i(x_i) / q_i(x_i), i.e. with probability min(1, p/q).
    NOTE: q_i(x_i) > 0 because x_i was drawn from q_i; p_i(x_i) = 0 always rejects.
    """
    accept = u * q_draft < p_draft  # [gamma]
    rejected = (~accept).nonzero()
    return int(rejected[0]) if rejected.numel() else int(accept.shape[0])


def step_tokens(
    draft_tokens: list[int], n: int, residual_tokens: list[int], bonus_token: int
) -> list[int]:
    """Tokens emitted by a step: x_1..x_n, then the residual draw or the bonus."""
    gamma = len(draft_tokens)
    tail = bonus_token if n == gamma else residual_tokens[n]
    return list(draft_tokens[:n]) + [tail]


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """(1 - alpha^(gamma+1)) / (1 - alpha): expected tokens a step emits."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    """Walltime improvement over plain decoding with cost ratio c (draft/target step)."""
    return expected_tokens_per_step(alpha, gamma) / (gamma * c + 1.0)


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) = 1 - total variation. p, q: [..., vocab] -> [...]."""
    return torch.minimum(p, q).sum(dim=-1)
