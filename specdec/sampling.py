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

**The proposal is what goes on the wire.** The draft does not sample from its
float distribution and then describe it approximately: it first turns it into
a ``SparseQ`` (the most likely tokens with integer counts out of 2^bits, plus
the rest of the mass spread evenly over every other token), then samples from
exactly that. Truncation and quantization therefore cost acceptance, never
exactness.

The same warping (temperature, then top-k, then top-p, the order of
transformers' ``generate``) is applied wherever p or q is formed. Randomness
comes in as numbers (uniforms, a ``specdec.rng.Philox`` stream), never from global state.
Not for: models, caches or the wire format (``specdec.wire``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from specdec import kernels
from specdec.errors import NonFiniteLogits
from specdec.rng import Philox


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. temperature 0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def full_support(self) -> bool:
        """True when warping keeps every token possible (no top-k / top-p)."""
        return self.top_k == 0 and self.top_p >= 1.0


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to logits; removed entries become -inf.

    logits: [..., vocab]. Requires temperature > 0. Ties at the top-k boundary
    are kept; top-p keeps the smallest high-probability set whose mass
    reaches top_p (always at least one token).
    """
    scores = logits / params.temperature if params.temperature != 1.0 else logits
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        scores = scores.masked_fill(scores < _kth_largest(scores, params.top_k), float("-inf"))
    if params.top_p < 1.0:
        scores = _nucleus(scores, params.top_p)
    return scores


def _numpy_reads(t: torch.Tensor) -> bool:
    """Whether numpy can read ``t`` in place (a CPU tensor of float32 or float64),
    where the CPU's paths below run row by row in numpy."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def _kth_largest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k-th largest score: [..., vocab] -> [..., 1]. On the CPU from
    ``_kth_score``'s partition of a sampled cut's candidates (one thread, at
    151,936 tokens, 0.5-0.8 ms a row with torch's top-k)."""
    if not _numpy_reads(scores):
        return torch.topk(scores, k, dim=-1).values[..., -1:]
    rows = scores.detach().reshape(-1, scores.shape[-1]).numpy()
    kth = [_kth_score(row, k)[2] for row in rows]
    return torch.tensor(kth, dtype=scores.dtype).reshape(*scores.shape[:-1], 1)


def _nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The scores with what top-p removes at -inf: [..., vocab] -> [..., vocab].

    transformers' ``TopPLogitsWarper``: sort the vocabulary ascending and remove
    the tokens whose cumulative probability is <= 1 - top_p. That is the same as,
    from the top: a token stays iff the mass of the tokens ranked above it is
    < top_p (so the most likely always stays). Off the CPU, the sort as
    transformers does it. On the CPU, row by row, only the likely part of the
    vocabulary is sorted (``_nucleus_ids``). One thread, 5 rows, top_p 0.9,
    random logits: the whole vocabulary's sort took 1.3 / 14 / 74 ms at 4,096 /
    32,000 / 151,936 tokens.
    """
    if not _numpy_reads(scores):
        return _nucleus_by_sort(scores, top_p)
    vocab = scores.shape[-1]
    z = scores.detach().reshape(-1, vocab)
    probs = z.softmax(dim=-1).numpy()  # [rows, vocab]
    z = z.numpy()
    out = np.full_like(z, -np.inf)
    for r, row in enumerate(probs):
        kept = _nucleus_ids(z[r], row, top_p)
        if kept is None:  # equal scores across the cut: whichever transformers keeps
            out[r] = _nucleus_by_sort(torch.from_numpy(z[r : r + 1]), top_p).numpy()[0]
        else:
            out[r, kept] = z[r, kept]
    return torch.from_numpy(out).reshape(scores.shape)


def _nucleus_by_sort(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``_nucleus`` as transformers computes it: the whole vocabulary sorted. Of
    tokens with equal scores, the one it keeps is the one ``torch.sort`` places
    last; this is the same call on the same values."""
    sorted_scores, order = torch.sort(scores, dim=-1)  # ascending
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1.0 - top_p)
    remove_sorted[..., -1] = False  # the most likely token always stays
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


def _nucleus_ids(z: np.ndarray, p: np.ndarray, top_p: float) -> np.ndarray | None:
    """The tokens top-p keeps, for one row of scores and their probabilities:
    [vocab] -> [kept]; None where tokens of equal score lie on both sides of the
    cut (which of them stays is up to the order ``torch.sort`` leaves ties in: the
    caller asks it, ``_nucleus_by_sort``; with bfloat16 logits such ties are common).

    The nucleus is usually a small part of the vocabulary: the 256 most likely
    tokens (``_most_likely``, in no order), four times as many while their mass
    falls short of top_p, every possible token (p > 0: after top-k, only those it
    kept) from a quarter of them on. Only those are sorted, by score as
    transformers sorts, with the mass above each summed in float64. (A token
    whose mass above sits within float rounding of top_p may fall on either
    side, as the two ways of summing round differently.)
    """
    vocab = len(p)
    possible = np.count_nonzero(p)
    c = 256
    while 4 * c <= possible:
        ids = _most_likely(p, c)
        if p[ids].sum(dtype=np.float64) >= top_p:
            break
        c *= 4
    else:  # all of them; after top-k, only the tokens it kept
        ids = np.flatnonzero(p) if 2 * possible < vocab else np.arange(vocab)
    ids = ids[np.argsort(-z[ids], kind="stable")]  # most likely first
    mass = p[ids].astype(np.float64)
    n = int(np.count_nonzero(np.cumsum(mass) - mass < top_p))  # mass above each < top_p
    last = z[ids[n - 1]]
    if n < len(ids):
        if z[ids[n]] == last:  # a tie across the cut
            return None
    elif len(ids) < vocab and np.count_nonzero(z == last) > np.count_nonzero(z[ids] == last):
        return None  # every candidate kept, and one left out ties with the last
    return ids[:n]


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The warped distribution; one-hot at the argmax when greedy.

    logits: [..., vocab] -> probs [..., vocab], in float32 or wider.
    """
    if params.greedy:
        probs = torch.zeros_like(logits, dtype=_prob_dtype(logits))
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return warp_logits(logits.to(_prob_dtype(logits)), params).softmax(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> Any:
    """The argmax of each row, the first one on ties, as torch's ``argmax`` gives it.
    logits: [..., vocab] -> a list [...] (an int for one row). On the CPU, numpy's:
    one thread, at 151,936 tokens, 16 us a row against 244 with torch's (156 against
    1,396 for 5 rows), at 4,096 3 against 9.

    A row holding NaN raises ``NonFiniteLogits`` (both argmaxes take a NaN as the
    largest, so one read per row tells); +inf is a maximum like any other, as
    ``generate()`` takes it.
    """
    if logits.device.type != "cpu":
        argmax = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
        if logits.gather(-1, argmax).isnan().any():
            raise NonFiniteLogits(_NON_FINITE)
        return argmax.squeeze(-1).tolist()
    x = logits.detach()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # (monotone: the same argmax)
    table = x.numpy()
    argmax = table.argmax(axis=-1)  # [...]
    # A scalar read per row: numpy's calls on arrays cost microseconds (one row: a
    # drafted position, gamma of them a step).
    if table.ndim == 1:
        nan = math.isnan(table[argmax])
    else:
        rows = table.reshape(-1, table.shape[-1])
        nan = any(math.isnan(rows[r, t]) for r, t in enumerate(argmax.reshape(-1).tolist()))
    if nan:
        raise NonFiniteLogits(_NON_FINITE)
    return argmax.tolist()


def greedy_top2(logits: torch.Tensor) -> tuple[int, int]:
    """The argmax of one row (as ``greedy_tokens`` gives it: the first one on ties) and
    the runner-up (a greedy draft's second choice, ``Proposal.alternates``).
    logits: [vocab], vocab >= 2. One top-k call where the two separately take two
    library calls more: right after a forward pass each costs tens of microseconds."""
    values, ids = logits.topk(2)
    (v1, v2), (i1, i2) = values.tolist(), ids.tolist()
    if math.isnan(v1):  # top-k takes NaN as the largest
        raise NonFiniteLogits(_NON_FINITE)
    if v1 == v2:  # a tie at the top (top-k picks any of them): the first two tied
        i1, i2 = (logits == v1).nonzero()[:2, 0].tolist()
    return i1, i2


def _require_finite(log_total: float) -> None:
    """Raise ``NonFiniteLogits`` unless a row's log-sum-exp is finite (NaN anywhere in
    the row, or +inf, makes it NaN)."""
    if not math.isfinite(log_total):
        raise NonFiniteLogits(_NON_FINITE)


_NON_FINITE = (
    "the model's logits are not finite (NaN, or +inf where probabilities are formed): "
    "an overflow? Serve it in float32 or bfloat16"
)


def _prob_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ---- the proposal: a sparse, quantized q, exact by construction --------------------------


@dataclass(frozen=True)
class SparseQ:
    """One drafted position's proposal distribution q, as the draft samples from it.

    q(ids[j]) = counts[j] / 2^bits; each of the other vocab - k tokens gets
    tail / (2^bits * (vocab - k)). counts sum with tail to 2^bits exactly.
    """

    ids: np.ndarray  # [k] int64, distinct, in [0, vocab)
    counts: np.ndarray  # [k] int64, each > 0
    tail: int  # >= 0; 0 when every listed token's mass is all there is
    vocab: int
    bits: int = 16

    @property
    def scale(self) -> int:
        return 1 << self.bits

    @property
    def tail_share(self) -> float:
        """q of each unlisted token: the tail spread evenly over them (float64)."""
        return self.tail / (self.scale * (self.vocab - len(self.ids))) if self.tail else 0.0

    @property
    def is_point(self) -> bool:
        """All mass on one listed token (what a greedy draft sends)."""
        return len(self.ids) == 1 and not self.tail

    @classmethod
    def point(cls, token: int, vocab: int) -> SparseQ:
        """All mass on one token (greedy drafting)."""
        return cls(np.array([token], dtype=np.int64), np.array([1 << 16]), 0, vocab)

    def prob(self, token: int) -> float:
        """q(token), exactly as the draft sampled it (float64)."""
        hit = np.flatnonzero(self.ids == token)
        if hit.size:
            return float(self.counts[hit[0]]) / self.scale
        return self.tail_share

    def dense(self, device=None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """q over the whole vocabulary: [vocab]."""
        q = torch.full((self.vocab,), self.tail_share, dtype=dtype, device=device)
        q[torch.from_numpy(self.ids).to(device)] = (
            torch.from_numpy(self.counts).to(device=device, dtype=dtype) / self.scale
        )
        return q

    def sample(self, rng: Philox) -> int:
        """One token drawn from exactly this distribution (integer arithmetic)."""
        r = int(rng.integers(0, self.scale))
        j = int(np.searchsorted(np.cumsum(self.counts), r, side="right"))
        if j < len(self.ids):
            return int(self.ids[j])
        return self.sample_tail(rng)

    def sample_tail(self, rng: Philox) -> int:
        """One token drawn uniformly from the unlisted ones (given that the draw fell
        in the tail)."""
        # The u-th unlisted token is u plus the number of listed ids whose rank among
        # the unlisted is <= u.
        listed = np.sort(self.ids)
        u = int(rng.integers(0, self.vocab - len(listed)))
        return u + int(np.searchsorted(listed - np.arange(len(listed)), u, side="right"))


class QEntries(NamedTuple):
    """q_1..q_gamma as flat arrays: every listed entry's position, id and probability
    (float64, exact: counts over a power of two), and each position's tail share."""

    row: np.ndarray  # [total]
    ids: np.ndarray  # [total]
    listed: np.ndarray  # [total]
    share: np.ndarray  # [gamma] q of each unlisted token


def q_entries(qs: list[SparseQ]) -> QEntries:
    sizes = [len(q.ids) for q in qs]
    return QEntries(
        row=np.repeat(np.arange(len(qs)), sizes),
        ids=np.concatenate([q.ids for q in qs]),
        listed=np.concatenate([q.counts / q.scale for q in qs]),
        share=np.array([q.tail_share for q in qs]),
    )


def drafted_probs(qs: list[SparseQ], tokens, entries: QEntries | None = None) -> list[float]:
    """q_i(x_i) for each drafted token, exactly as ``SparseQ.prob`` gives it. [gamma]
    ``entries``: ``qs`` flattened already (``q_entries``), to reuse."""
    if not qs:
        return []
    if entries is None and all(q.is_point for q in qs):
        # Points (greedy drafts), in plain Python: right after a forward pass each numpy
        # call costs tens of microseconds (the pass evicted the caches), and the
        # general path makes a dozen.
        return [
            float(q.counts[0]) / q.scale if int(q.ids[0]) == x else 0.0
            for q, x in zip(qs, tokens, strict=True)
        ]
    row, ids, listed, share = entries if entries is not None else q_entries(qs)
    hit = ids == np.asarray(tokens, dtype=np.int64)[row]  # [total] the drafted token's entry
    out = share.copy()
    out[row[hit]] = listed[hit]
    return out.tolist()


def sparse_q(
    logits: torch.Tensor, params: SamplingParams, max_entries: int, eps: float, bits: int = 16
) -> SparseQ:
    """The draft's proposal for one position. logits: [vocab].

    Lists the most likely tokens until they hold 1 - eps of the warped mass,
    at most ``max_entries`` of them (0: no cap), with integer counts out of
    2^bits (largest remainders, so rounding moves at most 2^-bits per entry).
    Without top-k / top-p the remaining mass is spread evenly over every other
    token (the draft keeps its whole support, which keeps acceptance when q is
    flat); with them, what is left out is left out.
    Greedy: all mass on the argmax.
    """
    vocab = logits.shape[-1]
    if params.greedy:
        return SparseQ.point(greedy_tokens(logits), vocab)
    if _drafts_compiled(logits, params, eps):
        return _draft_compiled(logits, params, max_entries, bits, None)[1]
    k = vocab if max_entries <= 0 else min(max_entries, vocab)
    if logits.device.type == "cpu":
        # One row on the CPU: numpy's calls cost a few microseconds where torch's cost
        # tens. The scores stay float32 (the sum of the exponentials is taken in float64);
        # only the k listed probabilities are formed in float64. Precision here moves
        # counts, never exactness: the draft samples from the counts it sends.
        scores = logits.detach().float()  # [vocab]
        if not params.full_support:  # what top-k / top-p remove is at -inf (count 0)
            z = warp_logits(scores, params).numpy()
        elif params.temperature != 1.0:
            z = scores.numpy() / np.float32(params.temperature)
        else:
            z = scores.numpy()
        if eps > 0:  # the cut by mass walks the list most likely first
            ids = np.arange(vocab) if k == vocab else _most_likely(z, k)
            ids = ids[np.argsort(-z[ids], kind="stable")]
        elif params.full_support:  # ascending, the wire's order (``pack_q`` sorts nothing)
            ids = np.arange(vocab) if k == vocab else _largest_ascending(z, k)
        else:  # the same among the tokens warping kept (ascending too): a partition
            # whose k-th falls in a long run of -inf ties takes milliseconds
            possible = np.flatnonzero(z != -np.inf)  # (NaN stays, to be refused below)
            if not len(possible):  # (every token removed: only a NaN row warps so)
                raise NonFiniteLogits(_NON_FINITE)
            if len(possible) > k:
                possible = possible[_largest_ascending(z[possible], k)]
            ids = possible
        listed = z[ids]  # [k]
        lead = 0 if eps > 0 else int(np.argmax(listed))
        top = float(listed[lead])
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, refused just below
            log_total = top + math.log(float(np.exp(z - top).sum(dtype=np.float64)))
        _require_finite(log_total)
        probs = np.exp(listed.astype(np.float64) - log_total)  # [k] warped mass of each
        return quantize(ids, probs, vocab, eps, bits, params.full_support, lead)
    scores = logits.float() / params.temperature
    if not params.full_support:
        scores = warp_logits(logits.float(), params)
    top, ids = torch.topk(scores, k)  # [k] each, most likely first
    lse = float(torch.logsumexp(scores, dim=-1))
    _require_finite(lse)
    probs = np.exp(top.double().cpu().numpy() - lse)  # [k] warped mass of each
    ids = ids.cpu().numpy()
    return quantize(ids.astype(np.int64), probs, vocab, eps, bits, keep_tail=params.full_support)


def _most_likely(z: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest of the scores z, the largest first, the rest in no
    order. z: [vocab], 0 < k < vocab -> [k].

    A partition of the whole vocabulary costs about 1.4 ms at 151,936 tokens, so
    only the candidates above a guessed cut are partitioned (``_candidates``),
    with the leader found in the same pass; a guess that fails falls back to the
    whole. Either way the set is the k largest (ties at its edge broken either
    way, as by any partition). One thread, random scores: 79-122 us at 151,936
    tokens (256 and 1,024 listed) against 355-892 with torch's top-k, 36-67 us at
    32,000 (about 370 for the whole).
    """
    ids = _candidates(z, k)
    if ids is not None:
        n = len(ids)
        return ids[np.argpartition(z[ids], (n - k, n - 1))[n - k :][::-1]]
    vocab = len(z)
    ids = np.argpartition(z, vocab - k)[vocab - k :]
    j = int(np.argmax(z[ids]))
    ids[[0, j]] = ids[[j, 0]]
    return ids


def _largest_ascending(z: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest of the scores z, in ascending order (the wire's):
    z: [vocab], 0 < k < vocab -> [k]. The k-th largest score is found among the
    candidates (``_candidates``) or the whole; the ids at or above it come out of
    a mask already sorted, where ``_most_likely``'s partition scrambles them and
    ``pack_q`` had to sort them back (45 us of a gamma-4 step's packing at 4,096
    tokens). Ties at the k-th score keep the lowest ids."""
    ids, scores, kth = _kth_score(z, k)
    keep = scores >= kth
    ids = np.flatnonzero(keep) if ids is None else ids[keep]
    if len(ids) > k:  # ties at the k-th score: drop the highest ids among them
        tied = np.flatnonzero(z[ids] == kth)
        ids = np.delete(ids, tied[len(tied) - (len(ids) - k) :])
    if len(ids) != k:  # NaN scores (never ordered): whatever the partition gives
        ids = np.sort(_most_likely(z, k))
    return ids


def _kth_score(z: np.ndarray, k: int) -> tuple[np.ndarray | None, np.ndarray, Any]:
    """The k-th largest of the scores z (0 < k < vocab), partitioned out of the
    candidates (``_candidates``) or the whole: (the candidates' ascending ids, None
    for the whole; their scores; the k-th largest)."""
    ids = _candidates(z, k)
    scores = z if ids is None else z[ids]
    n = len(scores)
    return ids, scores, np.partition(scores, n - k)[n - k]


# _candidates' sample: every stride-th score, the stride chosen for about this many.
_SAMPLE_SIZE = 4096


def _candidates(z: np.ndarray, k: int) -> np.ndarray | None:
    """Ascending ids of some n >= k scores that include the k largest, guessed from
    a sample; None where the whole vocabulary must be searched instead.

    A strided sample of z (about ``_SAMPLE_SIZE`` scores) guesses a score safely
    below the k-th largest: with k / stride of the sample expected above the k-th
    largest, the cut leaves 4 standard deviations and 8 more above it. A guess too
    high (fewer than k at or above it, which the margin makes rare) gives None;
    so does a cut that would pass more than half of the vocabulary."""
    vocab = len(z)
    stride = max(8, vocab // _SAMPLE_SIZE)
    expected = k / stride
    above_cut = math.ceil(expected + 4 * math.sqrt(expected) + 8)  # of the sample
    if 2 * above_cut * stride > vocab:
        return None
    sample = z[::stride]
    rank = len(sample) - above_cut
    cut = np.partition(sample, rank)[rank]
    ids = np.flatnonzero(z >= cut)  # [n]
    return ids if len(ids) >= k else None


def draft_position(
    logits: torch.Tensor,
    params: SamplingParams,
    max_entries: int,
    eps: float,
    bits: int,
    rng: Philox | None,
) -> tuple[int, SparseQ]:
    """One drafted position: q_i as the wire carries it (``sparse_q``) and x_i drawn
    from exactly that q_i. logits: [vocab]. Greedy q is a point, whose draw needs
    no randomness: ``rng`` may be None there."""
    if rng is not None and _drafts_compiled(logits, params, eps):
        return _draft_compiled(logits, params, max_entries, bits, rng)
    q = sparse_q(logits, params, max_entries, eps, bits)
    return (int(q.ids[0]) if params.greedy else q.sample(rng)), q


def _drafts_compiled(logits: torch.Tensor, params: SamplingParams, eps: float) -> bool:
    """Whether ``kernels.draft_q`` makes this q: sampled, on the CPU, with a full
    support and no cut by mass (the defaults)."""
    return (
        kernels.ENABLED
        and not params.greedy
        and params.full_support
        and eps == 0
        and logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    )


def _draft_compiled(
    logits: torch.Tensor, params: SamplingParams, max_entries: int, bits: int, rng: Philox | None
) -> tuple[int, SparseQ]:
    """``sparse_q``'s q from one compiled call (``kernels.draft_q``), and, given ``rng``,
    x drawn from it exactly as ``SparseQ.sample`` draws (-1 without). logits: [vocab]."""
    vocab = logits.shape[-1]
    k = vocab if max_entries <= 0 else min(max_entries, vocab)
    scale = 1 << bits
    r = -1 if rng is None else rng.integers(0, scale)  # (sample's first draw)
    ids = np.empty(k, dtype=np.int64)
    counts = np.empty(k, dtype=np.int64)
    z = logits.detach()
    z = (z if _numpy_reads(z) else z.float()).numpy()  # (half precision: as float32)
    n, tail, x = kernels.draft_q(z, 1.0 / params.temperature, k, scale, r, ids, counts)
    if n < 0:
        raise NonFiniteLogits(_NON_FINITE)
    q = SparseQ(ids[:n], counts[:n], int(tail), vocab, bits)
    if rng is not None and x < 0:  # in the tail: sample's second draw
        x = q.sample_tail(rng)
    return int(x), q


def quantize(
    ids: np.ndarray,
    probs: np.ndarray,
    vocab: int,
    eps: float,
    bits: int,
    keep_tail: bool,
    lead: int = 0,
) -> SparseQ:
    """Integer counts out of 2^bits for ``probs`` (sorted, the most likely first,
    when eps > 0; in any order otherwise, the most likely at index ``lead``).

    ids, probs: [k]. With eps > 0 the listed set is cut where the cumulative mass
    first reaches 1 - eps;
    ``keep_tail`` spreads the rest over the unlisted tokens. Rounding leftovers
    beyond one per entry go to the most likely token.
    """
    scale = 1 << bits
    k = len(probs)
    if eps > 0:  # (eps 0 would cut only rounding noise: nothing to save, and lead must stay)
        cum = np.cumsum(probs)
        k = min(int(np.searchsorted(cum, 1.0 - eps)) + 1, k)
        ids, probs, listed = ids[:k], probs[:k], float(cum[k - 1])
    else:
        listed = float(probs.sum())
    tail_mass = max(0.0, 1.0 - listed) if keep_tail and k < vocab else 0.0
    exact = probs * (scale / (listed + tail_mass))  # [k] target counts
    counts = exact.astype(np.int64)  # (their floors: exact >= 0)
    tail = int(tail_mass * scale / (listed + tail_mass))
    left = scale - tail - int(counts.sum())
    if left > 0:  # largest remainders first; a leftover beyond k goes to the top token
        if left < k:
            order = np.argpartition(counts - exact, left - 1)[:left]
        else:
            order = np.arange(k)
        counts[order] += 1
        counts[lead] += left - len(order)
    if not counts.all():  # (counts >= 0: only the zeros go)
        keep = counts > 0
        ids, counts = ids[keep], counts[keep]
    if tail and len(ids) == vocab:  # nothing left to spread it over (nothing was dropped)
        counts[lead] += tail
        tail = 0
    return SparseQ(ids.astype(np.int64, copy=False), counts, tail, vocab, bits)


# ---- the target's half of a step ----------------------------------------------------------


def residual_distribution(p: torch.Tensor, q: torch.Tensor | QEntries) -> torch.Tensor:
    """norm(max(0, p - q)) row by row. p: [..., vocab] -> [..., vocab]; q: the same
    shape, or the sparse q_1..q_gamma of p's rows as ``QEntries`` (never made dense:
    every token is first taken as unlisted, then the listed ones are set; the same
    float operations on the same values as with q dense, ``SparseQ.dense``).

    NOTE: a row with no residual mass (q >= p everywhere, so q == p) can never
    be rejected; it gets p so that sampling it stays well defined.
    On the CPU, up to ``_NUMPY_ROWS_UP_TO`` tokens, in numpy: its calls cost a few
    microseconds where torch's cost tens (a gamma-4 step's residuals at 4,096
    tokens, one thread: 82 us against 117); torch's kernels win on long rows (846
    against 724 at 151,936 tokens; even at 32,000).
    """
    dense_ok = not isinstance(q, torch.Tensor) or _numpy_reads(q)
    if _numpy_reads(p) and p.shape[-1] <= _NUMPY_ROWS_UP_TO and dense_ok:
        return torch.from_numpy(_residual_numpy(p.detach().numpy(), q))
    if isinstance(q, torch.Tensor):
        r = (p - q).clamp_min_(0)
    else:
        flat = torch.from_numpy(q.row * p.shape[-1] + q.ids).to(p.device)  # [total]
        share = torch.from_numpy(q.share).to(device=p.device, dtype=p.dtype)  # [gamma]
        listed = torch.from_numpy(q.listed).to(device=p.device, dtype=p.dtype)  # [total]
        r = (p - share[:, None]).clamp_min_(0)  # [gamma, vocab]
        r.view(-1).index_copy_(0, flat, (p.reshape(-1).take(flat) - listed).clamp_min(0))
    mass = r.sum(dim=-1, keepdim=True)  # [..., 1]
    r /= mass.clamp_min(torch.finfo(r.dtype).tiny)  # (in place: r is ours)
    empty = ~(mass[..., 0] > 0)  # [...]
    if empty.any():
        r[empty] = p[empty]
    return r


_NUMPY_ROWS_UP_TO = 16_384  # tokens a row; see residual_distribution


def _residual_numpy(p: np.ndarray, q: torch.Tensor | QEntries) -> np.ndarray:
    """``residual_distribution`` with the same float operations in numpy."""
    if isinstance(q, torch.Tensor):
        r = p - q.detach().numpy()
    else:
        r = p - q.share.astype(p.dtype)[:, None]  # [gamma, vocab], ours
        flat = q.row * p.shape[-1] + q.ids  # [total]
        r.reshape(-1)[flat] = p.reshape(-1)[flat] - q.listed.astype(p.dtype)
    np.maximum(r, 0, out=r)
    mass = r.sum(axis=-1, keepdims=True)  # [..., 1]
    r /= np.maximum(mass, np.finfo(r.dtype).tiny)
    empty = ~(mass[..., 0] > 0)  # [...]
    if empty.any():
        r[empty] = p[empty]
    return r


# ---- a guess of the residual draw (temperature > 0) -------------------------------------------
#
# Where x_i is rejected the target emits a draw from r = norm(max(0, p_i - q_i)). The
# draft may guess that token before the verdict and draft the next block from it
# (``draft_service.drafter``, guesses): its guess y is drawn from g = q_i conditioned
# on y != x_i. The target then draws its token coupled to y: it keeps y with
# probability min(1, r(y) / g(y)), else draws from norm(max(0, r - g)). That is
# section 1's step again, with r as the target and g as the draft, so the token is
# distributed exactly as r; it equals y with probability sum(min(r, g)) (36% of
# rejections on the demo pair at T=1, against 6% for a draw from g independent of the
# target's). docs/exactness.md, section 4f.

GUESS_TRIES = 32  # draws from q before a guess gives up (q nearly all on x)


def guess_from(q: SparseQ, x: int, rng: Philox) -> int:
    """y ~ g = q without x (q conditioned on y != x), or -1: no guess (q puts its
    mass on x, or ``GUESS_TRIES`` draws in a row were x). Given that it returns a
    token, the token is distributed as g; whether it does depends on ``rng`` alone."""
    if q.prob(x) >= 1.0:
        return -1
    for _ in range(GUESS_TRIES):
        y = q.sample(rng)
        if y != x:
            return y
    return -1


def guess_g(q: SparseQ, x: int) -> torch.Tensor:
    """g = q without x, renormalized: [vocab] float64 (``guess_from``'s distribution)."""
    g = q.dense()
    g[x] = 0.0
    return g / (1.0 - q.prob(x))


def guess_coupling(r: torch.Tensor, g: torch.Tensor, y: int) -> tuple[float, torch.Tensor]:
    """The residual draw coupled to a guess y ~ g. r, g: [vocab] float64, each summing
    to 1. Returns (keep, h): keep y with probability ``keep`` = min(1, r(y) / g(y)),
    otherwise draw from h = norm(max(0, r - g)) (r itself where that is empty: then
    r = g, and y is always kept)."""
    keep = min(1.0, float(r[y] / g[y]))
    h = (r - g).clamp_min_(0)
    mass = float(h.sum())
    return keep, (h / mass if mass > 0 else r.clone())


def _couple(
    rows: torch.Tensor,
    qs: list[SparseQ],
    drafts: list[int],
    guesses: Sequence[int],
    u_keep: torch.Tensor,
) -> dict[int, int]:
    """The guessed positions' residual draws, coupled to their guesses. rows:
    [gamma + 1, vocab] float64, the residual rows (then the bonus's); a guessed row
    that does not keep its guess becomes h (``guess_coupling``), drawn from as usual.
    Returns {position: y} for the guesses kept."""
    kept = {}
    for i, y in enumerate(guesses):
        if y < 0:
            continue
        g = guess_g(qs[i], drafts[i]).to(rows.device)
        keep, h = guess_coupling(rows[i], g, y)
        if float(u_keep[i]) < keep:
            kept[i] = y
        else:
            rows[i] = h
    return kept


def inverse_cdf(rows: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row drawn with the given uniforms.

    rows: [n, vocab] non-negative (need not be normalized); u: [n] in [0, 1).
    Returns [n] int64: the first index whose cumulative mass exceeds u * total.
    """
    cdf = rows.double().cumsum(dim=-1)  # [n, vocab]
    total = cdf[:, -1]  # [n]
    if not all(math.isfinite(t) and t > 0 for t in total.tolist()):  # NaN in p reaches r
        raise NonFiniteLogits(_NON_FINITE)
    target = u.to(cdf) * total  # [n]
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    return idx.clamp_max(rows.shape[-1] - 1)


@dataclass
class Proposal:
    """The draft's half of a step: x_1..x_gamma and the q each was drawn from."""

    tokens: list[int]  # [gamma]
    qs: list[SparseQ] | None  # [gamma]; None while only the wire form is at hand
    cache_len: int = 0  # the draft's cache length after drafting
    packed: Any = None  # the wire form, kept so that forwarding it costs no re-encoding
    compute_s: float = 0.0  # seconds the draft service spent on it
    forward_s: float = 0.0  # of which in the gamma forward passes
    batch_tokens: float = 0.0  # mean tokens those passes carried, all sessions together
    # The draft sent it straight to the target (relay): the verdict comes on the
    # target session without a verify from here, and q is not at hand.
    relayed: bool = False
    relay_bytes: int = 0  # what that relay put on the wire
    # Of compute_s, the seconds before the propose arrived (drafted on from an echo).
    lead_s: float = 0.0
    # Draft only: a guess of the target's token where x_i is rejected, at each of the
    # first positions (``draft_service.drafter``, guesses). Greedy: the draft's second
    # choice, never sent. Sampled: a draw from q_i without x_i (``guess_from``; -1:
    # none), sent with the verify, whose residual draw is coupled to it.
    alternates: list[int] | None = None


@dataclass
class Verdict:
    """The target's half of a step (everything the acceptance test needs)."""

    p_draft: list[float]  # [gamma] p_i(x_i)
    q_draft: list[float]  # [gamma] q_i(x_i), from the proposal as sent
    residual_tokens: list[int]  # [gamma] a draw from norm(max(0, p_i - q_i))
    bonus_token: int  # a draw from p_{gamma+1}
    p: torch.Tensor | None = None  # [gamma + 1, vocab] when asked for (dense diagnostics)
    cache_len: int = 0  # the target's cache length after the pass
    compute_s: float = 0.0  # seconds the target service spent on it
    forward_s: float = 0.0  # of which in the forward pass
    batch_tokens: int = 0  # tokens that pass carried, all sessions together
    wide: bool = False  # that pass ran on more threads than the others (Verify.draft_idle)
    # For the exactness monitor (when asked): x_1..x_gamma, the residual draws, the
    # bonus (2 gamma + 1 entries): p's mass on tokens ranked above each (most probable
    # first, ties by id), and on it.
    mass_above: list[float] | None = None
    p_at: list[float] | None = None
    # A plain run (no drafts): the tokens drawn after the bonus, each from p after the
    # one before it (their PIT terms, when asked, follow the bonus's).
    run_tokens: list[int] = field(default_factory=list)
    # A relayed verify was lost with its target replica, so this is a plain step's
    # verdict instead: the drafts were never judged (``orchestrator.resilience``).
    drafts_dropped: bool = False
    # A pipelined verify's (``Verify.pipeline``): the drafts it judged, and its seed.
    drafts: list[int] | None = None
    seed: int = 0
    # A pipelined block's: the draft's forward seconds for it (Verify.draft_forward_s).
    draft_forward_s: float = 0.0


def verify_draft(
    logits: torch.Tensor,
    draft_tokens: list[int],
    qs: list[SparseQ],
    params: SamplingParams,
    u: torch.Tensor | None,
    keep_p: bool = False,
    pit: bool = False,
    guesses: Sequence[int] = (),
    u_keep: torch.Tensor | None = None,
) -> Verdict:
    """The target's half of a step.

    logits: [gamma + 1, vocab], target logits at the positions that predict
        x_1..x_gamma and the bonus token.
    draft_tokens: x_1..x_gamma; qs: the proposals they were drawn from.
    u: [gamma + 1] uniforms for the residual draws and the bonus draw (None for
        greedy: nothing is drawn).
    ``pit``: also report what a probability integral transform of each
    candidate token needs (``pit_terms``); never for greedy (p is one-hot there).
    ``guesses``: the draft's guess y_i (``guess_from``; -1: none) of the residual draw
    at the first positions, and ``u_keep``: a uniform each; the residual draw there
    is coupled to it (``guess_coupling``). Not for greedy (nothing is drawn there).
    """
    gamma = len(draft_tokens)
    if len(qs) != gamma:
        raise ValueError(f"{gamma} drafted tokens but {len(qs)} distributions")
    if (
        kernels.ENABLED
        and not params.greedy
        and logits.device.type == "cpu"
        and not keep_p
        and not pit
        and not any(y >= 0 for y in guesses)
        and all(q.bits == qs[0].bits for q in qs)
    ):
        # The draws in one compiled loop (``specdec.kernels.judge``): about forty numpy
        # and torch calls fewer, each tens of microseconds right after a forward. (p is
        # float32 or float64 here, ``_prob_dtype``.)
        return _judge_compiled(probs_from_logits(logits, params), draft_tokens, qs, u)
    if not gamma and not keep_p and not pit and not params.greedy:
        # A plain token (every token of a plain run): the bonus draw from p, nothing
        # else (the path below takes 61 us for it at 4,096 tokens on a CPU, this 34).
        p = probs_from_logits(logits, params)  # [1, vocab]
        return Verdict([], [], [], int(inverse_cdf(p, u[:1])[0]))
    if params.greedy:
        # p one-hot at a: p_i(x_i) = [x_i == a_i], residual = a_i (see residual_distribution).
        argmax = greedy_tokens(logits)  # [gamma + 1]
        return Verdict(
            p_draft=[float(a == x) for a, x in zip(argmax, draft_tokens, strict=False)],
            q_draft=drafted_probs(qs, draft_tokens),  # [gamma]
            residual_tokens=argmax[:gamma],
            bonus_token=argmax[gamma],
            p=probs_from_logits(logits, params) if keep_p else None,
        )
    entries = q_entries(qs) if gamma else None
    q_draft = drafted_probs(qs, draft_tokens, entries)  # [gamma]
    p = probs_from_logits(logits, params)  # [gamma + 1, vocab]
    drafts = torch.tensor(draft_tokens, dtype=torch.long, device=p.device)
    p_draft = p[:gamma].gather(-1, drafts[:, None]).squeeze(-1)  # [gamma]
    # [gamma + 1, vocab] the residuals, then p for the bonus, in inverse_cdf's float64
    rows = p.new_empty(p.shape, dtype=torch.float64)
    rows[gamma:] = p[gamma:]
    if gamma:
        rows[:gamma] = residual_distribution(p[:gamma], entries)
    kept = _couple(rows, qs, draft_tokens, guesses, u_keep) if any(y >= 0 for y in guesses) else {}
    drawn = inverse_cdf(rows, u).tolist()  # [gamma + 1]
    for i, y in kept.items():
        drawn[i] = y
    verdict = Verdict(
        p_draft=p_draft.tolist(),
        q_draft=q_draft,
        residual_tokens=drawn[:gamma],
        bonus_token=drawn[gamma],
        p=p if keep_p else None,
    )
    if pit:
        candidates = list(draft_tokens) + drawn[:gamma] + [drawn[gamma]]
        rows_of = list(range(gamma)) * 2 + [gamma]  # the position each candidate is for
        verdict.mass_above, verdict.p_at = pit_terms(p, rows_of, candidates)
    return verdict


_NO_ENTRIES = np.zeros(0, dtype=np.int64)


def _judge_compiled(
    p: torch.Tensor, draft_tokens: list[int], qs: list[SparseQ], u: torch.Tensor
) -> Verdict:
    """``verify_draft``'s sampled verdict from ``kernels.judge``. p: [gamma + 1, vocab]
    on the CPU, float32 or float64; every q quantized to the same bits."""
    gamma = len(draft_tokens)
    meta = np.array(
        [*draft_tokens, *(len(q.ids) for q in qs), *(q.tail for q in qs)], dtype=np.int64
    )  # [3 gamma]
    ids = np.concatenate([q.ids for q in qs]) if qs else _NO_ENTRIES  # [total]
    counts = np.concatenate([q.counts for q in qs]) if qs else _NO_ENTRIES
    out = np.empty(3 * gamma + 1)
    scale = qs[0].scale if qs else 1
    bad = kernels.judge(p.detach().numpy(), meta, ids, counts, scale, u.numpy(), out)
    if bad != kernels.OK:
        raise NonFiniteLogits(_NON_FINITE)
    values = out.tolist()
    drawn = [int(t) for t in values[2 * gamma :]]  # [gamma + 1]
    return Verdict(
        p_draft=values[:gamma],
        q_draft=values[gamma : 2 * gamma],
        residual_tokens=drawn[:gamma],
        bonus_token=drawn[gamma],
    )


def pit_terms(
    p: torch.Tensor, rows: list[int], tokens: list[int]
) -> tuple[list[float], list[float]]:
    """For each (row, token): p[row]'s mass on tokens ranked above it, and on it.

    p: [positions, vocab]. Tokens are ranked by p[row], most probable first
    (ties by id). With v ~ U[0, 1), above + v * at is uniform on [0, 1) exactly
    when the token was drawn from p[row] (randomized PIT), for any fixed ranking;
    ranking by p makes a too sharp or too flat output (a wrong residual, a
    misreported q, a temperature skew) show as a drift towards 0 or 1 instead
    of cancelling out over an arbitrary vocabulary order.
    On the CPU, one candidate at a time, reading its row in place: at 151,936
    tokens the whole candidates-by-vocabulary mask in float64 took 18.7 ms for a
    gamma-4 step's 9 candidates (one thread).
    """
    if not tokens:
        return [], []
    if _numpy_reads(p):
        table = p.detach().numpy()  # [positions, vocab]
        above, at = [], []
        for r, t in zip(rows, tokens, strict=True):
            row = table[r]
            mass = row[t]
            higher = np.where(row > mass, row, 0).sum(dtype=np.float64)
            tied = np.count_nonzero(row[:t] == mass)  # ranked above it by id
            above.append(float(higher + tied * np.float64(mass)))
            at.append(float(mass))
        return above, at
    r = torch.tensor(rows, device=p.device)
    t = torch.tensor(tokens, device=p.device)
    rows_p = p[r].double()  # [n, vocab]
    at = rows_p.gather(1, t[:, None])  # [n, 1]
    ids = torch.arange(rows_p.shape[-1], device=p.device)
    ahead = (rows_p > at) | ((rows_p == at) & (ids[None, :] < t[:, None]))  # [n, vocab]
    above = (rows_p * ahead).sum(dim=-1)
    return above.tolist(), at[:, 0].tolist()


# ---- the orchestrator's half --------------------------------------------------------------


def accepted_count(p_draft, q_draft, u) -> int:
    """n: how many drafts are accepted, in order, until the first rejection.

    p_draft, q_draft, u: [gamma] sequences; u ~ U[0, 1). x_i is accepted iff
    u_i < p_i(x_i) / q_i(x_i), i.e. with probability min(1, p/q).
    NOTE: q_i(x_i) > 0 because x_i was drawn from q_i; p_i(x_i) = 0 always rejects.
    """
    for i, (p, q, ui) in enumerate(zip(p_draft, q_draft, u, strict=True)):
        if not ui * q < p:
            return i
    return len(p_draft)


def step_tokens(
    draft_tokens: list[int], n: int, residual_tokens: list[int], bonus_token: int
) -> list[int]:
    """Tokens emitted by a step: x_1..x_n, then the residual draw or the bonus."""
    gamma = len(draft_tokens)
    tail = bonus_token if n == gamma else residual_tokens[n]
    return list(draft_tokens[:n]) + [tail]


# ---- the cost model -----------------------------------------------------------------------


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """(1 - alpha^(gamma+1)) / (1 - alpha): expected tokens a step emits."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float, v: float = 1.0) -> float:
    """Walltime improvement over plain decoding: tokens per step over the step's cost
    in decode steps, gamma c + v, where c = draft step / target step and v = the
    verify pass over gamma + 1 tokens / one target decode step (the paper: v = 1)."""
    return expected_tokens_per_step(alpha, gamma) / (gamma * c + v)


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) = 1 - total variation. p, q: [..., vocab] -> [...]."""
    return torch.minimum(p, q).sum(dim=-1)
