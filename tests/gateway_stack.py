"""A gateway process in front of a test stack's orchestrator (or any gRPC address).

Builds on ``tests.stack``: the stack's config file plus a ``gateway`` section
on free loopback ports, started with ``specdec.local.stack.start_gateway`` (which
waits until ``/health`` answers 200), its output in ``gateway.log``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.request import urlopen

import yaml

from specdec.local.stack import start_gateway, stop_local

from .stack import free_port

MODEL = "specdec-test"  # gateway.model_name in the tests


@dataclass
class Gateway:
    proc: object
    port: int
    metrics_port: int
    log: Path
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def metrics_text(self) -> str:
        with urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of a metric's samples whose label text contains ``labels``."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            if line.startswith((name + "{", name + " ")) and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        stop_local([self.proc])


@contextlib.contextmanager
def gateway(
    tmp: Path,
    config: dict,
    orchestrator_address: str,
    verbose: bool = False,
    wait_for: str = "/health",
    **keys,
) -> Iterator[Gateway]:
    """A gateway reading ``config`` (a stack's) plus a gateway section made of ``keys``;
    ready once ``wait_for`` answers 200."""
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(config)
    cfg["gateway"] = {
        "port": free_port(),
        "metrics_port": free_port(),
        "orchestrator_address": orchestrator_address,
        "model_name": MODEL,
        "grace_period_s": 2,
        **keys,
    }
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp / "gateway.log"
    with open(log, "wb") as out:
        proc = start_gateway(str(path), [], stdout=out, verbose=verbose, wait_for=wait_for)
    scheme = "https" if cfg["gateway"].get("tls", {}).get("cert") else "http"
    gw = Gateway(proc, cfg["gateway"]["port"], cfg["gateway"]["metrics_port"], log, scheme)
    try:
        yield gw
    finally:
        gw.stop()
