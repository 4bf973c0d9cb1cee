"""Prometheus metrics of all four services, declared in one place.

Each process exposes only its own role's metrics: the orchestrator's, or
the model services' (plus the RPC and build-info metrics every server has),
through ``ORCHESTRATOR_REGISTRY`` / ``MODEL_REGISTRY``; the HTTP gateway its
own and build info through ``GATEWAY_REGISTRY``.

Names follow Prometheus conventions: one ``specdec_`` prefix, base units,
``_total`` on counters, histograms rather than summaries, and only bounded
labels (role, stage, position up to the largest gamma, status code, ...),
never a session id. Model-service metrics carry ``role`` ("draft" or
"target") so that both services can share one process in tests.
Not for: computing anything; services call ``.observe``/``.inc`` on these.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

# Latency buckets from 0.5 ms to 60 s: a CPU decode step is ~5 ms, a request seconds.
_FAST = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05)
_SLOW = (0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = _FAST + _SLOW
# Positions beyond this share the last label value, which keeps the label bounded.
MAX_POSITION_LABEL = 16

# ---- orchestrator -----------------------------------------------------------
REQUEST_DURATION = Histogram(
    "specdec_request_duration_seconds",
    "End-to-end Generate duration.",
    buckets=LATENCY_BUCKETS,
    registry=None,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "specdec_time_to_first_token_seconds",
    "Time from request to the first streamed token.",
    buckets=LATENCY_BUCKETS,
    registry=None,
)
INTER_TOKEN_LATENCY = Histogram(
    "specdec_inter_token_latency_seconds",
    "Mean time between generated tokens within one step's chunk.",
    buckets=LATENCY_BUCKETS,
    registry=None,
)
PROMPT_TOKENS = Counter("specdec_prompt_tokens_total", "Prompt tokens received.", registry=None)
GENERATED_TOKENS = Counter(
    "specdec_generated_tokens_total", "Tokens generated and streamed.", registry=None
)
STEPS = Counter(
    "specdec_speculation_steps_total", "Speculation steps (one verify pass each).", registry=None
)
DRAFTED_TOKENS = Counter(
    "specdec_drafted_tokens_total", "Tokens proposed by the draft.", registry=None
)
ACCEPTED_TOKENS = Counter(
    "specdec_accepted_tokens_total", "Drafted tokens the target accepted.", registry=None
)
DRAFTED_BY_POSITION = Counter(
    "specdec_drafted_tokens_by_position_total",
    "Drafted tokens by position in the draft (1-based).",
    ["position"],
    registry=None,
)
ACCEPTED_BY_POSITION = Counter(
    "specdec_accepted_tokens_by_position_total",
    "Accepted drafted tokens by position in the draft (1-based).",
    ["position"],
    registry=None,
)
STEP_ACCEPTED = Histogram(
    "specdec_step_accepted_tokens",
    "Drafted tokens accepted in one step (n in the paper).",
    buckets=tuple(range(0, MAX_POSITION_LABEL + 1)),
    registry=None,
)
STEP_GAMMA = Histogram(
    "specdec_step_gamma",
    "gamma used in one speculation step.",
    buckets=tuple(range(0, MAX_POSITION_LABEL + 1)),
    registry=None,
)
STAGE_DURATION = Histogram(
    "specdec_step_stage_duration_seconds",
    "Duration of each stage of a step: propose, verify, rollback, orchestrator.",
    ["stage"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
WIRE_BYTES = Counter(
    "specdec_wire_bytes_total",
    "Serialized message bytes exchanged with each model service.",
    ["peer", "direction"],
    registry=None,
)
ROUND_TRIPS = Counter(
    "specdec_round_trips_total",
    "Sequential RPC round trips to each model service.",
    ["peer"],
    registry=None,
)
REQUESTS = Counter(
    "specdec_requests_total", "Generate requests by final gRPC status.", ["code"], registry=None
)
LIVE_REQUESTS = Gauge("specdec_live_requests", "Generate requests in progress.", registry=None)
QUEUED_REQUESTS = Gauge(
    "specdec_queued_requests", "Generate requests waiting for a slot.", registry=None
)
FALLBACK_STEPS = Counter(
    "specdec_fallback_steps_total",
    "Steps decoded by the target alone because speculation was unavailable, by reason.",
    ["reason"],
    registry=None,
)
FALLBACK_REQUESTS = Counter(
    "specdec_fallback_requests_total",
    "Requests that had at least one step without speculation, by reason.",
    ["reason"],
    registry=None,
)
CHOSEN_GAMMA = Histogram(
    "specdec_adaptive_gamma",
    "gamma the adaptive policy chose for a step (requests that leave gamma unset).",
    buckets=tuple(range(0, MAX_POSITION_LABEL + 1)),
    registry=None,
)
ESTIMATE = Gauge(
    "specdec_adaptive_estimate",
    "The cost model's current estimates: alpha, draft seconds per token, verify seconds "
    "(plain and per verified position), round-trip seconds to each service, the share "
    "of blocks drafted on from an echo and their lead.",
    ["quantity"],
    registry=None,
)
MEASURED_RATE = Gauge(
    "specdec_adaptive_measured_rate",
    "Tokens per second of an adaptive request as measured (exponentially weighted over "
    "epochs), under the cost model's choices (arm=model) and under plain decoding (arm=plain).",
    ["arm"],
    registry=None,
)
ARM_EPOCHS = Counter(
    "specdec_adaptive_epochs_total",
    "Epochs in which adaptive requests followed the cost model (arm=model) or decoded "
    "plain (arm=plain): the measured check that speculation beats plain decoding.",
    ["arm"],
    registry=None,
)
for _arm in ("model", "plain"):  # both series exist from the start
    MEASURED_RATE.labels(_arm)
    ARM_EPOCHS.labels(_arm)
OVERLAPPED_STEPS = Counter(
    "specdec_overlapped_steps_total",
    "Steps whose next draft was drafted during the verify: used (every draft accepted) "
    "or discarded (a rejection, or the ahead draft failed).",
    ["outcome"],
    registry=None,
)
PIPELINE_RETUNES = Counter(
    "specdec_pipeline_retunes_total",
    "Adaptive requests' changes of gamma sent to the draft pacing their steps "
    "(orchestrator.paced and orchestrator.pipeline; DraftRequest.retune).",
    registry=None,
)
RELAYED_STEPS = Counter(
    "specdec_relayed_steps_total",
    "Sequential steps whose proposal the draft was asked to send straight to the target: "
    "relayed (the draft sent it), not_relayed (the proposal came back instead), or "
    "lost (no verdict: the target failed, or none within relay_timeout_s; the step "
    "decoded plain).",
    ["outcome"],
    registry=None,
)
PIT_CHI2 = Gauge(
    "specdec_exactness_pit_chi2",
    "Live exactness monitor: chi-square (15 df) of the randomized PIT values of sampled "
    "emitted tokens in the window against the uniform; above 70 the output is biased.",
    registry=None,
)
PIT_WINDOW = Gauge(
    "specdec_exactness_pit_window",
    "Live exactness monitor: PIT values currently in the window.",
    registry=None,
)
PIT_TOKENS = Counter(
    "specdec_exactness_pit_tokens_total",
    "Live exactness monitor: emitted tokens whose PIT value was checked.",
    registry=None,
)
TARGET_FAILOVERS = Counter(
    "specdec_target_failovers_total",
    "Requests moved to another target replica of the same model (re-prefilled from their "
    "history) because theirs became unreachable.",
    registry=None,
)
SPECULATION_ENABLED = Gauge(
    "specdec_speculation_enabled",
    "1 while the draft is in use, 0 while the breaker is open.",
    registry=None,
)

# ---- draft and target services --------------------------------------------------
FORWARD_DURATION = Histogram(
    "specdec_model_forward_duration_seconds",
    "Model forward pass duration by kind: prefill, propose (one draft step), verify, decode.",
    ["role", "kind"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
TOKENS_PROCESSED = Counter(
    "specdec_model_tokens_processed_total",
    "Tokens fed through the model.",
    ["role", "kind"],
    registry=None,
)
WIDE_PASSES = Counter(
    "specdec_model_wide_passes_total",
    "Forward passes run on plain_torch_threads torch threads (no draft worked meanwhile).",
    ["role", "kind"],
    registry=None,
)
LIVE_SESSIONS = Gauge(
    "specdec_model_live_sessions", "Sessions holding a KV cache.", ["role"], registry=None
)
CACHED_TOKENS = Gauge(
    "specdec_model_cached_tokens", "Tokens held in all KV caches.", ["role"], registry=None
)
ROLLBACKS = Counter("specdec_model_rollbacks_total", "Cache truncations.", ["role"], registry=None)
ROLLED_BACK_TOKENS = Counter(
    "specdec_model_rolled_back_tokens_total",
    "Tokens removed by cache truncations.",
    ["role"],
    registry=None,
)
BATCH_SESSIONS = Histogram(
    "specdec_model_batch_sessions",
    "Sessions sharing one forward pass.",
    ["role"],
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256),
    registry=None,
)
BATCH_TOKENS = Histogram(
    "specdec_model_batch_tokens",
    "Tokens fed through one forward pass, all sessions together.",
    ["role"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    registry=None,
)
QUEUE_WAIT = Histogram(
    "specdec_model_queue_wait_seconds",
    "Time a piece of work waited for its first forward pass.",
    ["role"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
SESSION_EVICTIONS = Counter(
    "specdec_model_session_evictions_total",
    "Sessions freed without a close: ttl (idle too long).",
    ["role", "reason"],
    registry=None,
)
PIPELINE_BLOCKS = Counter(
    "specdec_model_pipeline_blocks_total",
    "Blocks a draft service relayed while pacing a pipeline (draft_service.pipeline): "
    "first (the propose that started it), follower (drafted ahead of the block being "
    "verified, run only if that one is accepted in full), guess (greedy: drafted for a "
    "rejection of it, run only if that rejection draws the guessed token) or fresh "
    "(drafted after a rejection).",
    ["kind"],
    registry=None,
)
DRAFTED_ON = Counter(
    "specdec_model_drafted_on_total",
    "Drafts started on a verdict the target echoed, before their propose came: used "
    "(the propose asked for them), discarded (it asked for something else, or the "
    "session ended first), or skipped (none started: a newer propose had come already, "
    "the next step would not fit the draft's cache or context, or a step drafting ahead "
    "accepted every draft, so its block drafted ahead may take the next step, or a guess "
    "already holds the next block: specdec_model_draft_guesses_total).",
    ["outcome"],
    registry=None,
)
DRAFT_GUESSES = Counter(
    "specdec_model_draft_guesses_total",
    "Blocks the draft drafted for a rejection before its verdict (steps that draft "
    "ahead; draft.guesses), from its guess of the target's token at a drafted position "
    "(greedy: its second choice; sampled: a draw the target's residual draw is coupled "
    "to): used (the next propose asked for one) or unused.",
    ["outcome"],
    registry=None,
)
RESIDUAL_GUESSES = Counter(
    "specdec_model_residual_guesses_total",
    "Sampled residual draws coupled to the draft's guess (draft.sampled_guesses), at "
    "every guessed position whether or not its draft is accepted: kept (the target's "
    "token there is the guess) or redrawn (drawn from norm(max(0, r - g))).",
    ["outcome"],
    registry=None,
)
LOOKAHEAD_TOKENS = Counter(
    "specdec_model_lookahead_tokens_total",
    "Greedy pipelined sessions (target.lookahead_tokens): tokens the target decoded on "
    "its own while it waited for the next block (decoded), and of those, the ones whose "
    "p a verify then used instead of a forward position (used).",
    ["outcome"],
    registry=None,
)
RELAY_REFUSALS = Counter(
    "specdec_model_relay_refusals_total",
    "Proposals this draft relayed that the target refused (no such session there, or "
    "the orchestrator had cancelled them).",
    registry=None,
)

# ---- HTTP gateway ----------------------------------------------------------------
# endpoint is the route ("/v1/completions", ..., "other" for unknown paths) and
# status the HTTP status code: both bounded.
GATEWAY_REQUESTS = Counter(
    "specdec_gateway_requests_total",
    "HTTP requests by endpoint and status code.",
    ["endpoint", "status"],
    registry=None,
)
GATEWAY_REQUEST_DURATION = Histogram(
    "specdec_gateway_request_duration_seconds",
    "HTTP request duration by endpoint, until the last byte of the response.",
    ["endpoint"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
GATEWAY_TIME_TO_FIRST_BYTE = Histogram(
    "specdec_gateway_time_to_first_byte_seconds",
    "Streamed requests: from the request to the first event with generated text.",
    ["endpoint"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
GATEWAY_LIVE_REQUESTS = Gauge(
    "specdec_gateway_live_requests", "HTTP requests in progress.", registry=None
)

# ---- every server (one interceptor) ------------------------------------------------
RPC_DURATION = Histogram(
    "specdec_rpc_duration_seconds",
    "Server-side RPC duration by service and method.",
    ["service", "method"],
    buckets=LATENCY_BUCKETS,
    registry=None,
)
RPC_HANDLED = Counter(
    "specdec_rpc_handled_total",
    "RPCs completed by service, method and gRPC status code.",
    ["service", "method", "code"],
    registry=None,
)

BUILD_INFO = Info(
    "specdec_build",
    "Service role, model id, dtype, device and specdec version.",
    ["role"],
    registry=None,
)


_ORCHESTRATOR_METRICS = (
    REQUEST_DURATION,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    PROMPT_TOKENS,
    GENERATED_TOKENS,
    STEPS,
    DRAFTED_TOKENS,
    ACCEPTED_TOKENS,
    DRAFTED_BY_POSITION,
    ACCEPTED_BY_POSITION,
    STEP_ACCEPTED,
    STEP_GAMMA,
    STAGE_DURATION,
    WIRE_BYTES,
    ROUND_TRIPS,
    REQUESTS,
    LIVE_REQUESTS,
    QUEUED_REQUESTS,
    FALLBACK_STEPS,
    FALLBACK_REQUESTS,
    SPECULATION_ENABLED,
    CHOSEN_GAMMA,
    ESTIMATE,
    MEASURED_RATE,
    ARM_EPOCHS,
    OVERLAPPED_STEPS,
    RELAYED_STEPS,
    PIPELINE_RETUNES,
    PIT_CHI2,
    PIT_WINDOW,
    PIT_TOKENS,
    TARGET_FAILOVERS,
)
_MODEL_METRICS = (
    FORWARD_DURATION,
    TOKENS_PROCESSED,
    WIDE_PASSES,
    LIVE_SESSIONS,
    CACHED_TOKENS,
    ROLLBACKS,
    ROLLED_BACK_TOKENS,
    SESSION_EVICTIONS,
    RELAY_REFUSALS,
    DRAFTED_ON,
    PIPELINE_BLOCKS,
    DRAFT_GUESSES,
    RESIDUAL_GUESSES,
    LOOKAHEAD_TOKENS,
    BATCH_SESSIONS,
    BATCH_TOKENS,
    QUEUE_WAIT,
)
_SERVER_METRICS = (RPC_DURATION, RPC_HANDLED, BUILD_INFO)
_GATEWAY_METRICS = (
    GATEWAY_REQUESTS,
    GATEWAY_REQUEST_DURATION,
    GATEWAY_TIME_TO_FIRST_BYTE,
    GATEWAY_LIVE_REQUESTS,
    BUILD_INFO,
)


def _registry(collectors) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    for collector in collectors:
        registry.register(collector)
    return registry


ORCHESTRATOR_REGISTRY = _registry(_ORCHESTRATOR_METRICS + _SERVER_METRICS)
MODEL_REGISTRY = _registry(_MODEL_METRICS + _SERVER_METRICS)
GATEWAY_REGISTRY = _registry(_GATEWAY_METRICS)
# An orchestrator with the models in its process (orchestrator.local_models).
ONE_PROCESS_REGISTRY = _registry(_ORCHESTRATOR_METRICS + _MODEL_METRICS + _SERVER_METRICS)


def registry_for(role: str, local_models: bool = False) -> CollectorRegistry:
    """The metrics a process of this role exposes (``local_models``: an orchestrator
    that runs the draft and the target itself exposes theirs too)."""
    if role == "gateway":
        return GATEWAY_REGISTRY
    if role == "orchestrator":
        return ONE_PROCESS_REGISTRY if local_models else ORCHESTRATOR_REGISTRY
    return MODEL_REGISTRY


_CHILDREN: dict[tuple, Any] = {}


def labelled(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, looked up once per process.

    prometheus_client validates the values and takes a lock on every ``labels``
    call (about 2 us, several times that on cold caches right after a forward
    pass); the hot path calls this instead, once or more per step. Every label
    value here comes from a bounded set, and no series is ever removed.
    """
    key = (metric, values)
    child = _CHILDREN.get(key)
    if child is None:
        child = _CHILDREN[key] = metric.labels(*values)
    return child


def position_label(position: int) -> str:
    """Draft position (1-based) as a bounded label value."""
    return str(min(position, MAX_POSITION_LABEL))


def serve_metrics(role: str, port: int, host: str = "0.0.0.0", local_models: bool = False) -> int:
    """Expose this role's /metrics over HTTP on ``port`` (0 disables). Returns the port."""
    if port:
        start_http_server(port, addr=host, registry=registry_for(role, local_models))
    return port
