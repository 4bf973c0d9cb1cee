"""Session-aware routing across replicas: sessions are pinned to one target
replica, placed on the least-loaded one, and move to another replica (by
re-prefilling) when theirs disappears, with identical output."""

from __future__ import annotations

import signal
import subprocess
import time

import yaml

from orchestrator.replicas import resolve
from specdec.local.stack import spawn, stop_local, wait_healthy

from .stack import Stack, free_port, write_config
from .test_faults import greedy, run_to_end


def test_resolve_forms():
    assert resolve("10.0.0.1:5,10.0.0.2:5") == ["10.0.0.1:5", "10.0.0.2:5"]
    assert resolve("svc:50052") == ["svc:50052"]
    assert "127.0.0.1:50052" in resolve("dns:///localhost:50052")
    assert resolve("dns:///no-such-host.invalid:1") == []


def _serve(role: str, config: str, *sets: str) -> subprocess.Popen:
    return spawn(role, config, list(sets), subprocess.DEVNULL)


def test_sessions_spread_over_replicas_and_survive_losing_one(tmp_path, llama_pair):
    path, cfg = write_config(tmp_path, *llama_pair)
    port2, metrics2 = free_port(), free_port()
    cfg["orchestrator"]["target_address"] = f"127.0.0.1:{cfg['target']['port']},127.0.0.1:{port2}"
    cfg["orchestrator"]["resolve_interval_s"] = 0.5
    path.write_text(yaml.safe_dump(cfg))
    procs = [
        _serve("draft", str(path)),
        _serve("target", str(path)),
        _serve("target", str(path), f"target.port={port2}", f"target.metrics_port={metrics2}"),
    ]
    try:
        for port in (cfg["draft"]["port"], cfg["target"]["port"], port2):
            wait_healthy(f"127.0.0.1:{port}", 120, procs)
        procs.append(_serve("orchestrator", str(path)))
        wait_healthy(f"127.0.0.1:{cfg['orchestrator']['port']}", 120, procs)
        stack = Stack(path, cfg, procs)
        second = Stack(path, {**cfg, "target": {**cfg["target"], "metrics_port": metrics2}})

        reference = run_to_end(greedy(stack, n=200)).ids
        runs = [greedy(stack, n=200) for _ in range(4)]
        for r in runs:
            r.start()
        for r in runs:
            assert r.first_chunk.wait(60)
        # Least-loaded placement: both replicas hold sessions.
        assert stack.live_sessions("target") >= 1
        assert second.live_sessions("target") >= 1

        procs[1].send_signal(signal.SIGKILL)  # lose the first replica for good
        for r in runs:
            r.join(120)
            assert r.error is None, r.error
            assert r.ids == reference  # moved to the other replica, re-prefilled
        # New requests go to the survivor.
        assert run_to_end(greedy(stack, n=20)).ids == reference[:20]
        deadline = time.monotonic() + 10
        while second.live_sessions("target") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert second.live_sessions("target") == 0
    finally:
        stop_local(procs)
