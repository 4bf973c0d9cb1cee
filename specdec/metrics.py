"""Prometheus metrics of all three services, declared in one place.

Names follow Prometheus conventions: one ``specdec_`` prefix, base units,
``_total`` on counters, histograms rather than summaries, and only bounded
labels (role, stage, position up to the largest gamma, status code, ...),
never a session id. Model-service metrics carry ``role`` ("draft" or
"target") so that both services can share one process in tests.
Not for: computing anything; services call ``.observe``/``.inc`` on these.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, Info, start_http_server

# Latency buckets from 0.5 ms to 60 s: a CPU decode step is ~5 ms, a request seconds.
_FAST = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05)
_SLOW = (0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = _FAST + _SLOW
# Positions beyond this share the last label value, which keeps the label bounded.
MAX_POSITION_LABEL = 16

# ---- orchestrator -----------------------------------------------------------
REQUEST_DURATION = Histogram(
    "specdec_request_duration_seconds", "End-to-end Generate duration.", buckets=LATENCY_BUCKETS
)
TIME_TO_FIRST_TOKEN = Histogram(
    "specdec_time_to_first_token_seconds",
    "Time from request to the first streamed token.",
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "specdec_inter_token_latency_seconds",
    "Mean time between generated tokens within one step's chunk.",
    buckets=LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter("specdec_prompt_tokens_total", "Prompt tokens received.")
GENERATED_TOKENS = Counter("specdec_generated_tokens_total", "Tokens generated and streamed.")
STEPS = Counter("specdec_speculation_steps_total", "Speculation steps (one verify pass each).")
DRAFTED_TOKENS = Counter("specdec_drafted_tokens_total", "Tokens proposed by the draft.")
ACCEPTED_TOKENS = Counter("specdec_accepted_tokens_total", "Drafted tokens the target accepted.")
DRAFTED_BY_POSITION = Counter(
    "specdec_drafted_tokens_by_position_total",
    "Drafted tokens by position in the draft (1-based).",
    ["position"],
)
ACCEPTED_BY_POSITION = Counter(
    "specdec_accepted_tokens_by_position_total",
    "Accepted drafted tokens by position in the draft (1-based).",
    ["position"],
)
STEP_ACCEPTED = Histogram(
    "specdec_step_accepted_tokens",
    "Drafted tokens accepted in one step (n in the paper).",
    buckets=tuple(range(0, MAX_POSITION_LABEL + 1)),
)
STEP_GAMMA = Histogram(
    "specdec_step_gamma",
    "gamma used in one speculation step.",
    buckets=tuple(range(0, MAX_POSITION_LABEL + 1)),
)
STAGE_DURATION = Histogram(
    "specdec_step_stage_duration_seconds",
    "Duration of each stage of a step: propose, verify, rollback, orchestrator.",
    ["stage"],
    buckets=LATENCY_BUCKETS,
)
WIRE_BYTES = Counter(
    "specdec_wire_bytes_total",
    "Serialized message bytes exchanged with each model service.",
    ["peer", "direction"],
)
ROUND_TRIPS = Counter(
    "specdec_round_trips_total", "Sequential RPC round trips to each model service.", ["peer"]
)
REQUESTS = Counter("specdec_requests_total", "Generate requests by final gRPC status.", ["code"])
LIVE_REQUESTS = Gauge("specdec_live_requests", "Generate requests in progress.")
QUEUED_REQUESTS = Gauge("specdec_queued_requests", "Generate requests waiting for a slot.")
FALLBACK_STEPS = Counter(
    "specdec_fallback_steps_total",
    "Steps decoded by the target alone because speculation was unavailable, by reason.",
    ["reason"],
)
FALLBACK_REQUESTS = Counter(
    "specdec_fallback_requests_total",
    "Requests that had at least one step without speculation, by reason.",
    ["reason"],
)
SPECULATION_ENABLED = Gauge(
    "specdec_speculation_enabled", "1 while the draft is in use, 0 while the breaker is open."
)

# ---- draft and target services --------------------------------------------------
FORWARD_DURATION = Histogram(
    "specdec_model_forward_duration_seconds",
    "Model forward pass duration by kind: prefill, propose (one draft step), verify, decode.",
    ["role", "kind"],
    buckets=LATENCY_BUCKETS,
)
TOKENS_PROCESSED = Counter(
    "specdec_model_tokens_processed_total", "Tokens fed through the model.", ["role", "kind"]
)
LIVE_SESSIONS = Gauge("specdec_model_live_sessions", "Sessions holding a KV cache.", ["role"])
CACHED_TOKENS = Gauge("specdec_model_cached_tokens", "Tokens held in all KV caches.", ["role"])
ROLLBACKS = Counter("specdec_model_rollbacks_total", "Cache truncations.", ["role"])
ROLLED_BACK_TOKENS = Counter(
    "specdec_model_rolled_back_tokens_total", "Tokens removed by cache truncations.", ["role"]
)
SESSION_EVICTIONS = Counter(
    "specdec_model_session_evictions_total",
    "Sessions freed without a close: ttl (idle too long).",
    ["role", "reason"],
)

# ---- every server (one interceptor) ------------------------------------------------
RPC_DURATION = Histogram(
    "specdec_rpc_duration_seconds",
    "Server-side RPC duration by service and method.",
    ["service", "method"],
    buckets=LATENCY_BUCKETS,
)
RPC_HANDLED = Counter(
    "specdec_rpc_handled_total",
    "RPCs completed by service, method and gRPC status code.",
    ["service", "method", "code"],
)

BUILD_INFO = Info(
    "specdec_build", "Service role, model id, dtype, device and specdec version.", ["role"]
)


def position_label(position: int) -> str:
    """Draft position (1-based) as a bounded label value."""
    return str(min(position, MAX_POSITION_LABEL))


def serve_metrics(port: int, host: str = "0.0.0.0") -> int:
    """Expose /metrics over HTTP on ``port`` (0 disables). Returns the port."""
    if port:
        start_http_server(port, addr=host)
    return port
