"""A real local stack for tests: draft, target and orchestrator as child
processes on free loopback ports, each with a /metrics port.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.request import urlopen

import grpc
import yaml

from specdec.cli import start_local, stop_local, wait_healthy
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .tiny import build_pair


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    config_path: Path
    config: dict
    procs: list[subprocess.Popen] = field(default_factory=list)
    env: dict[str, str] | None = None

    @property
    def orchestrator_address(self) -> str:
        return f"127.0.0.1:{self.config['orchestrator']['port']}"

    def address(self, role: str) -> str:
        return f"127.0.0.1:{self.config[role]['port']}"

    @property
    def metrics_ports(self) -> dict[str, int]:
        return {r: self.config[r]["metrics_port"] for r in ("orchestrator", "draft", "target")}

    def stub(self) -> orchestrator_pb2_grpc.OrchestratorStub:
        channel = grpc.insecure_channel(self.orchestrator_address)
        return orchestrator_pb2_grpc.OrchestratorStub(channel)

    def generate_raw(self, **fields) -> tuple[list[int], str, orchestrator_pb2.GenerationStats]:
        """Run one Generate; returns (token ids, text, stats)."""
        prompt = fields.pop("prompt", None)
        req = orchestrator_pb2.GenerateRequest(**fields)
        if isinstance(prompt, str):
            req.text = prompt
        elif prompt is not None:
            req.token_ids.ids.extend(prompt)
        ids, text, stats = [], "", None
        with grpc.insecure_channel(self.orchestrator_address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            for msg in stub.Generate(req, timeout=120):
                if msg.HasField("chunk"):
                    ids += msg.chunk.token_ids
                    text += msg.chunk.text
                else:
                    stats = msg.stats
        return ids, text, stats

    def generate(
        self,
        prompt_text: str,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        gamma: int | None = None,
        **fields,
    ) -> str:
        if gamma is not None:
            fields["gamma"] = gamma
        return self.generate_raw(
            prompt=prompt_text, max_new_tokens=max_new_tokens, temperature=temperature, **fields
        )[1]

    def metrics_text(self, role: str) -> str:
        with urlopen(f"http://127.0.0.1:{self.metrics_ports[role]}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, role: str, name: str, labels: str = "") -> float:
        """Sum of a metric's samples whose label text contains ``labels``."""
        total, found = 0.0, False
        for line in self.metrics_text(role).splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if labels in line:
                    total += float(line.rsplit(" ", 1)[1])
                    found = True
        return total if found else 0.0

    def live_sessions(self, role: str) -> float:
        return self.metric(role, "specdec_model_live_sessions", f'role="{role}"')

    ROLES = ("draft", "target", "orchestrator")  # the order of ``procs``

    def proc(self, role: str) -> subprocess.Popen:
        return self.procs[self.ROLES.index(role)]

    def signal(self, role: str, sig: int) -> None:
        self.proc(role).send_signal(sig)

    def restart(self, role: str, timeout: float = 120.0) -> None:
        """Start ``role`` again (after it died) on its port; waits until healthy."""
        old = self.proc(role)
        old.wait(timeout)
        new = subprocess.Popen(
            [sys.executable, "-m", "specdec", "serve", role, "--config", str(self.config_path)],
            stdout=subprocess.DEVNULL,
            env=self.env,
        )
        self.procs[self.ROLES.index(role)] = new
        wait_healthy(self.address(role), timeout, [new])

    def stop(self) -> None:
        stop_local(self.procs)


def write_config(tmp: Path, draft: Path, target: Path, **overrides) -> tuple[Path, dict]:
    cfg = {
        "draft": {
            "model": str(draft),
            "port": free_port(),
            "metrics_port": free_port(),
            "torch_threads": 1,
        },
        "target": {
            "model": str(target),
            "port": free_port(),
            "metrics_port": free_port(),
            "torch_threads": 1,
        },
        "orchestrator": {"port": free_port(), "metrics_port": free_port()},
    }
    cfg["orchestrator"]["draft_address"] = f"127.0.0.1:{cfg['draft']['port']}"
    cfg["orchestrator"]["target_address"] = f"127.0.0.1:{cfg['target']['port']}"
    for dotted, value in overrides.items():
        section, key = dotted.split("__", 1) if "__" in dotted else dotted.split(".", 1)
        cfg[section][key] = value
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


@contextlib.contextmanager
def local_stack(
    tmp_path: Path,
    draft: Path | None = None,
    target: Path | None = None,
    env: dict[str, str] | None = None,
    **overrides,
) -> Iterator[Stack]:
    """Start a stack on tiny Llama models (or the given model dirs).

    Overrides are ``section__key=value`` keyword arguments,
    e.g. ``orchestrator__gamma=3``; ``env`` replaces the services' environment.
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    if draft is None or target is None:
        draft, target = build_pair(tmp_path / "models")
    path, cfg = write_config(tmp_path, draft, target, **overrides)
    stack = Stack(path, cfg, env=env)
    stack.procs = start_local(str(path), [], quiet=True, env=env)
    try:
        yield stack
    finally:
        stack.stop()


if __name__ == "__main__":  # manual smoke run
    import tempfile

    with tempfile.TemporaryDirectory() as d, local_stack(Path(d)) as s:
        print(s.generate("hello there", max_new_tokens=20, temperature=0.0))
        sys.exit(0)
