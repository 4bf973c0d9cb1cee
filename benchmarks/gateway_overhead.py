"""What the OpenAI-compatible HTTP gateway adds to a request: measured side by side.

The same requests go to the orchestrator over gRPC directly and through the
gateway over HTTP (whole JSON answers and server-sent events), interleaved, on
persistent connections on both paths, in two settings:

* **stub**: a scripted orchestrator (a separate process) that answers at once,
  streaming one chunk per token: what remains is the cost of the gateway itself
  (HTTP parsing, validation, one loopback gRPC hop, JSON/SSE shaping) plus the
  client's, with nothing to hide it;
* **stack**: draft, target and orchestrator on the demo pair (models/demo),
  greedy, one chunk per speculation step, as users see it.

Per request: gateway minus direct at 1 token. Per streamed token: the growth
from 1 to N tokens, gateway minus direct, divided by N - 1. Both are medians
(with quartiles) of differences paired request by request: the paths take turns,
so a slow spell of a shared machine shifts both sides of a pair alike.
Prints a table and writes ``results.json`` and ``results.md`` (with the load
average before and after) to ``--out`` (default ``results/gateway-<time>/``).

    .venv/bin/python -m benchmarks.gateway_overhead [--quick] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import yaml

from specdec.local.stack import (
    free_port,
    local_stack,
    start_gateway,
    stop_local,
    wait_healthy,
)
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .common import DEFAULT_DRAFT, DEFAULT_TARGET, PROMPTS, REPO, cpu_model, git_commit

MODEL = "bench"


# ---- the scripted orchestrator (run as its own process) -------------------------------
async def _serve_stub(port: int) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1._async import HealthServicer

    class Stub(orchestrator_pb2_grpc.OrchestratorServicer):
        async def Generate(self, request, context):
            for _ in range(request.max_new_tokens):
                yield orchestrator_pb2.GenerateResponse(
                    chunk=orchestrator_pb2.Chunk(text=" x", token_ids=[7])
                )
            yield orchestrator_pb2.GenerateResponse(
                stats=orchestrator_pb2.GenerationStats(
                    prompt_tokens=8,
                    generated_tokens=request.max_new_tokens,
                    steps=request.max_new_tokens,
                    finish_reason="length",
                )
            )

        async def Info(self, request, context):
            return orchestrator_pb2.OrchestratorInfo(target_model_id="stub")

    server = grpc.aio.server()
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(Stub(), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


# ---- the two clients --------------------------------------------------------------------
class GrpcClient:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    def run(self, prompt: str, tokens: int) -> tuple[float, float]:
        """(seconds to the first chunk with text, seconds to the end)."""
        request = orchestrator_pb2.GenerateRequest(
            text=prompt, max_new_tokens=tokens, temperature=0.0, seed=1
        )
        t0 = time.perf_counter()
        first = None
        for message in self.stub.Generate(request, timeout=300):
            if first is None and message.HasField("chunk") and message.chunk.text:
                first = time.perf_counter() - t0
        return first or 0.0, time.perf_counter() - t0

    def close(self) -> None:
        self.channel.close()


class HttpClient:
    """One keep-alive connection to the gateway, as a client library would hold."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)

    def run(self, prompt: str, tokens: int, stream: bool) -> tuple[float, float]:
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": tokens,
                "temperature": 0,
                "seed": 1,
                "stream": stream,
            }
        )
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = self.conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"gateway: {response.status} {response.read()[:300]!r}")
        if not stream:
            json.loads(response.read())
            t = time.perf_counter() - t0
            return t, t
        first = None
        while True:
            line = response.readline()
            if not line:
                raise RuntimeError("the stream ended without [DONE]")
            if first is None and line.startswith(b'data: {"id"'):
                first = time.perf_counter() - t0
            if line == b"data: [DONE]\n":
                response.readline()  # the blank line
                response.read()  # the end of the chunked body
                return first or 0.0, time.perf_counter() - t0

    def close(self) -> None:
        self.conn.close()


# ---- measuring --------------------------------------------------------------------------
PATHS = ("grpc", "http", "sse")


def measure(
    grpc_client: GrpcClient, http_client: HttpClient, tokens: list[int], repeats: int
) -> dict:
    """{path: {tokens: [(ttfb, total), ...]}}, the paths interleaved request by request."""
    out: dict = {p: {n: [] for n in tokens} for p in PATHS}
    for i in range(repeats):
        prompt = PROMPTS[i % len(PROMPTS)]
        order = PATHS[i % 3 :] + PATHS[: i % 3]  # rotate who goes first
        for n in tokens:
            for path in order:
                if path == "grpc":
                    out[path][n].append(grpc_client.run(prompt, n))
                else:
                    out[path][n].append(http_client.run(prompt, n, stream=path == "sse"))
    return out


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarise(samples: dict, tokens: list[int]) -> dict:
    """Medians of each path, and the gateway's added time as medians (with quartiles)
    of differences paired request by request, which a slow spell of the machine
    shifts on both sides alike."""
    lo, hi = min(tokens), max(tokens)

    def med(path: str, n: int, i: int) -> float:
        return statistics.median(s[i] for s in samples[path][n]) * 1e3

    result: dict = {
        "median_ms": {
            path: {
                "total_ms": {n: med(path, n, 1) for n in tokens},
                "first_ms": {n: med(path, n, 0) for n in tokens},
            }
            for path in PATHS
        }
    }
    direct_lo, direct_hi = samples["grpc"][lo], samples["grpc"][hi]
    for path in ("http", "sse"):
        gw_lo, gw_hi = samples[path][lo], samples[path][hi]
        per_request = [(g[1] - d[1]) * 1e3 for g, d in zip(gw_lo, direct_lo, strict=True)]
        per_token = [
            ((gh[1] - gl[1]) - (dh[1] - dl[1])) * 1e3 / (hi - lo)
            for gl, gh, dl, dh in zip(gw_lo, gw_hi, direct_lo, direct_hi, strict=True)
        ]
        first = [(g[0] - d[0]) * 1e3 for g, d in zip(gw_lo, direct_lo, strict=True)]
        for name, values in (
            ("added_per_request_ms", per_request),
            ("added_per_token_ms", per_token),
            ("added_first_text_ms", first),
        ):
            q1, q2, q3 = _quartiles(values)
            result[f"{path}_{name}"] = q2
            result[f"{path}_{name}_quartiles"] = [q1, q3]
    return result


def _start_gateway(out: Path, base: dict, orchestrator: str) -> tuple[subprocess.Popen, int]:
    cfg = dict(base)
    port = free_port()
    cfg["gateway"] = {
        "port": port,
        "metrics_port": free_port(),
        "orchestrator_address": orchestrator,
        "model_name": MODEL,
        "grace_period_s": 1,
    }
    path = out / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with open(out / "gateway.log", "ab") as log:
        return start_gateway(str(path), [], stdout=log), port


def run_setting(out: Path, base: dict, orchestrator: str, tokens: list[int], repeats: int) -> dict:
    gateway, port = _start_gateway(out, base, orchestrator)
    grpc_client, http_client = GrpcClient(orchestrator), HttpClient(port)
    try:
        measure(grpc_client, http_client, tokens, 3)  # warm-up: connections, caches
        samples = measure(grpc_client, http_client, tokens, repeats)
    finally:
        grpc_client.close()
        http_client.close()
        stop_local([gateway])
    return {"repeats": repeats, "tokens": tokens, **summarise(samples, tokens)}


def stub_setting(out: Path, tokens: list[int], repeats: int) -> dict:
    port = free_port()
    log = open(out / "stub.log", "ab")  # noqa: SIM115 - the child owns it
    stub = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.gateway_overhead", "--stub-server", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:
        wait_healthy(f"127.0.0.1:{port}", 60, [stub])
        base = {"draft": {"model": "unused"}, "target": {"model": "unused"}}
        return run_setting(out, base, f"127.0.0.1:{port}", tokens, repeats)
    finally:
        stop_local([stub])


def stack_setting(out: Path, args, tokens: list[int], repeats: int) -> dict:
    with local_stack(
        out / "stack",
        args.draft,
        args.target,
        log_dir=out / "logs",
        draft__torch_threads=args.threads,
        target__torch_threads=args.threads,
        # Generous: a benchmark must not fall back to plain decoding on a slow step.
        orchestrator__draft_timeout_s=10.0,
    ) as stack:
        return run_setting(out, stack.config, stack.orchestrator_address, tokens, repeats)


# ---- report -----------------------------------------------------------------------------
def markdown(results: dict) -> str:
    lines = [
        "| setting | path | total @1 token (ms) | total @N tokens (ms) | first text (ms) |"
        " added per request (ms) [quartiles] | added per streamed token (ms) [quartiles] |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in ("stub", "stack"):
        r = results.get(name)
        if not r:
            continue
        lo, hi = min(r["tokens"]), max(r["tokens"])
        for path, label in (
            ("grpc", "gRPC direct"),
            ("http", "gateway JSON"),
            ("sse", "gateway SSE"),
        ):
            m = r["median_ms"][path]
            added = ("", "")
            if path != "grpc":
                added = tuple(
                    f"{r[f'{path}_{key}']:+.{d}f} [{q[0]:+.{d}f}, {q[1]:+.{d}f}]"
                    for key, d in (("added_per_request_ms", 2), ("added_per_token_ms", 3))
                    for q in [r[f"{path}_{key}_quartiles"]]
                )
            lines.append(
                f"| {name} (N={hi}) | {label} | {m['total_ms'][lo]:.2f} | {m['total_ms'][hi]:.2f}"
                f" | {m['first_ms'][lo]:.2f} | {added[0]} | {added[1]} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stub-server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tokens", type=int, default=64, help="N: the long request's tokens")
    ap.add_argument("--stub-repeats", type=int, default=200)
    ap.add_argument("--stack-repeats", type=int, default=30)
    ap.add_argument("--skip-stack", action="store_true", help="only the scripted orchestrator")
    ap.add_argument("--quick", action="store_true", help="few repeats (a smoke run)")
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each model service")
    args = ap.parse_args(argv)
    if args.stub_server:
        asyncio.run(_serve_stub(args.stub_server))
        return 0
    if args.quick:
        args.stub_repeats, args.stack_repeats = 20, 3
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or REPO / "results" / f"gateway-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    tokens = [1, args.tokens]
    results: dict = {
        "machine": {
            "cpu_model": cpu_model(),
            "cpu_cores": os.cpu_count(),
            "load_average_start": list(os.getloadavg()),
            "git_commit": git_commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
    }
    print(f"load average at start: {os.getloadavg()}", flush=True)
    # SIGTERM (a timeout) unwinds like Ctrl-C, so that the services are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    settings = [("stub", lambda: stub_setting(out, tokens, args.stub_repeats))]
    if not args.skip_stack:
        settings.append(("stack", lambda: stack_setting(out, args, tokens, args.stack_repeats)))
    for name, run in settings:
        results[name] = run()
        results["machine"]["load_average_end"] = list(os.getloadavg())
        write_results(out, results)  # after each setting: a partial run keeps what it measured
        print(f"{name}: done, load average {os.getloadavg()}", flush=True)
    print(markdown(results))
    print(f"wrote {out}")
    return 0


def write_results(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    machine = results["machine"]
    (out / "results.md").write_text(
        markdown(results) + f"\nload average (1, 5, 15 min): start "
        f"{[round(x, 2) for x in machine['load_average_start']]}, end "
        f"{[round(x, 2) for x in machine['load_average_end']]}; {machine['cpu_cores']} cores, "
        f"{machine['cpu_model']}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
