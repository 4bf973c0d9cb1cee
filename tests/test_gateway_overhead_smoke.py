"""Smoke test of benchmarks/gateway_overhead.py (not a timed test: no speed is asserted).

``--quick`` on the tiny pair must measure all three paths in both settings and
write results.json and results.md with the load average.
"""

from __future__ import annotations

import json

from .benchrun import run_benchmark


def test_quick_run_writes_results(tmp_path, llama_pair):
    draft, target = llama_pair
    out = tmp_path / "results"
    run_benchmark(
        "benchmarks.gateway_overhead", "--quick", "--tokens", "6", "--draft", str(draft),
        "--target", str(target), "--threads", "1", "--out", str(out),
    )  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    for setting in ("stub", "stack"):
        r = results[setting]
        assert r["tokens"] == [1, 6]
        for path in ("grpc", "http", "sse"):
            for n in ("1", "6"):
                assert r["median_ms"][path]["total_ms"][n] > 0, (setting, path, n)
        for key in ("added_per_request_ms", "added_per_token_ms"):
            assert isinstance(r[f"sse_{key}"], float) and isinstance(r[f"http_{key}"], float)
    assert len(results["machine"]["load_average_end"]) == 3
    md = (out / "results.md").read_text()
    assert "gateway SSE" in md and "load average" in md
