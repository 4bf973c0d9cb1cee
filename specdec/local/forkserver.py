"""Services forked from one template process: a faster start for the test suite.

A fresh ``specdec serve ROLE`` spends 3-5 s of CPU importing torch, transformers'
model code and grpc before it does anything, and the test suite starts some 150
services: on a 2-core machine that was about a third of its wall time. With
``SPECDEC_LOCAL_FORKSERVER=1`` in the environment, ``specdec.local.stack.spawn``
forks each service from a template process that imported those modules once
(the standard library's ``multiprocessing`` forkserver). The service is the same
``specdec serve`` code in a process of its own, with its own pid, ports, log and
exit status; only the imports are shared (copy-on-write), and it is ready about
a second after it is asked for.

Off by default: ``specdec up``, the demo and the benchmarks start fresh
interpreters, as a deployment does. The tests turn it on (``tests/conftest.py``).
A service given an environment of its own still gets a fresh interpreter, unless
that environment differs only in ``PYTHONPATH``: how a test plants a fault, as a
``sitecustomize`` module that a fresh interpreter runs at start. The forked
process runs that module itself before ``main`` (``_plant``). It runs after the
service's modules were imported, so a fault must patch every module that bound
the name it replaces; a planted fault that does not take effect fails its own
test, which asserts that the fault is caught.
Not for: deciding what runs (``specdec.local.stack``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

ENV = "SPECDEC_LOCAL_FORKSERVER"  # "1": fork services from the template process
# Imported once by the template process (the services' own modules and, through
# them, torch, transformers and grpc).
PRELOAD = [
    "specdec.local.forkserver",
    "specdec.cli",
    "draft_service.servicer",
    "target_service.servicer",
    "orchestrator.servicer",
    "specdec.local.template",  # (the compiled kernels, loaded once)
]

_context: multiprocessing.context.ForkServerContext | None = None


def wanted(env: dict[str, str] | None, out) -> bool:
    """Whether a service can be forked: asked for, this process's environment or
    one that differs only in ``PYTHONPATH`` (a planted ``sitecustomize``), and
    output to where this process's goes, nowhere, or a file (reopened by name)."""
    if os.environ.get(ENV) != "1":
        return False
    if env is not None and _but_path(env) != _but_path(os.environ):
        return False
    return out is None or out == subprocess.DEVNULL or isinstance(getattr(out, "name", None), str)


def _but_path(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != "PYTHONPATH"}


class ForkedProcess:
    """What the harness uses of ``subprocess.Popen``, for a forked service: pid,
    poll, wait, send_signal, terminate, kill and returncode (negative: the signal
    that ended it, as Popen reports it)."""

    def __init__(self, proc: multiprocessing.Process) -> None:
        self._proc = proc
        self.pid: int = proc.pid
        self.args = proc.name

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:  # (never a pid the system may have reused)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start() -> multiprocessing.context.ForkServerContext:
    """The template process, started (with its imports done) if it is not yet."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
    return _context


def spawn(args: list[str], cwd: Path, out, env: dict[str, str] | None = None) -> ForkedProcess:
    """``specdec ARGS`` in a process forked from the template (started on first use),
    in ``cwd``, with ``env`` (default: this process's current environment) and
    ``out`` as ``wanted`` allows. A daemon process: if this one exits first,
    multiprocessing stops it."""
    path = os.devnull if out == subprocess.DEVNULL else getattr(out, "name", None)
    if path is not None:
        path = os.path.abspath(path)  # (the service runs in ``cwd``)
    proc = start().Process(
        target=_main,
        args=(list(args), str(cwd), path, dict(os.environ if env is None else env)),
        name=" ".join(["specdec", *args[:2]]),
        daemon=True,
    )
    proc.start()
    return ForkedProcess(proc)


def _main(args: list[str], cwd: str, out: str | None, env: dict[str, str]) -> None:
    """The forked process: the caller's directory, environment and output, a
    planted ``sitecustomize`` (``_plant``), then the command line's ``main``."""
    os.chdir(cwd)
    template_path = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(env)
    if out is not None:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    _plant(template_path.split(os.pathsep), env.get("PYTHONPATH", "").split(os.pathsep))
    sys.argv = ["specdec", *args]
    from specdec.cli import main

    sys.exit(main(args))


def _plant(template_path: list[str], path: list[str]) -> None:
    """What a fresh interpreter on ``path`` (PYTHONPATH's folders) would run at start
    that the template did not: its folders the template lacks go first on
    ``sys.path``, and the first ``sitecustomize.py`` among ``path``'s folders runs
    if it is in one of those."""
    new = [d for d in path if d and d not in template_path]
    sys.path[:0] = new
    for folder in filter(None, path):
        site = Path(folder) / "sitecustomize.py"
        if site.is_file():
            if folder in new:
                runpy.run_path(str(site), run_name="sitecustomize")
            return
