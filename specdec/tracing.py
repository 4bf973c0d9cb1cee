"""Step timeline marks: where a speculation step's wall time goes, hop by hop.

Off unless the environment names a folder (``SPECDEC_TRACE_DIR``); then each
service process writes ``<role>-<pid>.trace`` there, one line per mark:
``<time.perf_counter()> <label>``. On Linux that clock is the system's
monotonic clock, the same in every process of one machine, so the marks of a
local stack (``specdec.local.stack``) merge into one timeline:
``python -m benchmarks.timeline`` starts such a stack, runs requests, and
reports the median of every segment of a step's critical path (orchestrator
to draft, drafting, the relay, verifying, back).

For benchmarks on one machine, not for production tracing: marks from
different machines do not share a clock. Disabled, a mark costs one global
lookup and a comparison.
Not for: metrics (``specdec.metrics``), which every deployment exports.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TextIO

ENV = "SPECDEC_TRACE_DIR"
_out: TextIO | None = None


def start(role: str) -> None:
    """Open this process's trace file if ``SPECDEC_TRACE_DIR`` is set."""
    global _out
    folder = os.environ.get(ENV)
    if folder and _out is None:
        path = Path(folder) / f"{role}-{os.getpid()}.trace"
        _out = open(path, "w", buffering=1 << 16)  # noqa: SIM115 - closed by close()


def mark(label: str) -> None:
    """Record that this process reached ``label`` now (no-op when tracing is off)."""
    if _out is not None:
        _out.write(f"{time.perf_counter():.7f} {label}\n")


def close() -> None:
    global _out
    if _out is not None:
        _out.close()
        _out = None
