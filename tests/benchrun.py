"""Benchmarks run by the smoke tests inside the test process, as ``python -m`` runs them.

A fresh ``python -m benchmarks.NAME`` spends about 5 s importing torch,
transformers and grpc, and about 6 s more starting its own template for forked
services (``specdec.local.forkserver``) before it measures anything: some three
minutes of the suite over its benchmark runs on 2 cores. The test process has
both already, so ``run_benchmark`` runs the module here with ``runpy`` (the same
``__main__`` code, with its own ``sys.argv``) and puts back what a benchmark may
change of its process: CPU affinity of every thread, torch's thread count,
SIGINT/SIGTERM handlers, the environment, the working directory, ``sys.argv``
and random state.

The pinned benchmarks raise their own niceness (the front at ``FRONT_NICE``,
``benchmarks.run``), and lowering it back needs CAP_SYS_NICE (root has it): a
process without it runs every benchmark in a fresh interpreter instead
(``run_fresh``), as a benchmark that left this process's niceness changed would
fail its test.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import random
import runpy
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.local import forkserver
from specdec.local.stack import nice_process, pin_process

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Ran:
    """What a smoke test reads of a benchmark's run."""

    stdout: str


def run_benchmark(module: str, *args: str) -> Ran:
    """``python -m module args`` run in this process where it can renice itself back
    (else ``run_fresh``); it must exit 0 (a raised exception fails the test with the
    benchmark's own traceback)."""
    if not _can_lower_niceness():
        return run_fresh(module, *args, timeout=600)
    if forkserver.wanted(None, None):  # the template starts before any pinning or renicing
        forkserver.start()
    out = io.StringIO()
    with _process_restored(), contextlib.redirect_stdout(out), warnings.catch_warnings():
        # A module a test imported runs again as __main__, as `python -m` runs it.
        warnings.filterwarnings("ignore", "'benchmarks.*' found in sys.modules", RuntimeWarning)
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code: object = 0
        except SystemExit as exit_:
            code = exit_.code or 0
    assert code == 0, f"{module} exited with {code}:\n{out.getvalue()[-3000:]}"
    return Ran(out.getvalue())


def run_fresh(module: str, *args: str, timeout: float) -> Ran:
    """``python -m module args`` in a fresh interpreter; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Ran(proc.stdout)


def _can_lower_niceness() -> bool:
    """Whether this process has CAP_SYS_NICE (capability 23) in effect."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return False
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 23 & 1)
    return False


@contextlib.contextmanager
def _process_restored() -> Iterator[None]:
    argv, cwd, environ = sys.argv[:], os.getcwd(), dict(os.environ)
    cpus = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    os.chdir(REPO)
    try:
        yield
    finally:
        nice_process(os.getpid(), niceness)
        sys.argv = argv
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        pin_process(os.getpid(), cpus)
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.set_rng_state(torch_rng)
        random.setstate(python_rng)
        gc.collect()
    reniced = os.getpriority(os.PRIO_PROCESS, 0)
    assert reniced == niceness, f"niceness {niceness} -> {reniced}: use run_fresh"
