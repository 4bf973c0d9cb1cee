"""OpenMP's idle workers, for a target whose passes change width.

With ``plain_torch_threads`` above ``torch_threads`` the target runs some passes
on more threads than others (``specdec.runtime.forward_loop``): passes of plain
decoding steps, and a lone request's verifies while its draft is idle, take the
draft's core too. Between two such verifies the draft drafts the next block (a
few milliseconds), and the target's OpenMP worker waits for the next parallel
region. GNU OpenMP (libgomp, which torch's CPU builds use) lets an idle worker
spin ``GOMP_SPINCOUNT`` times before it sleeps: by default 300,000, which on the
project's VM is about half a millisecond of CPU after a pass (the probe in
``benchmarks.openmp_spins``), shorter than the draft's turn. The worker then
sleeps between verifies, and the next verify waits for it to wake: through the
three services a fifth of the 2-thread verifies took twice their median time
(in one process 1 of 414; why there so few was not measured).

``long_spins`` sets ``GOMP_SPINCOUNT`` to ``SPINS`` (about 40 ms of spinning on
that VM, far longer than a step's draft turn) in such a target's process before
torch loads, unless the user set ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``. Side by
side against libgomp's default, through the services on the project's 2 cores,
sequential gamma 4 ran 1.23x (greedy) and 1.12x (T=1) as fast, plain decoding
1.02x, adaptive requests 1.03x and 1.06x, two sustained clients 1.05-1.06x
(``docs/benchmarks.md``, "The target's OpenMP workers spin through the draft's
turn"). The price: after a request's last pass the worker spins on for those
40 ms, one core's time, which the scheduler gives to any thread that wakes.

Where all of a target's passes use the same threads (its own node, or one thread)
nothing is set: not measured there. Elsewhere (another OpenMP runtime) the
variable is ignored. The test suite forks its services from a process that has
torch loaded already (``specdec.local.forkserver``): there it does nothing.
"""

from __future__ import annotations

import logging
import os
import sys

from specdec.config import device_kind

log = logging.getLogger(__name__)

SPINS = 3_000_000


def long_spins(plain_threads: int, threads: int, device: str) -> None:
    """Long spins for OpenMP's idle workers where a pass may use ``plain_threads``
    threads, more than ``threads`` (0: torch's default) on the CPU."""
    if plain_threads <= max(threads, 1) or device_kind(device) != "cpu":
        return
    if {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ):
        return
    if "torch" in sys.modules:  # (libgomp read its settings as it loaded)
        log.debug("OpenMP spins left as they are: torch is already loaded")
        return
    os.environ["GOMP_SPINCOUNT"] = str(SPINS)
