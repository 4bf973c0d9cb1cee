"""q sent as the draft's last hidden state: a few hundred bytes per position at
any vocabulary size, with the q each side derives from it equal bit for bit.

The draft's logits are its output layer applied to its last hidden state h:
z = W h. When the target holds the same output layer, the draft can send h
instead of q, and the target computes q itself. Exactness needs both sides to
derive the *same* q, to the last bit, on any hardware. So neither side uses
the draft's float logits; both derive q from quantized values in integer and
correctly rounded float64 arithmetic, and the draft samples from exactly that q
(as with the list wire, the packing costs acceptance, never exactness):

* W is quantized per row to int8 codes with a float64 scale (``QuantHead``), from
  the checkpoint's float32 weights; both sides compute its ``fingerprint`` and
  the orchestrator uses this wire only when the two are equal.
* h is quantized to int8 codes with one float32 scale (``encode_hidden``): d
  bytes and 4 on the wire.
* The code dot products are integers below 127 * 127 * d < 2^24 for d <= 1040,
  so a float32 matrix product computes them exactly in any order (float64 above
  that), on the CPU or on the model's GPU: the codes need 7 bits, so even TF32's
  11-bit inputs hold them, and each partial sum is an integer below 2^24. The
  product runs where the service's model runs (``QuantHead.to``); what follows
  runs on the CPU. z = dot * w_scale * h_scale, then / temperature: single IEEE
  operations.
* exp is not correctly rounded everywhere, so none is used: z is rounded to a
  grid of 1/16 nat below the row's maximum, and each grid step's weight comes
  from a table built with integer arithmetic only (``_TABLE``: 2^40 e^(-j/16)).
* top-k and top-p act on those integer weights (ties by token id); the weights
  are scaled to counts out of 2^30 in float64 (the leftover to the first
  maximum), and the result is a ``SparseQ`` like any other.

On the demo pair this lost 0.0001 of alpha against the draft's own float q (at
164 bytes per position), where the 1024-token list loses 0.008 at 2,051 bytes.
Not for: the wire format (``specdec.wire``) or drafting (``draft_service``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from specdec import kernels
from specdec.errors import NonFiniteLogits
from specdec.rng import Philox
from specdec.sampling import SamplingParams, SparseQ

BITS = 30  # counts of a derived q are out of 2^30
_GRID = 16  # logit grid steps per nat
_RATIO = 1032895585848  # round(2^40 * exp(-1/16)): one grid step down, in 2^-40
_EXACT_F32_DIM = 1040  # 127 * 127 * 1040 < 2^24: float32 sums of code products are exact
_BLOCK_ROWS = 8192  # rows of the output layer quantized at a time


def _table() -> np.ndarray:
    """_TABLE[j] = 2^40 e^(-j/16), rounded down step by step in integers (identical on
    every machine), until it reaches 0."""
    values = [1 << 40]
    while values[-1] > 0:
        values.append((values[-1] * _RATIO) >> 40)
    return np.array(values, dtype=np.int64)


_TABLE = _table()  # [409]; weights below e^-25.5 of the maximum are 0
_TABLE_F64 = _TABLE.astype(np.float64)  # exact: every entry is below 2^53


def _quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row int8 codes and float64 scales of a float64 array [rows, d]."""
    peak = np.abs(x).max(axis=-1)  # [rows]
    scales = np.where(peak > 0, peak / 127.0, 1.0)
    codes = np.clip(np.rint(x / scales[:, None]), -127, 127)
    return codes, scales


@dataclass(frozen=True)
class QuantHead:
    """The draft's output layer, quantized the same way on both sides."""

    # The int8 codes, transposed: [d, vocab], float32 (float64 for d > 1040). Kept as
    # torch's for the matrix product: torch keeps to the service's thread setting, where
    # numpy's BLAS starts threads of its own that spin on a service pinned to one core
    # (measured: a third of the tokens/s). None where ``packed`` holds them instead.
    matrix: torch.Tensor | None
    scales: np.ndarray  # [vocab] float64
    fingerprint: str  # SHA-256 over codes and scales
    # The codes as oneDNN's blocked weight of a linear layer ([vocab, d] packed; CPU,
    # float32), for products of several rows at once: ``packed()``.
    onednn: torch.Tensor | None = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> QuantHead:
        """weight: [vocab, d], the output layer's matrix (no bias). Quantized in blocks
        of rows, so that the float64 work never holds more than a block (a whole
        151,936 x 896 head in float64 is 1.1 GB a temporary)."""
        w = weight.detach().to("cpu", torch.float32).numpy()  # [vocab, d]
        vocab, d = w.shape
        dtype = np.float32 if d <= _EXACT_F32_DIM else np.float64
        matrix = np.empty((d, vocab), dtype=dtype)  # the codes, transposed
        scales = np.empty(vocab, dtype=np.float64)
        digest = hashlib.sha256()  # over the codes (row-major, as one piece), then the scales
        for lo in range(0, vocab, _BLOCK_ROWS):
            hi = min(lo + _BLOCK_ROWS, vocab)
            codes, scales[lo:hi] = _quantize_rows(w[lo:hi].astype(np.float64))
            digest.update(codes.astype(np.int8).tobytes())
            matrix[:, lo:hi] = codes.T
        digest.update(scales.astype("<f8").tobytes())
        return cls(torch.from_numpy(matrix), scales, digest.hexdigest())

    @classmethod
    def of_model(cls, model, weight: torch.Tensor | None = None) -> QuantHead | None:
        """The head of a causal LM whose logits are a plain linear map of its last
        hidden state, or None (a bias, a final soft-cap or logit scaling: the list wire
        serves those). ``weight``: the output layer's, where ``model`` holds none (built
        on the meta device, ``loading.load_output_layer``)."""
        head = model.get_output_embeddings()
        cfg = model.config
        plain = isinstance(head, torch.nn.Linear) and head.bias is None
        for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            plain = plain and getattr(cfg, name, None) in (None, 1, 1.0)
        return cls.from_weight(head.weight if weight is None else weight) if plain else None

    def to(self, device: torch.device | str) -> QuantHead:
        """The same head with its matrix on ``device``, where the derivation's product
        then runs (the values it computes are the same integers anywhere)."""
        if self.matrix is None or self.matrix.device == torch.device(device):
            return self
        return replace(self, matrix=self.matrix.to(device))

    def packed(self) -> QuantHead:
        """The same head for a service that derives several positions at a time (the
        target: gamma a verify), with its codes packed once for oneDNN. MKL's product
        repacks the matrix on every call: for 5 rows at 4,096 x 160 it took 223 us
        against 87 packed, at 151,936 x 896 114 ms against 29 (one row is faster
        unpacked: the draft's case). Only on the CPU in float32; else unchanged."""
        # Imported here: it loads the model runtime, which the orchestrator (this
        # module's user through specdec.wire) has no use for.
        from specdec.runtime import packed_linear

        m = self.matrix
        if m is None or m.dtype != torch.float32 or not packed_linear.available(m.device, m.dtype):
            return self
        return replace(self, matrix=None, onednn=packed_linear.pack(m.T.contiguous()))

    def product(self, codes: np.ndarray) -> torch.Tensor:
        """codes [n, d] int8 -> their dot products with every row of the head [n, vocab]:
        integers, exact (see the module's docstring), on the head's device."""
        if self.onednn is not None:  # (packed() loaded the module)
            from specdec.runtime.packed_linear import multiply

            return multiply(torch.from_numpy(codes.astype(np.float32)), self.onednn)
        exact = np.float32 if self.matrix.dtype == torch.float32 else np.float64
        return torch.from_numpy(codes.astype(exact)).to(self.matrix.device) @ self.matrix

    @property
    def vocab(self) -> int:
        return self.scales.shape[0]

    @property
    def dim(self) -> int:
        return self.matrix.shape[0] if self.matrix is not None else self.onednn.shape[1]


def encode_hidden(h: torch.Tensor) -> tuple[np.ndarray, float]:
    """int8 codes [d] and a float32 scale for one hidden state h: [d]."""
    x = h.detach().to("cpu", torch.float64).numpy()
    peak = float(np.abs(x).max()) if x.size else 0.0
    if not np.isfinite(peak):
        raise NonFiniteLogits("the model's hidden state is not finite")
    scale = float(np.float32(peak / 127.0)) if peak > 0 else 1.0  # as the wire carries it
    codes = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    return codes, scale


@dataclass(frozen=True)
class HiddenQ(SparseQ):
    """A q derived from a hidden state, with the codes it was derived from (what the
    wire carries instead of its counts)."""

    code: np.ndarray | None = None  # [d] int8
    code_scale: float = 1.0


def hidden_position(
    head: QuantHead, h: torch.Tensor, params: SamplingParams, rng: Philox
) -> tuple[int, HiddenQ]:
    """One drafted position from the draft's last hidden state h: [d]. x is drawn from
    exactly the q the target will derive from the codes (the counterpart of
    ``sampling.draft_position``; sampled requests only)."""
    code, scale = encode_hidden(h)
    q = derive_q(head, code[None, :], np.array([scale]), params)[0]
    q = HiddenQ(q.ids, q.counts, q.tail, q.vocab, q.bits, code, scale)
    return q.sample(rng), q


def derive_q(
    head: QuantHead, codes: np.ndarray, scales: np.ndarray, params: SamplingParams
) -> list[SparseQ]:
    """The q of each position from its hidden-state codes, identical on every machine.

    codes: [n, d] int8; scales: [n] (float32 values). Not for greedy requests (their
    q is a point: ``SparseQ.point``). The work after the product is one compiled loop
    per step (``kernels.hidden_steps``, ``kernels.hidden_counts``), bit for bit
    ``_steps`` and ``_to_q``'s numpy, which it replaces with ``SPECDEC_KERNELS=0``."""
    z = head.product(np.asarray(codes)).cpu().numpy()  # [n, vocab] integers
    scales = np.asarray(scales, np.float64)
    t = float(np.float32(params.temperature))
    if kernels.ENABLED:
        steps = np.empty(z.shape, dtype=np.int64)
        kernels.hidden_steps(z, head.scales, scales, t, float(_GRID), len(_TABLE) - 1, steps)
    else:
        steps = _steps(z, head.scales, scales, t)
    return [_to_q(row, params) for row in steps]


def _steps(z: np.ndarray, head_scales: np.ndarray, scales: np.ndarray, t: float) -> np.ndarray:
    """Each token's grid steps below its row's maximum: [n, vocab] from the code
    products z [n, vocab] (the reference of ``kernels.hidden_steps``)."""
    # In place from here on, each step one correctly rounded float64 operation per entry.
    z = z.astype(np.float64)
    z *= head_scales[None, :]
    z *= scales[:, None]
    if t != 1.0:
        z /= t
    steps = np.subtract(z.max(axis=1, keepdims=True), z, out=z)  # [n, vocab] >= 0
    steps *= _GRID
    np.rint(steps, out=steps)
    np.minimum(steps, len(_TABLE) - 1, out=steps)
    # Grid steps below each row's maximum: the weight of a token is _TABLE[its step].
    return steps.astype(np.intp)


def _to_q(steps: np.ndarray, params: SamplingParams) -> SparseQ:
    """Counts out of 2^BITS from the weights _TABLE[steps] ([vocab] grid steps below
    the maximum, 0 at it), after top-k and top-p.

    _TABLE falls strictly, so tokens rank by step (ties by id), and each count is a
    function of its step alone: the work per token is a tally of the steps, one
    gather and one comparison; the rest is per table entry. Without top-k and top-p,
    with the kernels on: ``kernels.hidden_counts``, the same counts."""
    vocab = steps.shape[0]
    cut = (0 < params.top_k < vocab) or params.top_p < 1.0
    if kernels.ENABLED and not cut:
        counts = np.empty(vocab, dtype=np.int64)
        full = kernels.hidden_counts(steps, _TABLE, _TABLE_F64, BITS, counts)
    else:
        counts, full = _counts(steps, params, cut)
    if full:  # every token has a count (often at T=1)
        return SparseQ(np.arange(vocab), counts, 0, vocab, BITS)
    ids = np.flatnonzero(counts)
    return SparseQ(ids, counts[ids], 0, vocab, BITS)


def _counts(steps: np.ndarray, params: SamplingParams, cut: bool) -> tuple[np.ndarray, bool]:
    """``_to_q``'s counts [vocab] in numpy (``cut``: after top-k and top-p), and whether
    every token has one (the reference of ``kernels.hidden_counts``)."""
    tally = np.bincount(steps, minlength=len(_TABLE))  # [len(_TABLE)] tokens per step
    if cut:
        steps, tally = _top_k_top_p(steps, tally, params)
    total = int(tally @ _TABLE)  # exact: below 2^40 * vocab < 2^63
    per_step = np.floor(_TABLE_F64 * (float(1 << BITS) / float(total)))
    per_step = per_step.astype(np.int64)  # [len(_TABLE)] a token's count at each step
    counts = per_step[steps]  # [vocab]
    lead = int(np.argmin(steps))  # the first maximum
    counts[lead] += (1 << BITS) - int(tally @ per_step)
    return counts, int(tally[per_step > 0].sum()) == steps.shape[0]


def _top_k_top_p(
    steps: np.ndarray, tally: np.ndarray, params: SamplingParams
) -> tuple[np.ndarray, np.ndarray]:
    """steps and tally with the tokens that top-k and then top-p drop moved to the
    last step (weight 0). Ranked by weight, ties by id: the r most likely tokens are
    every token of the steps before some step s and the first of step s by id, so
    their mass is known from the tally alone (integers, exact)."""
    vocab = steps.shape[0]
    before = np.concatenate(([0], np.cumsum(tally)))  # [L + 1] tokens ranked before step s
    mass = np.concatenate(([0], np.cumsum(tally * _TABLE)))  # [L + 1] their mass (int64)

    def step_of(rank: int) -> int:  # the step of the rank-th token (1-based)
        return int(np.searchsorted(before, rank, side="left")) - 1

    def mass_of(rank: int) -> int:  # the mass of the rank most likely tokens
        s = step_of(rank)
        return int(mass[s]) + (rank - int(before[s])) * int(_TABLE[s])

    keep = params.top_k if 0 < params.top_k < vocab else vocab
    if params.top_p < 1.0:
        # Keep through the first token whose cumulative mass reaches top_p (mass_of
        # grows with the rank: the first rank that reaches it, by bisection).
        goal = float(mass_of(keep)) * float(params.top_p)
        lo, hi = 1, keep
        while lo < hi:
            mid = (lo + hi) // 2
            if float(mass_of(mid)) >= goal:
                hi = mid
            else:
                lo = mid + 1
        keep = lo
    last = step_of(keep)  # the kept tokens: steps before it, and the first of it
    cut = steps.copy()
    cut[steps > last] = len(_TABLE) - 1
    cut[np.flatnonzero(steps == last)[keep - int(before[last]) :]] = len(_TABLE) - 1
    return cut, np.bincount(cut, minlength=len(_TABLE))
