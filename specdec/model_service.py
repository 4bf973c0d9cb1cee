"""What the draft and target services share: a model, its sessions, and the
session RPCs (open, rollback, close, info), with validation of every field.

The services add one RPC each (Propose, Verify) on top of ``ModelService``.
Forwards run on one worker thread so the gRPC event loop stays free.
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import specdec
from specdec import metrics
from specdec.config import ModelServiceConfig
from specdec.errors import FailedPrecondition, Unavailable, require
from specdec.model import KVSession, ModelRunner, load_model, load_tokenizer, tokenizer_fingerprint
from specdec.sampling import SamplingParams
from specdec.sessions import SessionStore
from specdec.v1 import common_pb2

MAX_SESSION_ID_LEN = 128
# Most tokens one Propose drafts or one Verify checks (both services share the bound).
MAX_GAMMA = 64


class ModelService:
    """A loaded model, its sessions and the worker thread that runs forwards."""

    def __init__(
        self, role: str, cfg: ModelServiceConfig, model: Any = None, tokenizer: Any = None
    ) -> None:
        self.role = role
        self.cfg = cfg
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.model = (
            model
            if model is not None
            else load_model(cfg.model, cfg.device, cfg.dtype, cfg.trust_remote_code)
        )
        self.tokenizer = (
            tokenizer if tokenizer is not None else load_tokenizer(cfg.model, cfg.trust_remote_code)
        )
        self.runner = ModelRunner(self.model, cfg.device)
        self.vocab_size = self.runner.vocab_size
        self.sessions = SessionStore(role, cfg.max_sessions, cfg.session_ttl_s)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{role}-forward")
        self._sweeper: asyncio.Task | None = None
        self.draining = False
        eos = self.model.config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else (eos if eos is not None else -1)
        metrics.BUILD_INFO.labels(role).info(
            {
                "model_id": cfg.model,
                "dtype": cfg.dtype,
                "device": cfg.device,
                "version": specdec.__version__,
            }
        )
        self.sessions.update_gauges()
        # Create every labelled series now, so dashboards show 0 rather than nothing.
        metrics.ROLLBACKS.labels(role)
        metrics.ROLLED_BACK_TOKENS.labels(role)
        metrics.SESSION_EVICTIONS.labels(role, "ttl")

    # ---- lifecycle -------------------------------------------------------------------
    def start_sweeper(self) -> None:
        """Expire idle sessions in the background."""

        async def sweep() -> None:
            while True:
                await asyncio.sleep(max(0.5, min(self.cfg.session_ttl_s / 4, 5.0)))
                self.sessions.expire()

        self._sweeper = asyncio.get_running_loop().create_task(sweep())

    def begin_drain(self) -> None:
        """From now on, refuse new sessions; existing ones are served to the end."""
        self.draining = True

    def idle(self) -> bool:
        return len(self.sessions) == 0

    async def aclose(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
        self.sessions.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn, *args):
        """Run fn(*args) on the forward thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ---- validation ------------------------------------------------------------------
    def check_session_id(self, session_id: str) -> None:
        require(
            0 < len(session_id) <= MAX_SESSION_ID_LEN,
            "session_id",
            f"must be 1..{MAX_SESSION_ID_LEN} characters",
        )

    def check_tokens(self, field: str, tokens, min_len: int = 0) -> list[int]:
        tokens = list(tokens)
        require(len(tokens) >= min_len, field, f"must hold at least {min_len} token(s)")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        require(not bad, field, f"token id {bad[:1]} outside the vocabulary [0, {self.vocab_size})")
        return tokens

    def check_room(self, field: str, needed: int) -> None:
        require(
            needed <= self.cfg.max_context,
            field,
            f"the session would hold {needed} tokens, over max_context {self.cfg.max_context}",
        )

    def session_at(self, session_id: str, cache_len: int) -> KVSession:
        """The session, checked to hold at least ``cache_len`` tokens."""
        self.check_session_id(session_id)
        session = self.sessions.get(session_id)
        require(cache_len >= 0, "cache_len", "must be >= 0")
        if cache_len > session.length:
            raise FailedPrecondition(
                f"cache_len: expected {cache_len} cached tokens but session {session_id!r} "
                f"holds {session.length}"
            )
        return session

    def truncate(self, session: KVSession, cache_len: int) -> int:
        removed = session.truncate(cache_len)
        if removed:
            metrics.ROLLBACKS.labels(self.role).inc()
            metrics.ROLLED_BACK_TOKENS.labels(self.role).inc(removed)
        return removed

    def timed_forward(
        self, kind: str, session: KVSession, tokens: list[int], logits_to_keep: int = 1
    ) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.runner.forward(session, tokens, logits_to_keep)
        if logits.is_cuda:  # kernels run asynchronously: time the work, not the launch
            torch.cuda.synchronize(logits.device)
        metrics.FORWARD_DURATION.labels(self.role, kind).observe(time.perf_counter() - start)
        metrics.TOKENS_PROCESSED.labels(self.role, kind).inc(len(tokens))
        return logits

    # ---- the shared RPCs ---------------------------------------------------------------
    async def open(self, session_id: str, tokens) -> int:
        if self.draining:
            raise Unavailable(f"{self.role}: shutting down, not opening new sessions")
        self.check_session_id(session_id)
        tokens = self.check_tokens("tokens", tokens)
        self.check_room("tokens", len(tokens))
        session = self.runner.new_session(session_id)
        self.sessions.add(session)
        try:
            if tokens:
                await self.run(self.timed_forward, "prefill", session, tokens)
        except BaseException:
            self.sessions.remove(session_id)
            raise
        self.sessions.update_gauges()
        return session.length

    async def rollback(self, session_id: str, cache_len: int) -> tuple[int, int]:
        session = self.session_at(session_id, cache_len)
        removed = self.truncate(session, cache_len)
        self.sessions.update_gauges()
        return session.length, removed

    def close(self, session_id: str) -> bool:
        return self.sessions.remove(session_id)

    def info(self) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(
            model_id=self.cfg.model,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.fingerprint,
            dtype=self.cfg.dtype,
            device=self.cfg.device,
            architecture=type(self.model).__name__,
            eos_token_id=self.eos_token_id,
            max_context=self.cfg.max_context,
            server_version=specdec.__version__,
        )


def params_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Validated sampling parameters; a top_p of 0 on the wire means unset (1)."""
    t, k, p = pb.temperature, pb.top_k, pb.top_p or 1.0
    require(math.isfinite(t) and t >= 0, "params.temperature", f"must be >= 0, got {t}")
    require(k >= 0, "params.top_k", f"must be >= 0, got {k}")
    require(math.isfinite(p) and 0 < p <= 1, "params.top_p", f"must be in (0, 1], got {p}")
    return SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p))


class SessionServicerMixin:
    """The session RPCs, identical in both services; ``self.svc`` is a ModelService."""

    svc: ModelService

    async def OpenSession(self, request, context):
        return common_pb2.OpenSessionResponse(
            cache_len=await self.svc.open(request.session_id, request.tokens)
        )

    async def Rollback(self, request, context):
        length, removed = await self.svc.rollback(request.session_id, request.cache_len)
        return common_pb2.RollbackResponse(cache_len=length, removed=removed)

    async def CloseSession(self, request, context):
        return common_pb2.CloseSessionResponse(existed=self.svc.close(request.session_id))

    async def Info(self, request, context):
        return self.svc.info()
