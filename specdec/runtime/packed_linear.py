"""oneDNN's inner product with weights packed once, on the CPU.

Torch's stock ``nn.Linear`` on the CPU hands each call's weight to MKL's
gemm, which packs it into its blocked layout again on every call. oneDNN
can take the weight packed once at start-up (``_reorder_linear_weight``,
what torch's own compiler does when it freezes a model for the CPU) and
then multiplies passes of any size without repacking. Measured on the demo
target (8 x 384, float32, one thread, whole forwards): 0.70x the stock time
for a one-token pass, 0.56x for a 5-token verify, 0.58x for 8 sessions'
verifies (40 tokens), 0.52x for a 64-token prefill. The 1-layer demo draft,
whose weights sit in cache and whose passes are mostly Python, gains from 5
tokens per pass (0.94x) and loses at one (1.34x).

So each ``nn.Linear`` becomes a ``PackedLinear`` that keeps its weight (same
parameter, still tied where it was) and a packed copy, and multiplies a pass
of at least ``min_rows`` rows with the copy. ``calibrate`` decides
``min_rows`` per model at start-up by timing the runner's own forwards both
ways (or turns packing off where it never pays), and checks that both ways
agree: the two kernels sum in different orders, which moves logits by about
1e-6 of their spread, like packing sessions into one row does
(``specdec.runtime.ragged``).

CPU only: on CUDA the stock path is cuBLAS, and nothing here applies.
Costs one more copy of the linear weights in memory.

Not for: which sessions share a pass (``specdec.runtime.forward_loop``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV, disagreement

log = logging.getLogger(__name__)

OFF = 1 << 62  # min_rows that no pass reaches
# Pass sizes the calibration times, and how much faster (a ratio of times) the packed
# forward must be at a size, and at every larger size, for packing to start there.
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)
_FASTER = 0.97
_REPEATS = 3
# Largest disagreement accepted between the two ways, relative to the logits' spread.
_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1}


def available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear can serve this model here."""
    return (
        torch.device(device).type == "cpu"
        and dtype in _TOLERANCE
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear(nn.Module):
    """``nn.Linear`` that multiplies passes of at least ``min_rows`` rows with oneDNN."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the same parameter: ties and state_dict unchanged
        self.bias = linear.bias
        self.min_rows = OFF
        # A plain attribute, not a buffer: the state dict stays the model's own.
        self._packed = pack(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()  # [rows, in]
        y = multiply(flat, self._packed, self.bias)
        return y.view(*x.shape[:-1], self.out_features)  # [..., out]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout for its inner product."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def multiply(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [rows, in] times a ``pack``-ed weight [out, in], transposed (plus bias):
    [rows, out], oneDNN's inner product."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def install(model: nn.Module) -> list[PackedLinear]:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` (packing off)."""
    packed = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                p = PackedLinear(child)
                setattr(parent, name, p)
                packed.append(p)
    return packed


def uninstall(model: nn.Module) -> None:
    """Put plain ``nn.Linear`` modules back (same parameters), freeing the copies."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                lin = nn.Linear(child.in_features, child.out_features, False, device="meta")
                lin.weight, lin.bias = child.weight, child.bias
                setattr(parent, name, lin)


def set_min_rows(model: nn.Module, min_rows: int) -> None:
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.min_rows = min_rows


def choose_min_rows(stock_s: dict[int, float], packed_s: dict[int, float]) -> int | None:
    """The smallest pass size from which packing is faster at every size timed, or None."""
    start = None
    for rows in sorted(stock_s, reverse=True):
        if packed_s[rows] < _FASTER * stock_s[rows]:
            start = rows
        else:
            break
    return start


def calibrate(
    model: nn.Module,
    forward: Callable[[list[int]], torch.Tensor],
    max_rows: int,
    vocab_size: int,
) -> tuple[int | None, dict[int, tuple[float, float]]]:
    """Time ``forward`` (one fresh session's pass of n tokens -> logits [n, V]) with
    and without packing at each calibration size up to ``max_rows``; returns the
    chosen ``min_rows`` (None: packing never pays, or disagrees) and, per size, the
    two times in seconds. Leaves the model's packing set to that choice."""
    dtype = next(model.parameters()).dtype
    stock_s: dict[int, float] = {}
    packed_s: dict[int, float] = {}
    worst = 0.0
    for rows in (r for r in CALIBRATION_ROWS if r <= max_rows):
        tokens = [(7 * i + 3) % vocab_size for i in range(rows)]
        times = {OFF: math.inf, 0: math.inf}
        logits = {}
        for _ in range(_REPEATS):
            for min_rows in (OFF, 0):  # alternating, so that drift hits both alike
                set_min_rows(model, min_rows)
                t = time.perf_counter()
                logits[min_rows] = forward(tokens)
                times[min_rows] = min(times[min_rows], time.perf_counter() - t)
        worst = max(worst, disagreement(logits[0].double(), logits[OFF].double()))
        stock_s[rows], packed_s[rows] = times[OFF], times[0]
    timings = {r: (stock_s[r], packed_s[r]) for r in stock_s}
    choice = choose_min_rows(stock_s, packed_s) if stock_s else None
    if worst > _TOLERANCE.get(dtype, 0.0):
        log.warning(
            "packed linear: oneDNN's logits differ from the stock ones by %.3g of their "
            "spread; packing stays off",
            worst,
        )
        choice = None
    set_min_rows(model, OFF if choice is None else choice)
    return choice, timings


def pack_model(
    model: nn.Module, runner: RaggedRunner | None = None, max_rows: int = 64, min_rows: int = 0
) -> tuple[int | None, dict[int, tuple[float, float]]]:
    """What a model service does at start-up: install ``PackedLinear`` layers, and pack
    from ``min_rows`` (given) or from the size ``calibrate`` finds, timing ``runner``'s
    forwards (one is made without its self-test when not given); where packing never
    pays, the plain layers go back. Returns the choice and the timings. A model off
    the CPU, in another dtype, or whose layers oneDNN cannot pack or run (logged) keeps
    its plain layers: never a failure.

    A runner whose passes run the layers fused (``RaggedRunner.fused``) is timed with
    fusing off (a fused pass calls no packed layer), and its fused passes then stop
    where the packed ones start (``fused_below``)."""
    if not available(next(model.parameters()).device, next(model.parameters()).dtype):
        return None, {}
    try:
        install(model)
        if min_rows:
            set_min_rows(model, min_rows)
            choice, timings = min_rows, {}
        else:
            runner = runner or RaggedRunner(model, self_test=False)
            fused, runner.fused = runner.fused, False
            try:
                choice, timings = calibrate(
                    model,
                    lambda tokens: runner.forward([Feed(SessionKV(), tokens, len(tokens))])[0],
                    max_rows,
                    runner.vocab_size,
                )
            finally:
                runner.fused = fused
    except RuntimeError as e:
        log.warning("packed linear: oneDNN cannot serve this model (%s); packing stays off", e)
        choice, timings = None, {}
    if choice is None:
        uninstall(model)
    elif runner is not None:
        runner.fused_below = choice
    return choice, timings
