"""OpenMP's idle threads, for a target whose plain passes take more threads.

With ``plain_torch_threads`` the target runs its passes of plain decoding steps
on more threads than its other passes (``specdec.runtime.forward_loop``). After
a parallel region GNU OpenMP (libgomp, which torch's CPU builds use) keeps its
idle worker threads spinning before they sleep: 300,000 spins by default, which
took 4-5 ms of CPU after each pass on the project's VM (read from the process's
CPU time, which the kernel counts in 4 ms ticks). Where the draft shares the
machine's cores, a worker still spinning after a plain pass holds the core the
draft drafts on next, when an adaptive request turns from plain decoding to
speculation. With 10,000 spins the same reading was about 1 ms; that is still
far longer than the gaps between the operations of one pass, so the pass
itself does not slow: side by side, plain decoding 1.02x and adaptive greedy
decoding 1.05x with it (``docs/benchmarks.md``, "A second thread for plain
passes").

``short_spins`` sets ``GOMP_SPINCOUNT`` for that, in a target service's process
before torch loads, unless the user set ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY``. Elsewhere (another OpenMP runtime) the variable is
ignored. The test suite forks its services from a process that has torch
loaded already (``specdec.local.forkserver``): there it does nothing.
"""

from __future__ import annotations

import logging
import os
import sys

from specdec.config import device_kind

log = logging.getLogger(__name__)

SPINS = 10_000


def short_spins(plain_threads: int, threads: int, device: str) -> None:
    """Short spins for OpenMP's idle workers where a pass may use ``plain_threads``
    threads, more than ``threads`` (0: torch's default) on the CPU."""
    if plain_threads <= max(threads, 1) or device_kind(device) != "cpu":
        return
    if {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ):
        return
    if "torch" in sys.modules:  # (libgomp read its settings as it loaded)
        log.debug("OpenMP spins left as they are: torch is already loaded")
        return
    os.environ["GOMP_SPINCOUNT"] = str(SPINS)
