"""Smoke test of the benchmark harness (not a timed test: no speed is asserted).

``python -m benchmarks.run --quick`` on the tiny random pair must write
results.json with the expected sections, results.md with its tables, and the
PNG plots; the delay proxy must forward bytes unchanged and add its delay.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from specdec.local.proxy import ProxyGroup

REPO = Path(__file__).resolve().parent.parent
PLOTS = (
    "tokens_per_s_vs_gamma.png",
    "speedup_vs_gamma.png",
    "tokens_per_step_vs_gamma.png",
    "stage_breakdown.png",
    "speedup_vs_rtt.png",
    "throughput_vs_concurrency.png",
    "wire_bytes_per_token.png",
)


def test_quick_run_writes_results(tmp_path, llama_pair):
    draft, target = llama_pair
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--quick",
            "--draft",
            str(draft),
            "--target",
            str(target),
            "--out",
            str(out),
            "--max-new-tokens",
            "6",
            "--threads",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "best gamma" in proc.stdout

    results = json.loads((out / "results.json").read_text())
    for key in (
        "machine",
        "settings",
        "models",
        "analysis",
        "hf",
        "services",
        "best_gamma",
        "wire",
        "rtt",
        "concurrency",
        "plots",
    ):
        assert key in results, key
    for key in ("cpu_model", "cpu_cores", "torch", "transformers", "grpc", "device", "date"):
        assert key in results["machine"], key
    assert results["models"]["target"]["parameters"] > results["models"]["draft"]["parameters"]

    an = results["analysis"]
    assert 0.0 <= an["quality"]["alpha"] <= 1.0
    assert 0.0 <= an["quality"]["greedy_agreement"] <= 1.0
    assert an["cost"]["c"] > 0
    assert [r["gamma"] for r in an["predicted"]] == list(range(1, 9))
    assert 1 <= an["recommended_gamma"] <= 8

    gammas = results["settings"]["gammas"]
    for t in ("0", "1"):
        for g in [0, *gammas]:
            row = results["services"][f"{g}@{t}"]
            assert row["tok_s"] > 0
            assert row["fallback_steps"] == 0
            steps = row["breakdown"]["ms_per_step"]
            assert steps["target_forward"] > 0
            assert (steps["draft_forward"] > 0) == (g > 0)
            if g:
                assert row["theoretical_speedup"] > 0
        for mode in ("hf_plain", "hf_assisted"):
            assert results["hf"]["results"][f"{mode}@{t}"]["tok_s"] > 0
        assert results["best_gamma"][t] in gammas
    for point in results["rtt"]["points"].values():
        assert point["T1"]["speedup"] > 0
    for point in results["concurrency"]["points"].values():
        assert point["plain"]["tok_s"] > 0 and point["spec"]["tok_s"] > 0
    # Dense distributions cost more bytes than the sparse default once there is a draft.
    g = max(gammas)
    assert (
        results["wire"][f"{g}@1@dense"]["wire_bytes_per_token"]
        > results["wire"][f"{g}@1@sparse"]["wire_bytes_per_token"]
    )

    md = (out / "results.md").read_text()
    for heading in (
        "## Throughput",
        "## Where a step's time goes",
        "## Added network",
        "## Concurrent clients",
        "## Wire bytes",
    ):
        assert heading in md, heading
    assert results["plots"] == list(PLOTS)
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        assert name in md


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_delay_proxy_forwards_and_delays():
    srv, port = _echo_server()
    proxies = ProxyGroup()
    try:
        host, pport = proxies.add(f"127.0.0.1:{port}").rsplit(":", 1)
        payload = bytes(range(256)) * 1000
        for rtt_ms in (0.0, 40.0):
            proxies.set_rtt_ms(rtt_ms)
            with socket.create_connection((host, int(pport))) as c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t0 = time.perf_counter()
                c.sendall(b"x")
                assert c.recv(1) == b"x"
                elapsed = time.perf_counter() - t0
                if rtt_ms:
                    assert elapsed >= rtt_ms / 1000 * 0.95
                c.sendall(payload)
                got = b""
                while len(got) < len(payload):
                    got += c.recv(65536)
                assert got == payload
    finally:
        proxies.close()
        srv.close()
