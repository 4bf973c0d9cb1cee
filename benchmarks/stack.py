"""The three services as child processes for a benchmark, on free loopback
ports, logging into the results folder, plus a thin Generate client.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml

from specdec.cli import stop_local, wait_healthy
from specdec.v1 import common_pb2, draft_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc

from .common import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Services:
    config_path: Path
    config: dict
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    extra: list[subprocess.Popen] = field(default_factory=list)

    def address(self, role: str) -> str:
        return f"127.0.0.1:{self.config[role]['port']}"

    def metrics_port(self, role: str) -> int:
        return self.config[role]["metrics_port"]

    def start_orchestrator(
        self, name: str, draft: str, target: str, sets: dict | None = None
    ) -> tuple[str, int]:
        """One more orchestrator (other upstream addresses, other settings);
        returns (address, metrics port)."""
        port, mport = free_port(), free_port()
        sets = {
            "orchestrator.port": port,
            "orchestrator.metrics_port": mport,
            "orchestrator.draft_address": draft,
            "orchestrator.target_address": target,
            **(sets or {}),
        }
        proc = _spawn("orchestrator", self.config_path, sets, self.log_dir / f"{name}.log")
        self.extra.append(proc)
        address = f"127.0.0.1:{port}"
        wait_healthy(address, 300, [proc])
        return address, mport

    def stop_extra(self) -> None:
        stop_local(self.extra)
        self.extra = []

    def stop(self) -> None:
        stop_local(self.extra + list(self.procs.values()))


def _spawn(role: str, config: Path, sets: dict, log: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "specdec", "serve", role, "--config", str(config)]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    out = open(log, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def start_services(
    out: Path,
    draft: str,
    target: str,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int = 2,
    draft_threads: int | None = None,
) -> Services:
    """Draft, target and orchestrator on free ports; returns once all three are healthy."""
    cfg = {
        role: {
            "model": str(path),
            "device": device,
            "dtype": dtype,
            "port": free_port(),
            "metrics_port": free_port(),
            "torch_threads": draft_threads if role == "draft" and draft_threads else threads,
        }
        for role, path in (("draft", draft), ("target", target))
    }
    cfg["orchestrator"] = {
        "port": free_port(),
        "metrics_port": free_port(),
        "draft_address": f"127.0.0.1:{cfg['draft']['port']}",
        "target_address": f"127.0.0.1:{cfg['target']['port']}",
        # Generous: a benchmark must not fall back to plain decoding on a slow step.
        "draft_timeout_s": 10.0,
        "max_concurrent_requests": 32,
    }
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = out / "services.yaml"
    path.write_text(yaml.safe_dump(cfg))
    services = Services(path, cfg, log_dir)
    try:
        for role in ("draft", "target", "orchestrator"):
            services.procs[role] = _spawn(role, path, {}, log_dir / f"{role}.log")
        procs = list(services.procs.values())
        for role in ("draft", "target", "orchestrator"):
            wait_healthy(services.address(role), 300, procs)
    except BaseException:
        services.stop()
        raise
    return services


class Client:
    """One channel to an orchestrator; ``generate`` returns the request's numbers."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def generate(
        self,
        prompt: str,
        max_new_tokens: int,
        temperature: float,
        gamma: int,
        seed: int,
        dense: bool = False,
    ) -> dict:
        req = orchestrator_pb2.GenerateRequest(
            text=prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            gamma=gamma,
            seed=seed,
            dense=dense,
        )
        t0 = time.perf_counter()
        tokens, stats = 0, None
        for msg in self.stub.Generate(req, timeout=600):
            if msg.HasField("chunk"):
                tokens += len(msg.chunk.token_ids)
            else:
                stats = msg.stats
        wall = time.perf_counter() - t0
        return {
            "tokens": stats.generated_tokens if stats else tokens,
            "wall_s": wall,
            "server_s": stats.total_time_s,
            "ttft_s": stats.time_to_first_token_s,
            "steps": stats.steps,
            "drafted": stats.drafted_tokens,
            "accepted": stats.accepted_tokens,
            "wire_bytes": stats.wire_bytes_per_token * stats.generated_tokens,
            "round_trips": stats.round_trips,
            "fallback_steps": stats.fallback_steps,
            "finish": stats.finish_reason,
        }


def info_rtt_ms(address: str, calls: int = 30) -> float:
    """Median latency of a draft service's Info RPC at ``address`` (through a proxy or not)."""
    with grpc.insecure_channel(address) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        stub.Info(common_pb2.InfoRequest(), timeout=10)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            stub.Info(common_pb2.InfoRequest(), timeout=10)
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3
