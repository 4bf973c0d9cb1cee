"""Distances and thresholds for the statistical tests.

The threshold for "matches p" is the 99.9th percentile of the total
variation distance between p and an empirical distribution of the same
sample size drawn from p itself (400 simulated repetitions, fixed seed), so a
correct sampler fails with probability about 0.001 and the seeds are fixed.
"""

from __future__ import annotations

import torch

# Requests in flight at once while a statistical test samples through the services:
# they share batched forward passes (so the tests also cover exactness under batching),
# and 16 at once sample about 1.6x as fast as 4 on 2 cores.
CONCURRENT = 16


def tv(samples: list[int] | torch.Tensor, p: torch.Tensor) -> float:
    """Total variation between the empirical distribution of samples and p."""
    samples = torch.as_tensor(samples)
    counts = torch.bincount(samples, minlength=p.shape[0]).double()
    return 0.5 * float((counts / counts.sum() - p.double()).abs().sum())


def tv_threshold(p: torch.Tensor, n: int, quantile: float = 0.999, reps: int = 400) -> float:
    g = torch.Generator().manual_seed(123)
    p = p.double()
    draws = torch.multinomial(p.float().expand(reps, -1), n, replacement=True, generator=g)
    counts = torch.zeros(reps, p.shape[0], dtype=torch.float64)
    counts.scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))
    dist = 0.5 * (counts / n - p).abs().sum(-1)
    return float(dist.quantile(quantile))
