"""Random numbers from a 64-bit seed, the same on every machine and device.

Every draw in specdec comes from a counter-based generator (numpy's Philox)
keyed by all 64 bits of a seed: seeds 5 and 5 + 2^32 give different streams,
and a CPU and a CUDA replica given the same seed draw the same numbers (the
numbers are made on the host; only the sampling arithmetic runs on the
device). Not for: deciding what to draw (``specdec.sampling``).
"""

from __future__ import annotations

import numpy as np
import torch

SEED_BITS = 64


def generator(seed: int) -> np.random.Generator:
    """A Philox generator keyed by ``seed`` (0 <= seed < 2^64)."""
    return np.random.Generator(np.random.Philox(key=seed))


def side_generator(seed: int) -> np.random.Generator:
    """A second stream for ``seed``, independent of ``generator(seed)``'s (the same
    Philox key, jumped 2^128 draws ahead)."""
    return np.random.Generator(np.random.Philox(key=seed).jumped())


def uniforms(seed: int, n: int) -> torch.Tensor:
    """n uniforms in [0, 1) for one call: float64 [n]."""
    return torch.from_numpy(generator(seed).random(n))


def seeds(rng: np.random.Generator, n: int = 1) -> list[int]:
    """n fresh 64-bit seeds for downstream calls."""
    return [int(s) for s in rng.integers(0, 2**SEED_BITS, size=n, dtype=np.uint64)]
