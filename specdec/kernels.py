"""Compiled loops (numba) for the sampled hot path on the CPU.

Right after a forward pass every numpy or torch call costs 20-120 us: the pass
streams the model's weights through the caches and evicts the code and data the
work around it needs (docs/benchmarks.md, "After a forward pass every library
call is cold"). A sampled step's judging is some forty such calls in numpy and
torch; here it is one compiled loop over the rows. numba, a maintained JIT
compiler for numeric Python, does what a C extension would without a compiler on
the user's machine; its machine code is cached on disk next to this file.

Each kernel computes what a reference in ``specdec.sampling`` computes, in
float64 where the reference rounds some steps to p's dtype: the same tokens for
the same uniforms except where a cumulative sum falls within rounding of a
uniform's target (``tests/test_kernels.py`` compares them draw for draw). The
reference stays the path for CUDA tensors and for what the kernels leave out
(dense p, PIT terms, guesses), and is the whole path with ``SPECDEC_KERNELS=0``.
Not for: deciding what to compute (``specdec.sampling``).
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
    rounding). w: [vocab] >= 0."""
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
        if not mass > 0.0:  # q >= p everywhere, so q == p: never rejected; draw from p
            for j in range(vocab):
                r[j] = row[j]
            mass = mass_p
        out[i] = row[x]
        out[gamma + i] = q_x
        out[2 * gamma + i] = _draw(r, mass, u[i])
    row = p[gamma]  # the bonus: p itself
    mass_p = 0.0
    for j in range(vocab):
        r[j] = row[j]
        mass_p += r[j]
    if not (np.isfinite(mass_p) and mass_p > 0.0):
        return gamma
    out[3 * gamma] = _draw(r, mass_p, u[gamma])
    return OK


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
