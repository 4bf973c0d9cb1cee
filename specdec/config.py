"""Deployment configuration: one YAML file, validated at start-up.

Every value can be overridden by an environment variable
(``SPECDEC_<SECTION>_<KEY>``, e.g. ``SPECDEC_TARGET_DEVICE=cuda``) or by a
command-line ``--set section.key=value``; flags win over the environment, the
environment over the file, the file over the defaults below. Errors name the
offending key. Not for: parsing command lines (see ``specdec.cli``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# Most tokens one call to a model service may carry: drafted in one Propose,
# checked in one Verify, or drawn in one plain run (the services enforce it).
MAX_GAMMA = 64

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_PATH = REPO_ROOT / "configs" / "default.yaml"
DEVICES = ("cpu", "cuda")


def device_kind(device: str) -> str:
    """The kind of a device setting (``cuda:1`` is ``cuda``), as DEVICES names them."""
    return device.split(":")[0]


DTYPES = ("float32", "float16", "bfloat16", "float64")
CHAT_TEMPLATES = ("model", "plain-text")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; names the key."""


@dataclass
class TlsConfig:
    """TLS for one hop. Empty paths mean plaintext."""

    # PEM files. For a server: its certificate and key; client_ca makes it
    # demand client certificates (mutual TLS). For a client: ca verifies the
    # server, cert/key are presented for mutual TLS.
    cert: str = ""
    key: str = ""
    ca: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)


@dataclass
class ModelServiceConfig:
    """A draft or target service: one model, one KV cache per session."""

    # Local directory (or a hub id where the network allows) of a Hugging Face causal LM.
    model: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 0
    # Prometheus /metrics port; 0 turns the endpoint off.
    metrics_port: int = 0
    max_sessions: int = 256
    # Seconds a session may stay unused before it is freed.
    session_ttl_s: float = 600.0
    # Most tokens one session may hold (prompt + generated + drafted).
    max_context: int = 2048
    # Never run code shipped with a model unless explicitly allowed.
    trust_remote_code: bool = False
    # Draft only: grow the model's vocabulary to this many tokens at load (0: its
    # own). For a draft whose embedding table is smaller than the target's, as checkpoints of one
    # family padded differently are (Qwen2.5 0.5B: 151,936 tokens, 7B: 152,064): set
    # it to the target's vocab_size. The new tokens get rows of zeros in the input
    # embedding and the output layer (specdec/runtime/loading.py, pad_vocab).
    pad_vocab: int = 0
    # Seconds in-flight work may take to finish after SIGTERM.
    grace_period_s: float = 10.0
    # Threads torch may use on the CPU; 0 keeps torch's default.
    torch_threads: int = 0
    # Target only, CPU: threads for a pass during which no draft works: plain decoding
    # steps alone (the target's runs of plain tokens), or verifies whose orchestrator
    # says its draft is idle (Verify.draft_idle: a lone request's step drafting nothing
    # ahead). Where the draft shares this machine's cores, the target may use its core
    # too; every other pass keeps torch_threads. 0: torch_threads always
    # (specdec/runtime/forward_loop.py).
    plain_torch_threads: int = 0
    # Most tokens one forward pass takes across all sessions (continuous
    # batching); longer prefills are cut into chunks of the budget that is left.
    max_batch_tokens: int = 512
    # Milliseconds the forward loop may wait for the sessions of its last pass to
    # come back before it runs the ones already waiting, so that concurrent
    # sessions share passes instead of alternating (0: never wait; a lone session
    # never waits). About one step's round trip.
    batch_wait_ms: float = 2.0
    # The same for a session whose last job was a plain decoding step (the target's
    # runs of plain tokens): it comes back after one round trip to the orchestrator
    # and nothing else, which under load takes longer than batch_wait_ms.
    decode_batch_wait_ms: float = 8.0
    # CPU only: multiply passes of many tokens (batches, verifies, prefills) with
    # oneDNN's linear where that is faster than torch's stock one, from the pass size
    # measured at start-up (packed_linear_min_rows 0) or from the size given. Costs
    # one more copy of the linear weights (specdec/runtime/packed_linear.py).
    packed_linear: bool = True
    packed_linear_min_rows: int = 0
    # Llama, Mistral, Qwen2, Qwen3 and Phi-3 (transformers' own classes): call the model's
    # decoder layers directly, without its model forward's wrapper (about 0.3 ms a pass),
    # where the start-up check finds every logit equal to the wrapped forward's
    # (specdec/runtime/ragged.py, docs/models.md).
    lean_forward: bool = True
    # Llama, Mistral, Qwen2, Qwen3 (plain nn.Linear projections): in those direct calls, run
    # each decoder layer with q/k/v in one product and gate/up in another (their
    # weights become views into the fused ones: no copy), where the start-up check
    # finds every logit equal to the wrapped forward's; passes that oneDNN's packed
    # layers take (packed_linear) call the layers as before (specdec/runtime/ragged.py).
    fused_projections: bool = True
    # Draft only, CPU, float32, Llama / Mistral / Qwen2 with fused layers: run a lone
    # session's one-token passes in one compiled call (numba) instead of some 40 torch
    # calls, where the start-up check finds its logits within 1e-3 of the runner's
    # spread. A draft's values need not be bit-equal to its forward's (it sends the q
    # it samples from); a target never runs it (specdec/runtime/decode_kernel.py).
    decode_kernel: bool = True
    # glibc: keep up to this many MB of freed memory in the service's heap (and
    # allocations up to 32 MB on it), so that a step's large temporaries are not
    # faulted in anew every step; 0 leaves glibc's defaults (specdec/runtime/memory.py).
    # Opt-in: measured for large vocabularies' sampling arithmetic, not end to end.
    keep_freed_mb: int = 0
    tls: TlsConfig = field(default_factory=TlsConfig)
    # Draft only: client TLS towards the targets it relays proposals to (the
    # orchestrator's upstream_tls, as this service's client), and how long sending
    # a relay may take before the proposal goes back to the orchestrator instead
    # (specdec/transport/relay.py).
    relay_tls: TlsConfig = field(default_factory=TlsConfig)
    relay_send_timeout_s: float = 0.1
    # Draft only: ping each relay stream's connection this often and give it up when a
    # ping is not answered in as long (HTTP/2 keepalive, as orchestrator.keepalive_s):
    # a target whose node died without a reset is rested within twice this, and a new
    # stream is opened when it is back. At least 1.
    relay_keepalive_s: float = 10.0
    # The hidden-state wire (specdec/hidden_q.py): at temperature > 0 the draft sends
    # its last hidden state (head dimension + 5 bytes per drafted token, at any
    # vocabulary size) instead of q's list, and the target derives q from it with
    # the draft's output layer. Draft: hold a quantized copy of its own output layer
    # (hidden_q: true). Target: the draft checkpoint whose output layer it holds
    # (draft_head: its directory). Used only where the two layers' fingerprints match.
    hidden_q: bool = False
    draft_head: str = ""
    # Draft only: in a greedy step that drafts ahead (overlap), the draft also drafts
    # the next block for a rejection at each of the first `guesses` drafted positions,
    # each on a copy of its cache, guessing the target's token there as its own second
    # choice; the next propose takes the one it asks for. 0: off (draft_service/drafter.py).
    guesses: int = 4
    # ... and in a sampled step that drafts ahead, at the first `sampled_guesses`
    # positions, from a draw from q without the drafted token, which the target's
    # residual draw is then coupled to (docs/exactness.md, 4f; the blocks are drafted
    # in relayed steps with drafting on). 0: off, the default: on the 2-core demo VM
    # its drafting cost as much as it saved.
    sampled_guesses: int = 0
    # ... copying at most this many MB of cache per step (fewer guesses past it).
    guess_copy_mb: float = 64.0
    # Target only: in a greedy pipeline (orchestrator.pipeline), while no block waits
    # after a verdict, decode up to this many tokens on its own from the cursor the
    # verdict left; the next block's drafts are judged against them, and a rejection
    # among them is answered with no forward pass (target_service/verifier.py). 0: off.
    lookahead_tokens: int = 0


@dataclass
class OrchestratorConfig:
    """The public API: drives draft and target and applies rejection sampling."""

    host: str = "127.0.0.1"
    port: int = 50050
    metrics_port: int = 9100
    # One replica ("host:port"), a list ("h1:p1,h2:p2"), or every address a
    # name resolves to ("dns:///specdec-target-headless:50052"), re-resolved
    # every resolve_interval_s. Sessions are pinned to one replica of each.
    draft_address: str = "127.0.0.1:50051"
    target_address: str = "127.0.0.1:50052"
    resolve_interval_s: float = 10.0
    # One process: load the draft and the target (their sections' model, device,
    # dtype, ...) into the orchestrator and call them directly, with no draft or
    # target service and no hop between processes; the addresses above go unused.
    # For one machine that holds both models. The process has one pool of torch
    # threads: the target's torch_threads (loaded last) sets it. The two models'
    # passes share one event loop, so no step drafts ahead (a request's overlap is
    # ignored). docs/benchmarks.md, "One process".
    local_models: bool = False
    # Requests that leave gamma unset: with adaptive_gamma, the orchestrator
    # chooses gamma (and whether to draft ahead) at every step from its cost
    # model; otherwise they use `gamma`. max_gamma bounds both and requests.
    adaptive_gamma: bool = True
    gamma: int = 4
    max_gamma: int = 16
    # Draft the next block while the target verifies this one (overlapped
    # speculation), unless a request says otherwise. Adaptive requests use it
    # only when the cost model expects it to pay.
    overlap: bool = True
    # Adaptive requests draft ahead only while at most this many requests generate
    # at once (the orchestrator's load: the most in about the last second; 0: never).
    # Under load the draft is shared: a block drafted ahead and discarded delays the
    # other sessions' drafts, a cost no step's own time shows (side by side at 2-16
    # clients: 1.00-1.055x the throughput; docs/benchmarks.md, "Drafting ahead
    # under load").
    adaptive_overlap_max_requests: int = 1
    # Adaptive requests draft at all only while at most this many requests generate
    # at once (the same load; 0: at any load). Above it they decode plain batched,
    # with no check and no exploring. Where draft and target share the machine's
    # cores (configs/default.yaml) speculation loses to plain batched decoding under
    # load; on nodes of their own it may keep paying (docs/benchmarks.md, "Plain
    # decoding above a load"). vLLM's speculative_disable_by_batch_size is the same rule.
    adaptive_speculate_max_requests: int = 0
    # Check the cost model's choices against plain decoding by measurement: the
    # adaptive requests decode plain in trial epochs, and plain decoding leads
    # whenever it measures faster (orchestrator/adaptive.py, PlainGuard) ...
    adaptive_plain_check: bool = True
    # ... while at least this many requests generate at once (1: at any load). Below
    # it the cost model decides alone: there the check's trials and noise cost more
    # than it finds (docs/benchmarks.md, "The measured check against plain decoding").
    adaptive_plain_check_min_requests: int = 8
    # The cost model counts only the part of a block drafted on from the target's
    # echo (draft_on) that comes after its propose: the rest was drafted during the
    # hops back. False: every block's whole drafting time counts (before 2026-12-02).
    adaptive_draft_lead: bool = True
    # While plain decoding wins, an adaptive step drafts anyway once the pool has
    # decoded this many plain tokens per request generating at once (0: never), so
    # that acceptance and drafting costs stay measured. False: this many of the whole
    # pool (before 2026-12-02; under heavy load one step in eight drafted).
    adaptive_explore_tokens: int = 64
    adaptive_explore_per_request: bool = True
    # At temperature > 0, send q as the draft's hidden states where the draft and
    # the target hold the same draft output layer (draft.hidden_q, target.draft_head);
    # false: always as lists (wire_top_k).
    wire_hidden: bool = True
    # A plain step (no draft: gamma 0, the draft down, or adaptive chose plain)
    # lets the target draw up to this many tokens in a row, one pass each, saving
    # a round trip per token; at most one more than the request has emitted so
    # far (1, 2, 4, 8 at its start). 1 = one token per round trip.
    plain_run_tokens: int = 8
    # The same while two or more requests generate at once (the orchestrator's
    # load: the most in about the last second). A session then leaves the target's
    # shared passes less often, and each time it does the forward loop may wait for
    # it (side by side with 8 at 2-32 clients: plain decoding 1.00-1.06x, adaptive
    # 0.94-1.17x, medians of 6 paired rounds; docs/benchmarks.md).
    # A lone request keeps plain_run_tokens: its stream comes in small chunks.
    # Set it to plain_run_tokens to turn this off.
    plain_run_tokens_busy: int = 32
    # Most tokens each q lists on the wire (0 = no limit), and the mass it may
    # leave to its tail (spread evenly over every other token). The draft samples
    # from exactly what it sends: these cost acceptance, never exactness.
    wire_top_k: int = 1024
    wire_eps: float = 0.0
    # Limits a request must respect.
    max_new_tokens: int = 1024
    max_prompt_tokens: int = 1536
    max_stop_sequences: int = 8
    # Admission control: requests generating at once, and waiting beyond them.
    max_concurrent_requests: int = 32
    max_queued_requests: int = 64
    # Deadlines for one call to each service.
    draft_timeout_s: float = 0.5
    target_timeout_s: float = 30.0
    # A request in progress retries an unreachable target this long (a restart);
    # a new request fails at once with UNAVAILABLE.
    target_retry_s: float = 15.0
    # After a draft failure, plain decoding for this long before trying again
    # (doubling on each further failure up to the maximum).
    draft_retry_after_s: float = 1.0
    draft_retry_max_s: float = 30.0
    grace_period_s: float = 10.0
    # Live exactness monitor: the fraction of sampled (temperature > 0) steps
    # whose emitted tokens are checked, and how many recent checks the
    # uniformity statistic covers (orchestrator/monitor.py).
    monitor_fraction: float = 0.01
    monitor_window: int = 4096
    # Trim both caches with explicit Rollback RPCs after every step instead of
    # letting the rollback ride in the next Propose/Verify (one more round trip).
    explicit_rollback: bool = False
    # Ask the draft to send each sequential step's proposal straight to the
    # target (relay): one message and one wake-up of the orchestrator fewer per
    # step. Needs the draft to reach the target replicas at the addresses above.
    relay: bool = True
    # ... while at most this many requests generate at once (the most in about the
    # last second). Under heavier load the orchestrator's hop is off the critical
    # path and relaying measured slower (docs/benchmarks.md, "Relay"); 0: no limit.
    relay_max_requests: int = 4
    # How long a relayed verdict may take before the request gives the relay up
    # (the step decodes plain on a re-opened session; the request relays no more).
    relay_timeout_s: float = 5.0
    # With a relay, the target also echoes the verdict to the draft, which settles
    # the step as the orchestrator will and drafts the next step at once; the next
    # propose is answered from that draft when it asks for the same (DraftOn in
    # protos/specdec/v1/draft.proto). Takes the orchestrator off the step's path.
    draft_on: bool = True
    # ... in steps that draft ahead (overlap) too, after a verdict that leaves the
    # block drafted ahead unused (DraftOn.ahead). The draft then drafts two blocks in
    # a row, which costs where it shares a core with the orchestrator.
    draft_on_ahead: bool = True
    # Paced steps: a lone request's sequential step (one that drafts nothing ahead)
    # starts a pipeline of depth 0, and from then on the draft paces the steps: on
    # each verdict's echo it settles it, drafts the next block and relays it at
    # once; nothing is drafted while the target verifies, and this orchestrator
    # only follows the verdicts (the same draws and checks as the pipelines below;
    # docs/exactness.md, 4g). Takes the orchestrator off the step's path, where
    # draft_on leaves it in: the next block waits at the draft for its propose.
    # Gated like pipelines by pipeline_max_requests, not by pipeline_min_rtt_ms.
    paced: bool = True
    # ... and an adaptive request chooses gamma again after every paced verdict,
    # sending a change to the draft (DraftRequest.retune); off, it keeps the gamma
    # chosen at the pipeline's first step until the pipeline ends.
    paced_retune: bool = True
    # Pipelined speculation: in steps that draft ahead, the draft paces the steps
    # itself, relaying each block it drafts ahead marked to run only if the block
    # before it is accepted in full, and the target runs it without waiting for
    # this orchestrator, which follows the verdicts (Pipeline in
    # protos/specdec/v1/draft.proto; docs/exactness.md, 4g). Takes the
    # orchestrator's round trip off every step; with a relay, not with
    # explicit_rollback.
    pipeline: bool = False
    # ... drafting at most this many blocks ahead of the one being verified (1-4).
    pipeline_depth: int = 2
    # ... and an adaptive request chooses gamma again after every verdict of its
    # pipeline, sending a change to the draft (DraftRequest.retune), which drafts every
    # block after it with the new gamma; off, it keeps the gamma chosen at the
    # pipeline's first step until the pipeline ends.
    pipeline_retune: bool = True
    # ... while at most this many requests generate at once (the orchestrator's
    # load; 0: at any load). A pipeline takes the draft's and the target's time
    # without being asked; above this load it stops and the request's steps are
    # asked for again.
    pipeline_max_requests: int = 1
    # ... once the round trip to the draft (beyond its compute, as the cost model
    # measures it from the steps it asks for) is at least this long. On loopback the
    # orchestrator's hop is short and steps it asks for, with their guesses and
    # calibration, measured as fast or faster (docs/benchmarks.md, "Pipelined
    # speculation"); 0: at any round trip.
    pipeline_min_rtt_ms: float = 2.0
    # Tokenizer for text prompts; empty uses the target's model directory.
    tokenizer: str = ""
    # Seconds to wait at start-up for draft and target to answer Info.
    connect_timeout_s: float = 120.0
    # Largest gRPC message accepted, in bytes.
    max_message_bytes: int = 16 * 1024 * 1024
    # While a call to a draft or target replica is open, ping its connection this
    # often (HTTP/2 keepalive) and give it up when a ping is not answered in as long:
    # a replica whose node died or was cut off without a reset fails its calls with
    # UNAVAILABLE within twice this (requests then move to another replica), not at
    # target_timeout_s. At least 1 (the services take a ping a second at most).
    keepalive_s: float = 10.0
    # Client side TLS towards draft and target; server side TLS for the API.
    tls: TlsConfig = field(default_factory=TlsConfig)
    upstream_tls: TlsConfig = field(default_factory=TlsConfig)
    # Bearer tokens accepted on the API; empty list means no authentication.
    auth_tokens: list = field(default_factory=list)


@dataclass
class GatewayConfig:
    """The OpenAI-compatible HTTP gateway: a client of the orchestrator's public API.

    Bearer tokens are the orchestrator's (``orchestrator.auth_tokens``): one list
    of tokens for both ways of calling specdec.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int = 9103
    # The orchestrator's API: "host:port", or "dns:///name:port" for every address
    # a name resolves to (requests are spread round-robin over them).
    orchestrator_address: str = "127.0.0.1:50050"
    # Client TLS towards the orchestrator (ca; cert/key for mutual TLS).
    orchestrator_tls: TlsConfig = field(default_factory=TlsConfig)
    # Server TLS for HTTPS; with ca, clients must present a certificate.
    tls: TlsConfig = field(default_factory=TlsConfig)
    # The model name clients send and see; empty uses the target's model id.
    model_name: str = ""
    # max_tokens of a chat request that sets none (a completion's default is 16, as OpenAI's).
    default_max_tokens: int = 256
    # How chat messages become a prompt: "model" (the target tokenizer's chat
    # template, rendered by the orchestrator) or "plain-text" ("role: content"
    # lines and "assistant:", for a model without a template).
    chat_template: str = "model"
    # Deadline of one Generate call, in seconds.
    request_timeout_s: float = 600.0
    # Largest request body accepted, in bytes.
    max_body_bytes: int = 1024 * 1024
    grace_period_s: float = 10.0
    # While a call to the orchestrator is open, ping its connection this often (HTTP/2
    # keepalive) and give the connection up when a ping is not answered in as long: an
    # orchestrator whose node died or was cut off without a reset fails its calls (503,
    # or an error event mid-stream) within twice this, not after request_timeout_s.
    # At least 1 (the services take a ping a second at most).
    keepalive_s: float = 20.0
    # Browser origins allowed to call the API (CORS), e.g. ["https://app.example.com"];
    # ["*"]: any origin; empty: none (no CORS headers; a browser's cross-origin
    # calls then fail).
    cors_allow_origins: list = field(default_factory=list)


@dataclass
class Config:
    draft: ModelServiceConfig = field(
        default_factory=lambda: ModelServiceConfig(port=50051, metrics_port=9101)
    )
    target: ModelServiceConfig = field(
        default_factory=lambda: ModelServiceConfig(port=50052, metrics_port=9102)
    )
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)


_POSITIVE = {
    "resolve_interval_s",
    "max_sessions",
    "max_context",
    "max_gamma",
    "adaptive_plain_check_min_requests",
    "plain_run_tokens",
    "plain_run_tokens_busy",
    "max_new_tokens",
    "max_prompt_tokens",
    "max_concurrent_requests",
    "session_ttl_s",
    "draft_timeout_s",
    "target_timeout_s",
    "relay_timeout_s",
    "relay_send_timeout_s",
    "pipeline_depth",
    "max_message_bytes",
    "max_batch_tokens",
    "monitor_window",
    "default_max_tokens",
    "request_timeout_s",
    "max_body_bytes",
}
_NON_NEGATIVE = {
    "port",
    "metrics_port",
    "gamma",
    "relay_max_requests",
    "pipeline_max_requests",
    "pipeline_min_rtt_ms",
    "wire_top_k",
    "adaptive_explore_tokens",
    "adaptive_overlap_max_requests",
    "adaptive_speculate_max_requests",
    "max_queued_requests",
    "max_stop_sequences",
    "grace_period_s",
    "torch_threads",
    "plain_torch_threads",
    "draft_retry_after_s",
    "draft_retry_max_s",
    "target_retry_s",
    "batch_wait_ms",
    "decode_batch_wait_ms",
    "packed_linear_min_rows",
    "keep_freed_mb",
    "guesses",
    "sampled_guesses",
    "guess_copy_mb",
    "lookahead_tokens",
    "pad_vocab",
}


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Cast a YAML or string value to a field's type, or raise ConfigError naming key."""
    if typ in (int, "int"):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if typ in (float, "float"):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if typ in (bool, "bool"):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ in (str, "str"):
        if not isinstance(value, str | int | float):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    if typ in (list, "list"):
        if isinstance(value, str):
            return [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [str(v) for v in value]
    raise ConfigError(f"{key}: unsupported type {typ!r}")


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (known: {', '.join(sorted(fields))})")
    obj = cls()
    for name, value in data.items():
        f = fields[name]
        key = f"{prefix}{name}"
        default = getattr(obj, name)
        if dataclasses.is_dataclass(default):
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"{key}: expected a mapping of its keys, got {value!r}")
            base = dataclasses.asdict(default)
            base.update(value or {})
            setattr(obj, name, _build(type(default), base, key + "."))
        else:
            setattr(obj, name, _coerce(key, value, f.type))
    return obj


SECTIONS = ("draft", "target", "orchestrator", "gateway")
# The shortest keepalive a client may use: the servers accept a ping a second at most
# (``specdec.transport.server``).
MIN_KEEPALIVE_S = 1.0
# The most ``keep_freed_mb`` can be: glibc's trim threshold is an int of bytes
# (2048 MB wraps negative, which turns trimming off; 4096 wraps to 0).
MAX_KEEP_FREED_MB = (2**31 - 1) >> 20


def _validate(cfg: Config) -> None:
    for section in SECTIONS:
        sub = getattr(cfg, section)
        for f in dataclasses.fields(sub):
            v = getattr(sub, f.name)
            key = f"{section}.{f.name}"
            if f.name in _POSITIVE and v <= 0:
                raise ConfigError(f"{key}: must be > 0, got {v}")
            if f.name in _NON_NEGATIVE and v < 0:
                raise ConfigError(f"{key}: must be >= 0, got {v}")
            if f.name.endswith("port") and v > 65535:
                raise ConfigError(f"{key}: must be a port number 0..65535, got {v}")
    for section in ("draft", "target"):
        sub: ModelServiceConfig = getattr(cfg, section)
        if device_kind(sub.device) not in DEVICES:
            raise ConfigError(f"{section}.device: must be one of {DEVICES}, got {sub.device!r}")
        if sub.dtype not in DTYPES:
            raise ConfigError(f"{section}.dtype: must be one of {DTYPES}, got {sub.dtype!r}")
        if not sub.model:
            raise ConfigError(f"{section}.model: required (a local model directory)")
    for key in ("guesses", "sampled_guesses"):
        if getattr(cfg.draft, key) > MAX_GAMMA:
            got = getattr(cfg.draft, key)
            raise ConfigError(f"draft.{key}: must be <= {MAX_GAMMA}, got {got}")
    if cfg.target.lookahead_tokens > MAX_GAMMA:
        got = cfg.target.lookahead_tokens
        raise ConfigError(f"target.lookahead_tokens: must be <= {MAX_GAMMA}, got {got}")
    if cfg.target.pad_vocab:
        raise ConfigError(
            "target.pad_vocab: a draft's setting (new tokens would take some of the "
            "target's probability, and its output would no longer be its own)"
        )
    if cfg.draft.plain_torch_threads:
        raise ConfigError(
            "draft.plain_torch_threads: a target's setting (a draft's passes all draft; "
            "plain decoding steps run on the target)"
        )
    for section in ("draft", "target"):
        sub = getattr(cfg, section)
        if sub.pad_vocab and sub.hidden_q:
            raise ConfigError(
                f"{section}.pad_vocab: not with {section}.hidden_q (the target's copy of "
                "the draft's output layer, read from its checkpoint, would lack the rows)"
            )
        got = sub.keep_freed_mb
        if got > MAX_KEEP_FREED_MB:  # (glibc takes the threshold as a C int of bytes)
            raise ConfigError(f"{section}.keep_freed_mb: must be <= {MAX_KEEP_FREED_MB}, got {got}")
    for section, key in (
        ("gateway", "keepalive_s"),
        ("orchestrator", "keepalive_s"),
        ("draft", "relay_keepalive_s"),
    ):
        keepalive_s = getattr(getattr(cfg, section), key)
        if keepalive_s < MIN_KEEPALIVE_S:
            raise ConfigError(
                f"{section}.{key}: must be >= {MIN_KEEPALIVE_S:g} (the services take a"
                f" ping a second at most), got {keepalive_s}"
            )
    if cfg.gateway.chat_template not in CHAT_TEMPLATES:
        raise ConfigError(
            f"gateway.chat_template: must be one of {CHAT_TEMPLATES}, "
            f"got {cfg.gateway.chat_template!r}"
        )
    orch = cfg.orchestrator
    if not 0.0 <= orch.monitor_fraction <= 1.0:
        raise ConfigError(
            f"orchestrator.monitor_fraction: must be in [0, 1], got {orch.monitor_fraction}"
        )
    if orch.pipeline_depth > 4:
        raise ConfigError(
            f"orchestrator.pipeline_depth: must be in [1, 4], got {orch.pipeline_depth}"
        )
    if not 0.0 <= orch.wire_eps < 0.5:
        raise ConfigError(f"orchestrator.wire_eps: must be in [0, 0.5), got {orch.wire_eps}")
    for key in ("plain_run_tokens", "plain_run_tokens_busy"):
        if getattr(orch, key) > MAX_GAMMA:
            raise ConfigError(
                f"orchestrator.{key}: must be <= {MAX_GAMMA}, got {getattr(orch, key)}"
            )
    if orch.gamma > orch.max_gamma:
        raise ConfigError(
            f"orchestrator.gamma: must be <= orchestrator.max_gamma ({orch.max_gamma}), "
            f"got {orch.gamma}"
        )


def _env_overrides(env: Mapping[str, str]) -> list[tuple[str, str]]:
    out = []
    for section in SECTIONS:
        prefix = f"SPECDEC_{section.upper()}_"
        for name, value in env.items():
            # Kubernetes service links (SPECDEC_DRAFT_PORT=tcp://..., *_SERVICE_HOST)
            # share the prefix when a Service is named specdec-draft: not ours. Only
            # their tcp:// and udp:// values are skipped (a dns:/// address is ours).
            link = value.startswith(("tcp://", "udp://", "sctp://"))
            if link or "_SERVICE_" in name or "_PORT_" in name:
                continue
            if name.startswith(prefix):
                key = name[len(prefix) :].lower()
                # TLS keys: SPECDEC_DRAFT_TLS__CERT -> draft.tls.cert
                out.append((f"{section}.{key.replace('__', '.')}", value))
    return out


def _apply(raw: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: cannot set inside a non-mapping")
    node[parts[-1]] = value


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Config:
    """Load and validate a deployment config.

    ``path`` defaults to ``configs/default.yaml``; ``overrides`` are
    ``section.key=value`` strings. Relative model paths are resolved against
    the config file's folder's parent when they do not exist as given.
    """
    path = Path(path) if path else DEFAULT_CONFIG_PATH
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: invalid YAML: {e}") from None
    return config_from_dict(raw, overrides, env, base_dir=path.resolve().parent.parent)


def config_from_dict(
    raw: Mapping[str, Any],
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    base_dir: Path | None = None,
) -> Config:
    """Build a validated Config from a mapping, then env and ``key=value`` overrides."""
    raw = _deep_copy(raw)
    for dotted, value in _env_overrides(os.environ if env is None else env):
        _apply(raw, dotted, value)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        dotted, value = item.split("=", 1)
        _apply(raw, dotted.strip(), yaml.safe_load(value) if value else "")
    cfg = _build(Config, raw, "")
    for section in ("draft", "target"):
        sub = getattr(cfg, section)
        if sub.model and base_dir and not Path(sub.model).is_absolute():
            candidate = base_dir / sub.model
            if not Path(sub.model).exists() and candidate.exists():
                sub.model = str(candidate)
    _validate(cfg)
    return cfg


def _deep_copy(raw: Any) -> Any:
    if isinstance(raw, Mapping):
        return {k: _deep_copy(v) for k, v in raw.items()}
    return raw
