"""Compiled loops (numba) for the sampled hot path on the CPU.

Right after a forward pass every numpy or torch call costs 20-120 us: the pass
streams the model's weights through the caches and evicts the code and data the
work around it needs (docs/benchmarks.md, "After a forward pass every library
call is cold"). A sampled step's judging is some forty such calls in numpy and
torch; here it is one compiled loop over the rows. numba, a maintained JIT
compiler for numeric Python, does what a C extension would without a compiler on
the user's machine; its machine code is cached on disk next to this file (or in
NUMBA_CACHE_DIR). On the draft, ``draft_q`` makes each drafted position's q and
draws from it, and ``encode_q`` puts them on the wire; on the target ``decode_q``
decodes and checks them, and ``judge`` does the step's judging. On both sides of
the hidden-state wire, ``hidden_steps`` and ``hidden_counts`` derive q from the
code products (``specdec.hidden_q``), bit for bit as its numpy reference does.

Each kernel has a reference in numpy and torch (``specdec.sampling``,
``specdec.wire``) that ``tests/test_kernels.py`` compares it with: the codec's
bytes and checks are the reference's; the judge draws the same tokens for the
same uniforms except where a cumulative sum falls within rounding of a uniform's
target (it works in float64 where the reference rounds some steps to p's dtype);
the draft's q lists the same tokens with counts within one of the reference's
(cumulative rounding instead of largest remainders: no sort), and x is drawn
from exactly those counts. The references stay the path for CUDA tensors and
for what the kernels leave out (top-k / top-p and ``wire_eps`` on the draft;
dense p, PIT terms and guesses on the target), and are the whole path with
``SPECDEC_KERNELS=0``. Not for: deciding what to compute (``specdec.sampling``).
"""

from __future__ import annotations

import os

import numpy as np
from numba import njit

# Off with SPECDEC_KERNELS=0: every step takes the reference path (tests that plant a
# bug in the reference turn the kernels off the same way, ``ENABLED = False``).
ENABLED = os.environ.get("SPECDEC_KERNELS", "1") != "0"

# judge's status: every row had finite, positive mass.
OK = -1


@njit(cache=True, nogil=True)
def _draw(w: np.ndarray, total: float, u: float) -> int:
    """The first index whose cumulative mass exceeds u * total (the last if none:
    rounding). w: [vocab] >= 0, summed in float64 in order (as ``total`` was)."""
    target = u * total
    c = 0.0
    for j in range(w.shape[0]):
        c += w[j]
        if c > target:
            return j
    return w.shape[0] - 1


@njit(cache=True, nogil=True)
def judge(
    p: np.ndarray,
    meta: np.ndarray,
    ids: np.ndarray,
    counts: np.ndarray,
    scale: int,
    u: np.ndarray,
    out: np.ndarray,
) -> int:
    """The target's half of a sampled step, ``sampling.verify_draft``'s draws.

    p: [gamma + 1, vocab], p_1..p_gamma and p for the bonus (float32 or float64).
    meta: [3 gamma] int64: x_1..x_gamma, then each q_i's number of listed tokens,
    then each q_i's tail count. ids, counts: [total] the listed tokens of q_1, then
    q_2, ... and their counts out of ``scale``. u: [gamma + 1] uniforms.
    Writes out: [3 gamma + 1] float64, p_i(x_i) for each i, q_i(x_i) for each i,
    then the residual draws from norm(max(0, p_i - q_i)) (p_i where that has no
    mass) and the bonus draw from p_{gamma+1}.
    Returns ``OK``, or the first row whose mass is not finite and positive (NaN
    in the logits), where nothing is to be drawn.
    """
    gamma = meta.shape[0] // 3
    vocab = p.shape[1]
    r = np.empty(vocab)  # the row drawn from, float64
    start = 0  # q_i's first entry in ids and counts
    for i in range(gamma):
        row = p[i]
        x, size, tail = meta[i], meta[gamma + i], meta[2 * gamma + i]
        share = tail / (scale * (vocab - size)) if tail else 0.0  # q of each unlisted token
        mass_p = 0.0
        for j in range(vocab):
            mass_p += row[j]
            d = row[j] - share
            r[j] = d if d > 0.0 else 0.0
        if not (np.isfinite(mass_p) and mass_p > 0.0):
            return i
        q_x = share
        for k in range(start, start + size):
            t = ids[k]
            q = counts[k] / scale
            d = row[t] - q
            r[t] = d if d > 0.0 else 0.0
            if t == x:
                q_x = q
        start += size
        mass = 0.0
        for j in range(vocab):
            mass += r[j]
        out[i] = row[x]
        out[gamma + i] = q_x
        if mass > 0.0:
            out[2 * gamma + i] = _draw(r, mass, u[i])
        else:  # q >= p everywhere, so q == p: never rejected; draw from p
            out[2 * gamma + i] = _draw(row, mass_p, u[i])
    row = p[gamma]  # the bonus: p itself
    mass_p = 0.0
    for j in range(vocab):
        mass_p += row[j]
    if not (np.isfinite(mass_p) and mass_p > 0.0):
        return gamma
    out[3 * gamma] = _draw(row, mass_p, u[gamma])
    return OK


# _kth_largest's bins: 1/32 nat wide below the top score, 64 nats in all, then one for
# everything lower.
_BINS_PER_NAT = 32
_BINS = 64 * _BINS_PER_NAT + 1


@njit(cache=True, nogil=True)
def _kth_largest(s: np.ndarray, top: float, k: int) -> float:
    """The k-th largest of the scores s (1 < k < len(s); no NaN), top their largest.

    A partition of fresh scores mispredicts its branches (50 us at 4,096 scores,
    against 7 on the same scores again): the scores are counted into bins by their
    distance below the top instead, and only the bin holding the k-th is
    partitioned. Where that is the last bin (the k-th more than 64 nats below the
    top), the whole is."""
    hist = np.zeros(_BINS, dtype=np.int64)
    for j in range(s.shape[0]):
        hist[_bin(top, s[j])] += 1
    above = 0  # scores in bins nearer the top
    b = 0
    while above + hist[b] < k:
        above += hist[b]
        b += 1
    if b == _BINS - 1:
        return np.partition(s, s.shape[0] - k)[s.shape[0] - k]
    members = np.empty(hist[b])
    m = 0
    for j in range(s.shape[0]):
        if _bin(top, s[j]) == b:
            members[m] = s[j]
            m += 1
    return np.sort(members)[m - (k - above)]


@njit(cache=True, nogil=True)
def _bin(top: float, score: float) -> int:
    """_kth_largest's bin of a score: its distance below the top in 1/32 nats, the
    last bin for everything 64 nats or more below (and -inf)."""
    d = (top - score) * _BINS_PER_NAT
    return np.int64(d) if d < _BINS - 1 else _BINS - 1


@njit(cache=True, nogil=True)
def draft_q(
    z: np.ndarray, inv_t: float, k: int, scale: int, r: int, ids: np.ndarray, counts: np.ndarray
) -> tuple[int, int, int]:
    """A drafted position's q, ``sampling.sparse_q``'s for a full support (no top-k /
    top-p) and eps 0, and a draw from it.

    z: [vocab] logits (float32 or float64); inv_t: 1 / temperature; k: the most
    tokens listed (0 < k <= vocab); scale: 2^bits. The k most likely tokens are
    listed in ascending order (ties at the k-th score: the lowest ids), with their
    mass in integer counts and the rest of the mass as the tail, spread evenly over
    the unlisted tokens (each the floor or the ceiling of its exact share, by
    cumulative rounding). r: a uniform integer in [0, scale) for the draw, or -1: none.
    Fills ids, counts: [k] (the first n used). Returns (n, tail, the drawn token:
    -1 where it falls in the tail, or where r is -1), or (-1, 0, -1) where the
    logits' mass is not finite (NaN, or an infinite logit).
    """
    vocab = z.shape[0]
    s = np.empty(vocab)  # the scores, float64
    top = -np.inf
    for j in range(vocab):
        s[j] = z[j] * inv_t
        if s[j] > top:
            top = s[j]
    mass = 0.0  # of exp(s - top)
    for j in range(vocab):
        mass += np.exp(s[j] - top)
    log_total = top + np.log(mass)
    if not np.isfinite(log_total):
        return -1, 0, -1
    # The k-th largest score: every score above it is listed, and of those equal to it
    # the lowest ids, k in all.
    if k >= vocab:
        kth = -np.inf
    elif k == 1:
        kth = top
    else:
        kth = _kth_largest(s, top, k)
    ties = k
    for j in range(vocab):
        if s[j] > kth:
            ties -= 1
    n = 0
    for j in range(vocab):
        if s[j] > kth or (s[j] == kth and ties > 0):
            if not s[j] > kth:
                ties -= 1
            ids[n] = j
            n += 1
    probs = np.empty(n)
    listed = 0.0
    for i in range(n):
        probs[i] = np.exp(s[ids[i]] - log_total)
        listed += probs[i]
    tail_mass = max(0.0, 1.0 - listed) if n < vocab else 0.0
    per = scale / (listed + tail_mass)
    # Cumulative rounding, the tail last: entry i gets floor(C_i) - floor(C_i-1), C_i the
    # running sum of the exact counts, and the tail what is left of 2^bits, so each gets
    # the floor or the ceiling of its exact share. Without a tail the last entry takes
    # what is left (C_n is 2^bits up to float rounding). (Largest remainders, the
    # reference's rule, need a sort of fresh remainders: some 50 us of mispredicted
    # branches at 1,024 entries.)
    running = 0.0
    given = 0
    for i in range(n):
        running += probs[i] * per
        floor = np.int64(running)  # (running >= 0)
        if i == n - 1 and tail_mass == 0.0:
            floor = scale
        counts[i] = floor - given
        given = floor
    tail = scale - given
    kept = 0  # drop what rounded to zero, keeping the order
    for i in range(n):
        if counts[i] > 0:
            ids[kept] = ids[i]
            counts[kept] = counts[i]
            kept += 1
    n = kept
    token = -1
    if r >= 0:
        c = 0
        for i in range(n):
            c += counts[i]
            if c > r:
                token = ids[i]
                break
    return n, tail, token


# PackedQ's one-byte values: 255 says "the next value of the escapes field" (common.proto).
_ESCAPE = 255


@njit(cache=True, nogil=True)
def decode_q(
    id_bytes: np.ndarray,
    id_escapes: np.ndarray,
    count_bytes: np.ndarray,
    count_escapes: np.ndarray,
    meta: np.ndarray,
    vocab: int,
    scale: int,
    ids: np.ndarray,
    counts: np.ndarray,
) -> bool:
    """A PackedQ's lists decoded and checked, ``wire.unpack_q``'s lists in one pass.

    id_bytes, count_bytes: the message's bytes (uint8); id_escapes, count_escapes:
    its escapes (int64). meta: [3 gamma] int64, each position's size, then its tail,
    then its drafted token. Fills ids and counts: [total], total = the sum of the
    sizes. True iff every check of ``wire._unpack_lists`` passes; where one fails
    the caller decodes with that function, which names the field.
    """
    gamma = meta.shape[0] // 3
    total = ids.shape[0]
    if id_bytes.shape[0] != total or count_bytes.shape[0] != total:
        return False
    e_id = 0  # the next unread escape of each field
    e_count = 0
    k = 0  # the next entry
    for i in range(gamma):
        size, tail, x = meta[i], meta[gamma + i], meta[2 * gamma + i]
        if size <= 0 or (tail > 0 and size >= vocab):
            return False
        token = 0  # each position's ids are deltas from 0 again
        mass = tail
        drawable = tail > 0  # x_i unlisted falls in the tail
        for j in range(size):
            d, e_id = _take(id_bytes, id_escapes, k, e_id)
            if d < 0 or (j > 0 and d == 0):  # an escape missing; ids ascend: a repeat
                return False
            token += d
            if token >= vocab:
                return False
            c, e_count = _take(count_bytes, count_escapes, k, e_count)
            if c <= 0:  # an escape missing; counts are positive
                return False
            mass += c
            drawable = drawable or token == x
            ids[k] = token
            counts[k] = c
            k += 1
        if mass != scale or not drawable:
            return False
    return e_id == id_escapes.shape[0] and e_count == count_escapes.shape[0]


@njit(cache=True, nogil=True)
def encode_q(
    ids: np.ndarray,
    counts: np.ndarray,
    sizes: np.ndarray,
    id_bytes: np.ndarray,
    id_escapes: np.ndarray,
    count_bytes: np.ndarray,
    count_escapes: np.ndarray,
) -> tuple[int, int]:
    """``wire.pack_q``'s lists in one pass: ids delta-coded from 0 again at each
    position, one byte per value with 255 escaping to the escapes.

    ids, counts: [total] q_1's entries, then q_2's, ...; sizes: [gamma]. Fills
    id_bytes, count_bytes: [total] (uint8) and the first entries of id_escapes,
    count_escapes: [total] (int64). Returns how many escapes of each it wrote, or
    (-1, -1) where some position's ids do not ascend (``wire._pack_lists`` sorts).
    """
    k = 0
    n_id = 0
    n_count = 0
    for i in range(sizes.shape[0]):
        prev = 0
        for j in range(sizes[i]):
            d = ids[k] - prev
            if j > 0 and d <= 0:
                return -1, -1
            prev = ids[k]
            n_id = _put(d, id_bytes, id_escapes, k, n_id)
            n_count = _put(counts[k], count_bytes, count_escapes, k, n_count)
            k += 1
    return n_id, n_count


@njit(cache=True, nogil=True)
def _put(v: int, values: np.ndarray, escapes: np.ndarray, k: int, n: int) -> int:
    """Value v as entry k: its byte, or 255 and v as escape n. Returns the escapes
    written, n or n + 1."""
    if v >= _ESCAPE:
        values[k] = _ESCAPE
        escapes[n] = v
        return n + 1
    values[k] = v
    return n


@njit(cache=True, nogil=True)
def _take(values: np.ndarray, escapes: np.ndarray, k: int, n: int) -> tuple[int, int]:
    """Entry k's value: its byte, or escape n where the byte is 255. Returns the value
    and the escapes read, n or n + 1; (-1, n) where escape n is missing."""
    v = np.int64(values[k])
    if v != _ESCAPE:
        return v, n
    if n == escapes.shape[0]:
        return -1, n
    return escapes[n], n + 1


@njit(cache=True, nogil=True)
def hidden_steps(
    z: np.ndarray,
    head_scales: np.ndarray,
    scales: np.ndarray,
    t: float,
    grid: float,
    last: int,
    out: np.ndarray,
) -> None:
    """``hidden_q.derive_q``'s grid steps, the same float64 operations in the same
    order as its numpy reference (so the same bits): z [n, vocab], the code products
    (integers in float32 or float64); head_scales [vocab]; scales [n]; t the
    temperature (1.0: no division). out [n, vocab] int64: each token's steps below
    its row's maximum, rint((max - z) * grid), at most ``last``."""
    n, vocab = z.shape
    w = np.empty(vocab)  # a row of z, scaled
    for i in range(n):
        s = scales[i]
        top = -np.inf
        for j in range(vocab):
            v = (np.float64(z[i, j]) * head_scales[j]) * s
            if t != 1.0:
                v = v / t
            w[j] = v
            if v > top:
                top = v
        for j in range(vocab):
            x = np.rint((top - w[j]) * grid)
            out[i, j] = last if x > last else np.int64(x)


@njit(cache=True, nogil=True)
def hidden_counts(
    steps: np.ndarray, table: np.ndarray, table_f64: np.ndarray, bits: int, counts: np.ndarray
) -> bool:
    """A derived q's counts out of 2^bits from one row of ``hidden_steps`` ([vocab]),
    as ``hidden_q._to_q`` makes them without top-k / top-p: each token the count of
    its step (table[step] scaled down, floored), the leftover to the first maximum.
    counts [vocab] (out). Returns whether every token has a count."""
    vocab, size = steps.shape[0], table.shape[0]
    tally = np.zeros(size, dtype=np.int64)  # tokens per step
    lead, low = 0, steps[0]
    for j in range(vocab):
        k = steps[j]
        tally[k] += 1
        if k < low:
            lead, low = j, k
    total = np.int64(0)
    for k in range(size):
        total += tally[k] * table[k]
    factor = np.float64(np.int64(1) << bits) / np.float64(total)
    per_step = np.empty(size, dtype=np.int64)
    used = np.int64(0)
    covered = 0
    for k in range(size):
        per_step[k] = np.int64(np.floor(table_f64[k] * factor))
        used += tally[k] * per_step[k]
        if per_step[k] > 0:
            covered += tally[k]
    for j in range(vocab):
        counts[j] = per_step[steps[j]]
    counts[lead] += (np.int64(1) << bits) - used
    return covered == vocab


def warm() -> None:
    """Compile (or load from the disk cache) every kernel for the dtypes a service
    meets, so that no request pays for it: a service calls this as it starts.
    Nothing with the kernels off."""
    if not ENABLED:
        return
    meta = np.array([1, 2, 1], dtype=np.int64)
    ids, counts = np.array([1, 2], dtype=np.int64), np.array([3, 1], dtype=np.int64)
    u, out = np.full(2, 0.5), np.empty(4)
    for dtype in (np.float32, np.float64):
        judge(np.full((2, 4), 0.25, dtype=dtype), meta, ids, counts, 4, u, out)
    for dtype in (np.float32, np.float64):
        draft_q(np.zeros(4, dtype=dtype), 1.0, 2, 4, 1, ids[:2].copy(), counts[:2].copy())
    size = np.ones(1, dtype=np.int64)
    encode_q(
        ids[:1],
        counts[:1],
        size,
        np.empty(1, np.uint8),
        ids[:1].copy(),
        np.empty(1, np.uint8),
        ids[:1].copy(),
    )
    one = np.frombuffer(b"\x01", dtype=np.uint8)  # (read-only, as from a message)
    none = np.zeros(0, dtype=np.int64)
    meta = np.array([1, 0, 1], dtype=np.int64)
    decode_q(one, none, np.frombuffer(b"\x01", np.uint8), none, meta, 4, 1, ids[:1], counts[:1])
    steps = np.empty((1, 2), dtype=np.int64)
    for dtype in (np.float32, np.float64):  # (the hidden-state wire's product)
        hidden_steps(np.ones((1, 2), dtype=dtype), np.ones(2), np.ones(1), 1.0, 16.0, 3, steps)
    table = np.array([4, 2, 1, 0], dtype=np.int64)
    hidden_counts(steps[0], table, table.astype(np.float64), 4, np.empty(2, dtype=np.int64))
