"""The orchestrator's domain: validates a request, then drives the loop

    Propose (draft) -> Verify (target) -> accept/reject -> roll back -> stream

applying rejection sampling with its own uniforms (``specdec.sampling``).
It owns the authoritative token history of every request; each call that
changes a cache carries the cache length it expects, so a lost or stale
session is detected (NOT_FOUND / FAILED_PRECONDITION) and re-opened by
re-prefilling from the history. A failing draft never fails a request: the
step is decoded by the target alone and a circuit breaker pauses speculation.
Not for: gRPC servicer details (``orchestrator.server``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import torch

import specdec
from specdec import metrics
from specdec.config import Config
from specdec.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    require,
)
from specdec.model import load_tokenizer, tokenizer_fingerprint
from specdec.sampling import SamplingParams, accepted_count, step_tokens
from specdec.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    orchestrator_pb2,
    target_pb2,
    target_pb2_grpc,
)

from .replicas import Replica, ReplicaPool
from .text import TextStream

log = logging.getLogger(__name__)
MAX_STOP_CHARS = 256
SESSION_LOST = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


@dataclass
class RequestSpec:
    """A validated Generate request."""

    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    gamma: int
    stops: list[str]
    seed: int
    dense: bool


@dataclass
class Stats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    round_trips: int = 0
    wire_bytes: int = 0
    fallback_steps: int = 0
    ttft_s: float = 0.0
    fallback_reasons: set = field(default_factory=set)


class Orchestrator:
    """Replicas of draft and target, admission control, and request validation."""

    def __init__(self, cfg: Config, tokenizer=None) -> None:
        self.cfg = cfg
        o = cfg.orchestrator
        self.tokenizer = (
            tokenizer if tokenizer is not None else load_tokenizer(o.tokenizer or cfg.target.model)
        )
        self._slots = asyncio.Semaphore(o.max_concurrent_requests)
        self.live = 0
        self.queued = 0
        self._background: set[asyncio.Task] = set()
        self.draining = False
        self._resolver: asyncio.Task | None = None
        self.target_pool: ReplicaPool | None = None
        self.draft_pool: ReplicaPool | None = None
        self.draft_info: common_pb2.ModelInfo | None = None
        self.target_info: common_pb2.ModelInfo | None = None
        for stage in ("propose", "verify", "rollback", "orchestrator"):
            metrics.STAGE_DURATION.labels(stage)
        for peer in ("draft", "target"):
            metrics.ROUND_TRIPS.labels(peer)

    # ---- lifecycle -------------------------------------------------------------------
    def _pool(self, role: str, spec: str, make_stub, check) -> ReplicaPool:
        o = self.cfg.orchestrator
        return ReplicaPool(
            role,
            spec,
            make_stub,
            o.upstream_tls,
            o.max_message_bytes,
            o.draft_retry_after_s,
            o.draft_retry_max_s,
            check,
        )

    async def connect(self) -> None:
        """Find the replicas, wait for a target (and a draft), check they can cooperate."""
        o = self.cfg.orchestrator
        self.target_pool = self._pool(
            "target", o.target_address, target_pb2_grpc.TargetServiceStub, self.check_target
        )
        self.draft_pool = self._pool(
            "draft", o.draft_address, draft_pb2_grpc.DraftServiceStub, self.check_draft
        )
        self.target_info = await self.target_pool.wait_ready(o.connect_timeout_s)
        try:
            self.draft_info = await self.draft_pool.wait_ready(o.connect_timeout_s)
        except Unavailable as e:
            # The target alone can serve every request; speculation starts when a draft answers.
            log.warning("%s; starting without speculation", e)
        self.update_speculation_gauge()
        self._resolver = asyncio.get_running_loop().create_task(self._keep_resolving())
        # The orchestrator serves the target's output; it reports the target's model id.
        metrics.BUILD_INFO.labels("orchestrator").info(
            {
                "model_id": self.target_info.model_id,
                "dtype": self.target_info.dtype,
                "device": self.target_info.device,
                "version": specdec.__version__,
            }
        )

    async def _keep_resolving(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.orchestrator.resolve_interval_s)
            try:
                await self.target_pool.refresh()
                await self.draft_pool.refresh()
                if self.draft_info is None:
                    self.draft_info = next(
                        (r.info for r in self.draft_pool.replicas.values() if r.info), None
                    )
                self.update_speculation_gauge()
            except Exception:  # never let a resolver hiccup stop the service
                log.exception("refreshing replicas failed")

    def update_speculation_gauge(self) -> None:
        metrics.SPECULATION_ENABLED.set(1 if self.draft_pool.any_usable() else 0)

    def check_target(self, t: common_pb2.ModelInfo) -> None:
        """A target replica must use the orchestrator's tokenizer and agree with the others."""
        own = tokenizer_fingerprint(self.tokenizer)
        if own != t.tokenizer_fingerprint:
            raise FailedPrecondition(
                f"tokenizer: the orchestrator's tokenizer differs from target {t.model_id}'s "
                f"({own[:12]} vs {t.tokenizer_fingerprint[:12]})"
            )
        first = self.target_info
        if first is not None and (first.vocab_size, first.eos_token_id) != (
            t.vocab_size,
            t.eos_token_id,
        ):
            raise FailedPrecondition(f"target {t.model_id} differs from the other targets")

    def check_draft(self, d: common_pb2.ModelInfo) -> None:
        """Refuse a draft that does not share the target's vocabulary."""
        t = self.target_info
        problems = []
        if d.vocab_size != t.vocab_size:
            problems.append(f"vocab_size draft {d.vocab_size} != target {t.vocab_size}")
        if d.tokenizer_fingerprint != t.tokenizer_fingerprint:
            problems.append(
                f"tokenizer fingerprint draft {d.tokenizer_fingerprint[:12]} != "
                f"target {t.tokenizer_fingerprint[:12]}"
            )
        if d.eos_token_id != t.eos_token_id:
            problems.append(f"eos_token_id draft {d.eos_token_id} != target {t.eos_token_id}")
        if problems:
            raise FailedPrecondition(
                f"draft {d.model_id} and target {t.model_id} cannot be paired: "
                + "; ".join(problems)
            )

    def begin_drain(self) -> None:
        """From now on, refuse new requests; running ones finish."""
        self.draining = True

    def idle(self) -> bool:
        return self.live == 0 and self.queued == 0 and not self._background

    async def aclose(self) -> None:
        for task in list(self._background):
            await asyncio.wait([task], timeout=2.0)
        if self._resolver is not None:
            self._resolver.cancel()
        for pool in (self.draft_pool, self.target_pool):
            if pool is not None:
                await pool.aclose()

    def spawn(self, coro) -> None:
        """Run ``coro`` in the background, surviving the caller's cancellation."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- requests --------------------------------------------------------------------
    def info(self) -> orchestrator_pb2.OrchestratorInfo:
        o = self.cfg.orchestrator
        return orchestrator_pb2.OrchestratorInfo(
            draft_model_id=self.draft_info.model_id if self.draft_info else "",
            target_model_id=self.target_info.model_id,
            vocab_size=self.target_info.vocab_size,
            default_gamma=o.gamma,
            max_gamma=o.max_gamma,
            max_new_tokens=o.max_new_tokens,
            max_prompt_tokens=o.max_prompt_tokens,
            server_version=specdec.__version__,
        )

    def parse(self, r: orchestrator_pb2.GenerateRequest) -> RequestSpec:
        """Validate every field; errors name the field and the allowed range."""
        o = self.cfg.orchestrator
        kind = r.WhichOneof("prompt")
        require(kind is not None, "prompt", "set text or token_ids")
        if kind == "text":
            require(r.text != "", "text", "must not be empty")
            prompt = self.tokenizer.encode(r.text)
            require(len(prompt) > 0, "text", "encodes to no tokens")
        elif kind == "messages":
            prompt = self.chat_prompt(r.messages.messages)
        else:
            prompt = list(r.token_ids.ids)
            require(len(prompt) > 0, "token_ids", "must hold at least one token")
            vocab = self.target_info.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            require(
                not bad,
                "token_ids",
                f"token id {bad[0] if bad else ''} outside the vocabulary [0, {vocab})",
            )
        require(
            len(prompt) <= o.max_prompt_tokens,
            kind,
            f"prompt has {len(prompt)} tokens, over the limit of {o.max_prompt_tokens}",
        )
        require(
            1 <= r.max_new_tokens <= o.max_new_tokens,
            "max_new_tokens",
            f"must be in [1, {o.max_new_tokens}], got {r.max_new_tokens}",
        )
        require(
            math.isfinite(r.temperature) and r.temperature >= 0,
            "temperature",
            f"must be >= 0, got {r.temperature}",
        )
        require(r.top_k >= 0, "top_k", f"must be >= 0 (0 disables), got {r.top_k}")
        top_p = r.top_p or 1.0
        require(
            math.isfinite(top_p) and 0 < top_p <= 1, "top_p", f"must be in (0, 1], got {r.top_p}"
        )
        gamma = r.gamma if r.HasField("gamma") else o.gamma
        require(0 <= gamma <= o.max_gamma, "gamma", f"must be in [0, {o.max_gamma}], got {gamma}")
        require(
            len(r.stop) <= o.max_stop_sequences,
            "stop",
            f"at most {o.max_stop_sequences} stop strings, got {len(r.stop)}",
        )
        for s in r.stop:
            require(
                0 < len(s) <= MAX_STOP_CHARS,
                "stop",
                f"each stop string must have 1..{MAX_STOP_CHARS} characters",
            )
        room = min(self.cfg.target.max_context, self.target_info.max_context or 1 << 30)
        if gamma and self.draft_info is not None:
            room = min(room, self.draft_info.max_context or room)
        need = len(prompt) + r.max_new_tokens + gamma + 1
        require(
            need <= room,
            "max_new_tokens",
            f"prompt ({len(prompt)}) + max_new_tokens ({r.max_new_tokens}) + gamma + 1 "
            f"exceeds the services' max_context ({room})",
        )
        return RequestSpec(
            prompt=prompt,
            max_new_tokens=r.max_new_tokens,
            params=SamplingParams(float(r.temperature), int(r.top_k), float(top_p)),
            gamma=gamma,
            stops=list(r.stop),
            seed=r.seed if r.HasField("seed") else secrets.randbits(63),
            dense=r.dense,
        )

    def chat_prompt(self, messages) -> list[int]:
        """Token ids of a conversation, rendered by the tokenizer's chat template."""
        require(len(messages) > 0, "messages", "must hold at least one message")
        for i, m in enumerate(messages):
            require(m.role != "", f"messages[{i}].role", "must not be empty")
        require(
            bool(getattr(self.tokenizer, "chat_template", None)),
            "messages",
            "the target's tokenizer has no chat template; send the prompt as text instead",
        )
        turns = [{"role": m.role, "content": m.content} for m in messages]
        try:
            ids = self.tokenizer.apply_chat_template(
                turns, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as e:  # the template itself refuses (e.g. roles out of order)
            raise InvalidArgument("messages", f"the chat template refused them: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        require(len(ids) > 0, "messages", "render to no tokens")
        return list(ids)

    async def generate(
        self, r: orchestrator_pb2.GenerateRequest, deadline: float | None = None
    ) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        """Admission control, then one Generation. ``deadline`` is time.monotonic()-based."""
        start = time.perf_counter()
        if self.draining:
            raise Unavailable("orchestrator: shutting down, not taking new requests")
        spec = self.parse(r)
        o = self.cfg.orchestrator
        if self.live >= o.max_concurrent_requests and self.queued >= o.max_queued_requests:
            raise ResourceExhausted(
                f"requests: {self.live} generating and {self.queued} queued, at the limits "
                f"max_concurrent_requests={o.max_concurrent_requests}, "
                f"max_queued_requests={o.max_queued_requests}"
            )
        self.queued += 1
        metrics.QUEUED_REQUESTS.set(self.queued)
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
            metrics.QUEUED_REQUESTS.set(self.queued)
        self.live += 1
        metrics.LIVE_REQUESTS.set(self.live)
        try:
            async for response in Generation(self, spec, start, deadline).run():
                yield response
        finally:
            self.live -= 1
            metrics.LIVE_REQUESTS.set(self.live)
            self._slots.release()


class Generation:
    """One request's loop and bookkeeping. The history is the source of truth:

    target cache = history[:target_len], then ``target_pending`` are unseen;
    draft cache  = history[:draft_len],  then ``draft_pending`` are unseen.
    """

    def __init__(
        self, orch: Orchestrator, spec: RequestSpec, start: float, deadline: float | None
    ) -> None:
        self.orch = orch
        self.o = orch.cfg.orchestrator
        self.spec = spec
        self.start = start
        self.deadline = deadline
        self.sid = uuid.uuid4().hex
        self.history = list(spec.prompt)
        self.generator = torch.Generator().manual_seed(spec.seed)
        self.stats = Stats()
        self.text = TextStream(orch.tokenizer, spec.stops)
        self.eos = orch.target_info.eos_token_id
        self.target_rep: Replica | None = None  # pinned replicas
        self.draft_rep: Replica | None = None
        self.target_open = self.draft_open = False
        self.target_len = self.draft_len = 0
        self.target_pending: list[int] = []
        self.draft_pending: list[int] = []
        self.wire_q = 0 if spec.dense else self.o.wire_top_k

    # ---- calls -----------------------------------------------------------------------
    def timeout(self, configured: float) -> float:
        if self.deadline is None:
            return configured
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise asyncio.TimeoutError
        return min(configured, left)

    def count(self, peer: str, sent: int, received: int) -> None:
        self.stats.round_trips += 1
        self.stats.wire_bytes += sent + received
        metrics.ROUND_TRIPS.labels(peer).inc()
        metrics.WIRE_BYTES.labels(peer, "sent").inc(sent)
        metrics.WIRE_BYTES.labels(peer, "received").inc(received)

    def _seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self.generator))

    def pin_target(self) -> None:
        """Pin this request to the least-loaded target replica (another one if pinned)."""
        replica = self.orch.target_pool.pick(exclude=self.target_rep)
        if replica is None:
            if self.target_rep is not None:
                return  # the only replica: keep retrying it
            raise Unavailable(f"target: no healthy replica at {self.o.target_address}")
        if self.target_rep is not None:
            self.orch.spawn(self._close("target", self.target_rep, self.target_open))
            self.target_rep.pinned -= 1
        replica.pinned += 1
        self.target_rep, self.target_open = replica, False

    def pin_draft(self) -> bool:
        """Pin to the least-loaded usable draft replica; False if none is usable."""
        replica = self.orch.draft_pool.pick()
        if replica is not None:
            replica.pinned += 1
            self.draft_rep, self.draft_open = replica, False
        return replica is not None

    async def open_target(self) -> None:
        req = common_pb2.OpenSessionRequest(session_id=self.sid, tokens=self.history[:-1])
        timeout = self.timeout(self.o.target_timeout_s)
        try:
            resp = await self.target_rep.stub.OpenSession(req, timeout=timeout)
        except BaseException:
            # The target may hold the session and only its answer was lost (deadline,
            # dropped connection, cancellation): close it, or it keeps its KV cache
            # until session_ttl_s and holds up the target's drain.
            self.orch.spawn(self._close("target", self.target_rep, True))
            raise
        self.count("target", req.ByteSize(), resp.ByteSize())
        self.target_open, self.target_len = True, resp.cache_len
        self.target_pending = self.history[-1:]

    async def open_draft(self) -> None:
        req = common_pb2.OpenSessionRequest(session_id=self.sid, tokens=self.history[:-1])
        timeout = self.timeout(self.o.draft_timeout_s)
        try:
            resp = await self.draft_rep.stub.OpenSession(req, timeout=timeout)
        except BaseException:
            # As in open_target: the draft may hold the session although the answer was lost.
            self.orch.spawn(self._close("draft", self.draft_rep, True))
            raise
        self.count("draft", req.ByteSize(), resp.ByteSize())
        self.draft_open, self.draft_len = True, resp.cache_len
        self.draft_pending = self.history[-1:]

    async def propose(
        self, gamma: int
    ) -> tuple[list[int], list[common_pb2.Distribution], list[float]]:
        req = draft_pb2.ProposeRequest(
            session_id=self.sid,
            cache_len=self.draft_len,
            append_tokens=self.draft_pending,
            gamma=gamma,
            params=self.params_pb(),
            seed=self._seed(),
            wire_top_k=self.wire_q,
        )
        drafts, qs, q_draft, received = [], [], [], 0
        call = self.draft_rep.stub.Propose(req, timeout=self.timeout(self.o.draft_timeout_s))
        async for msg in call:
            received += msg.ByteSize()
            drafts.append(msg.token_id)
            qs.append(msg.q)
            q_draft.append(_prob_of(msg.q, msg.token_id))
        self.count("draft", req.ByteSize(), received)
        if len(drafts) != gamma:
            raise Unavailable(f"draft: sent {len(drafts)} of {gamma} tokens")
        return drafts, qs, q_draft

    async def verify(self, drafts: list[int], qs) -> target_pb2.VerifyResponse:
        req = target_pb2.VerifyRequest(
            session_id=self.sid,
            cache_len=self.target_len,
            pending_tokens=self.target_pending,
            draft_tokens=drafts,
            draft_q=qs,
            params=self.params_pb(),
            seed=self._seed(),
            return_dense_p=self.spec.dense,
        )
        resp = await self.target_rep.stub.Verify(req, timeout=self.timeout(self.o.target_timeout_s))
        self.count("target", req.ByteSize(), resp.ByteSize())
        return resp

    def params_pb(self) -> common_pb2.SamplingParams:
        p = self.spec.params
        return common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)

    async def rollback(self) -> None:
        """Explicit Rollback RPCs trimming both caches to their valid lengths."""
        calls = []
        for peer, replica, length, timeout in (
            ("target", self.target_rep, self.target_len, self.o.target_timeout_s),
            ("draft", self.draft_rep, self.draft_len, self.o.draft_timeout_s),
        ):
            if peer == "draft" and not self.draft_open:
                continue
            req = common_pb2.RollbackRequest(session_id=self.sid, cache_len=length)
            calls.append((peer, req, replica.stub.Rollback(req, timeout=self.timeout(timeout))))
        for peer, req, call in calls:
            try:
                resp = await call
                self.count(peer, req.ByteSize(), resp.ByteSize())
            except grpc.aio.AioRpcError as e:
                if peer == "target":
                    raise
                self.draft_failed(e)

    # ---- the loop --------------------------------------------------------------------
    def draft_failed(self, e: BaseException) -> str:
        """Give up on the pinned draft replica for now; returns the reason (a metric label)."""
        if isinstance(e, grpc.aio.AioRpcError):
            reason = e.code().name.lower()
        else:
            reason = "incomplete" if isinstance(e, Unavailable) else "timeout"
        log.warning(
            "draft %s failed (%s): speculating again after back-off", self.draft_rep.address, reason
        )
        self.draft_rep.breaker.failure()
        self.orch.update_speculation_gauge()
        self.stats.fallback_reasons.add(reason)
        self.orch.spawn(self._close("draft", self.draft_rep, self.draft_open))
        self.draft_rep.pinned -= 1
        self.draft_rep, self.draft_open = None, False
        return reason

    async def step(self) -> list[int]:
        """One speculation step; returns the tokens it emits."""
        t0 = time.perf_counter()
        remaining = self.spec.max_new_tokens - self.stats.generated
        gamma = max(0, min(self.spec.gamma, remaining - 1))
        drafts, qs, q_draft = [], [], []
        t_propose = 0.0
        if gamma and self.draft_rep is None and not self.pin_draft():
            self.fallback("breaker_open")
        elif gamma:
            tp = time.perf_counter()
            drafts, qs, q_draft = await self.try_propose(gamma)
            t_propose = time.perf_counter() - tp
        used = len(drafts)
        tv = time.perf_counter()
        resp = await self.verify_with_reopen(drafts, qs)
        t_verify = time.perf_counter() - tv
        u = torch.rand(used, generator=self.generator, dtype=torch.float64)
        n = accepted_count(
            torch.tensor(resp.p_draft, dtype=torch.float64),
            torch.tensor(q_draft, dtype=torch.float64),
            u,
        )
        new = step_tokens(drafts, n, list(resp.residual_tokens), resp.bonus_token)
        self.advance(drafts, n, new)
        t_rollback = 0.0
        if self.o.explicit_rollback:
            tr = time.perf_counter()
            await self.rollback()
            t_rollback = time.perf_counter() - tr
        self.record_step(used, n, t_propose, t_verify, t_rollback, time.perf_counter() - t0)
        return new

    def fallback(self, reason: str) -> None:
        self.stats.fallback_steps += 1
        self.stats.fallback_reasons.add(reason)
        metrics.FALLBACK_STEPS.labels(reason).inc()

    async def try_propose(self, gamma: int):
        """Drafts from the draft service, or none (a fallback step) if it fails.

        A draft that lost the session (it restarted) gets it back by re-prefill
        at once; any other failure opens the circuit breaker.
        """
        for attempt in (1, 2):
            try:
                if not self.draft_open:
                    await self.open_draft()
                drafts = await self.propose(gamma)
                if self.draft_rep.breaker.failures:
                    self.draft_rep.breaker.success()
                    self.orch.update_speculation_gauge()
                return drafts
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, Unavailable) as e:
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    raise
                lost = isinstance(e, grpc.aio.AioRpcError) and e.code() in SESSION_LOST
                if lost and attempt == 1:
                    log.warning("draft lost session %s: re-prefilling", self.sid)
                    self.draft_open = False
                    continue
                self.fallback(self.draft_failed(e))
                break
        return [], [], []

    async def verify_with_reopen(self, drafts, qs) -> target_pb2.VerifyResponse:
        """Verify, riding out a target restart.

        A target that lost the session (NOT_FOUND / FAILED_PRECONDITION after a
        restart) gets it back by re-prefilling the history; an unreachable
        target is retried for up to ``target_retry_s`` once this request has
        started (a new request fails fast instead, in open_sessions).
        """
        retry_until = time.monotonic() + self.o.target_retry_s
        delay = 0.05
        while True:
            try:
                if not self.target_open:
                    await self.open_target()
                response = await self.verify(drafts, qs)
                if self.target_rep.breaker.failures:
                    self.target_rep.breaker.success()
                return response
            except grpc.aio.AioRpcError as e:
                if e.code() in SESSION_LOST:
                    log.warning(
                        "target lost session %s (%s): re-prefilling", self.sid, e.code().name
                    )
                    self.target_open = False
                elif e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > retry_until:
                    raise
                else:
                    # Move to another replica if there is one (re-prefilled from the
                    # history); otherwise wait for this one to come back.
                    self.target_rep.breaker.failure()
                    self.pin_target()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    def advance(self, drafts: list[int], n: int, new: list[int]) -> None:
        """Update history and both caches' valid lengths after a step emitting ``new``."""
        gamma = len(drafts)
        # Target: it saw pending + all drafts; the first n drafts stay valid.
        self.target_len += len(self.target_pending) + n
        self.target_pending = [new[-1]]
        if gamma:
            # Draft: it fed pending and x_1..x_{gamma-1}; x_gamma was never fed.
            kept = min(n, gamma - 1)
            self.draft_len += len(self.draft_pending) + kept
            self.draft_pending = drafts[kept:n] + [new[-1]]
        else:
            self.draft_pending = self.draft_pending + new
        self.history.extend(new)

    def record_step(
        self, gamma: int, n: int, t_propose: float, t_verify: float, t_rollback: float, total: float
    ) -> None:
        s = self.stats
        s.steps += 1
        s.drafted += gamma
        s.accepted += n
        metrics.STEPS.inc()
        metrics.STEP_GAMMA.observe(gamma)
        if gamma:
            metrics.DRAFTED_TOKENS.inc(gamma)
            metrics.ACCEPTED_TOKENS.inc(n)
            metrics.STEP_ACCEPTED.observe(n)
            for i in range(1, gamma + 1):
                metrics.DRAFTED_BY_POSITION.labels(metrics.position_label(i)).inc()
                if i <= n:
                    metrics.ACCEPTED_BY_POSITION.labels(metrics.position_label(i)).inc()
            metrics.STAGE_DURATION.labels("propose").observe(t_propose)
        metrics.STAGE_DURATION.labels("verify").observe(t_verify)
        if self.o.explicit_rollback:
            metrics.STAGE_DURATION.labels("rollback").observe(t_rollback)
        metrics.STAGE_DURATION.labels("orchestrator").observe(
            max(0.0, total - t_propose - t_verify - t_rollback)
        )

    async def run(self) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        metrics.PROMPT_TOKENS.inc(len(self.spec.prompt))
        finish = "length"
        last = self.start
        try:
            await self.open_sessions()
            while self.stats.generated < self.spec.max_new_tokens:
                new = await self.step()
                new = new[: self.spec.max_new_tokens - self.stats.generated]
                if self.eos >= 0 and self.eos in new:
                    new = new[: new.index(self.eos)]
                    finish = "eos"
                done = finish == "eos" or (
                    self.stats.generated + len(new) >= self.spec.max_new_tokens
                )
                out = self.text.push(new, final=done)
                if out.stopped:
                    finish, done = "stop", True
                if out.token_ids or out.text:
                    now = time.perf_counter()
                    if self.stats.generated == 0:
                        self.stats.ttft_s = now - self.start
                        metrics.TIME_TO_FIRST_TOKEN.observe(self.stats.ttft_s)
                    elif out.token_ids:
                        gap = (now - last) / len(out.token_ids)
                        for _ in out.token_ids:
                            metrics.INTER_TOKEN_LATENCY.observe(gap)
                    last = now
                    self.stats.generated += len(out.token_ids)
                    metrics.GENERATED_TOKENS.inc(len(out.token_ids))
                    yield orchestrator_pb2.GenerateResponse(
                        chunk=orchestrator_pb2.Chunk(text=out.text, token_ids=out.token_ids)
                    )
                if done:
                    break
            yield orchestrator_pb2.GenerateResponse(stats=self.final_stats(finish))
        except asyncio.TimeoutError:
            raise Unavailable("deadline: the request's deadline passed while generating") from None
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.deadline is not None:
                raise Unavailable(
                    "deadline: the request's deadline passed while generating"
                ) from None
            raise Unavailable(f"target: {e.code().name}: {e.details()}") from None
        finally:
            for reason in self.stats.fallback_reasons:
                metrics.FALLBACK_REQUESTS.labels(reason).inc()
            self.orch.spawn(self.close_sessions())

    async def open_sessions(self) -> None:
        """Prefill both caches concurrently (the draft only when speculating)."""
        self.pin_target()
        target = asyncio.ensure_future(self.open_target())
        if self.spec.gamma > 0 and self.spec.max_new_tokens > 1 and self.pin_draft():
            try:
                await self.open_draft()
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
                self.draft_failed(e)
        while True:
            try:
                return await target
            except grpc.aio.AioRpcError as e:
                # An unreachable replica is skipped for a while; with no other
                # healthy one the request fails now (pin_target raises UNAVAILABLE).
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self.target_rep.breaker.failure()
                self.target_rep.pinned -= 1
                self.target_rep = None
                self.pin_target()
                target = asyncio.ensure_future(self.open_target())

    def final_stats(self, finish: str) -> orchestrator_pb2.GenerationStats:
        s = self.stats
        total = time.perf_counter() - self.start
        metrics.REQUEST_DURATION.observe(total)
        return orchestrator_pb2.GenerationStats(
            prompt_tokens=len(self.spec.prompt),
            generated_tokens=s.generated,
            steps=s.steps,
            drafted_tokens=s.drafted,
            accepted_tokens=s.accepted,
            acceptance_rate=s.accepted / s.drafted if s.drafted else 0.0,
            mean_accepted_length=s.accepted / s.steps if s.steps else 0.0,
            time_to_first_token_s=s.ttft_s,
            tokens_per_second=s.generated / total if total > 0 else 0.0,
            total_time_s=total,
            finish_reason=finish,
            gamma=self.spec.gamma,
            wire_bytes_per_token=s.wire_bytes / s.generated if s.generated else 0.0,
            round_trips=s.round_trips,
            fallback_steps=s.fallback_steps,
        )

    async def _close(self, peer: str, replica: Replica | None, opened: bool) -> None:
        if replica is None or not opened:
            return
        req = common_pb2.CloseSessionRequest(session_id=self.sid)
        try:
            await replica.stub.CloseSession(req, timeout=2.0)
        except grpc.aio.AioRpcError as e:
            # The service's TTL frees the session if it cannot be told now.
            log.info("closing %s session %s failed: %s", peer, self.sid, e.code().name)

    async def close_sessions(self) -> None:
        """Free both sessions and unpin this request from its replicas."""
        closes = [
            self._close("target", self.target_rep, self.target_open),
            self._close("draft", self.draft_rep, self.draft_open),
        ]
        for replica in (self.target_rep, self.draft_rep):
            if replica is not None:
                replica.pinned -= 1
        self.target_rep = self.draft_rep = None
        self.target_open = self.draft_open = False
        await asyncio.gather(*closes)


def _prob_of(q: common_pb2.Distribution, token: int) -> float:
    """q(token) from a sparse or dense distribution on the wire."""
    if q.token_ids:
        return sum(p for t, p in zip(q.token_ids, q.probs, strict=True) if t == token)
    return q.probs[token]
