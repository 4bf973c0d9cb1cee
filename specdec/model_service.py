"""What the draft and target services share: a model, its sessions, the forward
loop that batches their work, and the session operations (open, rollback,
close, info), with validation of every field.

The services add one operation each on top of ``ModelService``: the draft's
``propose``, the target's ``verify``. Everything here takes and returns
domain values; the servicers convert protobuf at the edge (``specdec.wire``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch

import specdec
from specdec import kernels, metrics
from specdec.config import ConfigError, ModelServiceConfig, device_kind
from specdec.errors import FailedPrecondition, Unavailable, Unsupported, require
from specdec.hidden_q import QuantHead
from specdec.runtime import packed_linear
from specdec.runtime.forward_loop import BatchStats, ForwardLoop, Job
from specdec.runtime.loading import (
    ModelInfo,
    check_device,
    check_model_path,
    eos_token_ids,
    load_model,
    load_output_layer,
    load_tokenizer,
    model_fingerprint,
    pad_vocab,
    position_limit,
    set_threads,
    tokenizer_fingerprint,
)
from specdec.runtime.ragged import Feed, RaggedRunner
from specdec.sampling import SamplingParams
from specdec.sessions import Session, SessionStore
from specdec.wire import PROTOCOL_VERSION, check_tokens

MAX_SESSION_ID_LEN = 128
log = logging.getLogger(__name__)


class ModelService:
    """A loaded model, its sessions and the forward loop that runs their work."""

    def __init__(
        self, role: str, cfg: ModelServiceConfig, model: Any = None, tokenizer: Any = None
    ) -> None:
        self.role = role
        self.cfg = cfg
        self.draining = False
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._enders: list[Callable[[], None]] = []
        set_threads(cfg.torch_threads)
        self.model = model
        if model is None:
            check_device(f"{role}.device", cfg.device)
            check_model_path(f"{role}.model", cfg.model)
            try:
                self.model = load_model(
                    cfg.model, cfg.device, cfg.dtype, cfg.trust_remote_code, quiet=True
                )
            except OSError as e:  # not a directory here, nor a model on the hub
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ConfigError(f"{role}.model: cannot load {cfg.model!r}: {first}") from e
        if cfg.pad_vocab:
            pad_vocab(self.model, cfg.pad_vocab, f"{role}.pad_vocab")
        self.tokenizer = tokenizer
        if tokenizer is None:
            self.tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
        # A session may not outgrow the model's table of positions (past it the forward
        # fails, and with it every session sharing that forward).
        self.max_context = min(cfg.max_context, position_limit(self.model) or cfg.max_context)
        self.runner = RaggedRunner(self.model, lean=cfg.lean_forward, fused=cfg.fused_projections)
        self.vocab_size = self.runner.vocab_size
        self.head = self._quant_head()  # before packing replaces the output layer
        self.packed_min_rows = self._pack_linears()
        self.sessions = SessionStore(self.role, cfg.max_sessions)
        kernels.warm()  # compiled, or loaded from numba's disk cache, before any request
        # (a draft's one-token passes in one compiled call, where its check agrees)
        self.decode_kernel = (
            role == "draft" and cfg.decode_kernel and self.runner.use_decode_kernel()
        )
        self._batch_sessions = metrics.BATCH_SESSIONS.labels(role)
        self._batch_tokens = metrics.BATCH_TOKENS.labels(role)
        self._queue_wait = metrics.QUEUE_WAIT.labels(role)
        self.loop = ForwardLoop(
            self.runner,
            cfg.max_batch_tokens,
            self._observe_batch,
            cfg.batch_wait_ms / 1e3,
            {"decode": cfg.decode_batch_wait_ms / 1e3, "lookahead": cfg.decode_batch_wait_ms / 1e3},
            self._threads(),
        )
        self.info = ModelInfo(
            model_id=cfg.model,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer),
            dtype=cfg.dtype,
            device=cfg.device,
            architecture=type(self.model).__name__,
            eos_token_ids=tuple(eos_token_ids(self.model)),
            max_context=self.max_context,
            model_fingerprint=model_fingerprint(cfg.model, self.model, cfg.dtype),
            server_version=specdec.__version__,
            protocol_version=PROTOCOL_VERSION,
            head_fingerprint=self.head.fingerprint if self.head is not None else "",
        )
        metrics.BUILD_INFO.labels(self.role).info(
            {
                "model_id": cfg.model,
                "dtype": cfg.dtype,
                "device": cfg.device,
                "version": specdec.__version__,
                "packed_linear_min_rows": str(self.packed_min_rows or 0),
                "lean_forward": str(self.runner.lean).lower(),
                "fused_projections": str(self.runner.fused).lower(),
                "decode_kernel": str(self.decode_kernel).lower(),
            }
        )
        self.sessions.update_gauges()
        # Create every labelled series now, so dashboards show 0 rather than nothing.
        metrics.ROLLBACKS.labels(self.role)
        metrics.ROLLED_BACK_TOKENS.labels(self.role)
        metrics.SESSION_EVICTIONS.labels(self.role, "ttl")

    def _quant_head(self) -> QuantHead | None:
        """The draft output layer of the hidden-state wire (``specdec.hidden_q``): a
        draft's own with ``hidden_q``, a target's from ``draft_head``. Read from the
        checkpoint in float32 on the CPU, so that both sides quantize the same
        numbers whatever dtype and device they serve in."""
        cfg = self.cfg
        path = cfg.draft_head if self.role == "target" else cfg.model if cfg.hidden_q else ""
        if not path:
            return None
        field = "draft_head" if self.role == "target" else "hidden_q"
        same = path == cfg.model and self._float32_on_cpu()
        weight = None
        try:
            trust = cfg.trust_remote_code
            if same:
                model = self.model
            elif (alone := load_output_layer(path, trust_remote_code=trust)) is not None:
                model, weight = alone  # the output layer only: the model on the meta device
            else:
                model = load_model(path, trust_remote_code=trust)
        except (OSError, ValueError) as e:
            raise Unsupported(f"{self.role}.{field}: cannot load a model from {path}: {e}") from e
        head = QuantHead.of_model(model, weight)
        if head is None:
            raise Unsupported(
                f"{self.role}.{field}: {path} has no plain linear output layer (a bias, a "
                "logit soft-cap or scaling); the hidden-state wire cannot derive its q"
            )
        log.info("%s: hidden-state wire head %s (%d x %d)", self.role, head.fingerprint[:12],
                 head.vocab, head.dim)  # fmt: skip
        head = head.to(cfg.device)  # its product runs beside the model's passes
        # The target derives a verify's gamma positions in one product: packed once.
        return head.packed() if self.role == "target" else head

    def _threads(self) -> tuple[int, int]:
        """The forward loop's torch threads: (usual, for a pass of plain decoding steps
        alone); (0, 0) leaves them as set (``plain_torch_threads``: CPU only)."""
        plain = self.cfg.plain_torch_threads
        if not plain or device_kind(self.cfg.device) != "cpu":
            return 0, 0
        return self.cfg.torch_threads, plain  # (0: the loop reads torch's own count)

    def _float32_on_cpu(self) -> bool:
        p = next(self.model.parameters())
        return p.dtype == torch.float32 and p.device.type == "cpu"

    def _pack_linears(self) -> int | None:
        """On the CPU, multiply with weights packed for oneDNN from the pass size where
        that is faster (``specdec.runtime.packed_linear``); returns it, or None."""
        cfg = self.cfg
        if not cfg.packed_linear:
            return None
        rows = min(max(packed_linear.CALIBRATION_ROWS), cfg.max_batch_tokens, self.max_context)
        # (fused passes, if any, stop where packed ones start: pack_model)
        choice, timings = packed_linear.pack_model(
            self.model, self.runner, rows, cfg.packed_linear_min_rows
        )
        if choice is None and not timings:  # not on this device or dtype, or it failed
            return None
        log.info(
            "%s: oneDNN linear for passes of %s (stock / packed ms by tokens per pass: %s)",
            self.role,
            f"{choice}+ tokens" if choice else "no size: off",
            ", ".join(f"{r}: {1e3 * a:.2f}/{1e3 * b:.2f}" for r, (a, b) in timings.items()),
        )
        return choice

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Start the forward loop (on the running event loop)."""
        self.loop.start()

    def begin_drain(self) -> None:
        """From now on, refuse new sessions; existing ones are served to the end."""
        self.draining = True

    def idle(self) -> bool:
        return len(self.sessions) == 0

    def on_drained(self, end: Callable[[], None]) -> None:
        """Also run ``end`` when a drain finds no session left (``end_idle_streams``)."""
        self._enders.append(end)

    def end_idle_streams(self) -> None:
        """Drained: end the streams its edge holds open between requests (a draft's
        relay), so that the server stops now, not at the end of the grace period."""
        for end in self._enders:
            end()

    def on_close(self, close: Callable[[], Awaitable[None]]) -> None:
        """Also run ``close`` when the service closes (its edge's client channels)."""
        self._closers.append(close)

    async def aclose(self) -> None:
        for close in self._closers:
            await close()
        self.sessions.clear()
        await self.loop.aclose()

    def _observe_batch(self, b: BatchStats) -> None:
        kind = b.kinds[0] if all(k == b.kinds[0] for k in b.kinds) else "mixed"
        metrics.labelled(metrics.FORWARD_DURATION, self.role, kind).observe(b.seconds)
        metrics.labelled(metrics.TOKENS_PROCESSED, self.role, kind).inc(b.tokens)
        if b.wide:
            metrics.labelled(metrics.WIDE_PASSES, self.role, kind).inc()
        self._batch_sessions.observe(b.sessions)
        self._batch_tokens.observe(b.tokens)
        for wait in b.queue_waits:
            self._queue_wait.observe(wait)

    # ---- validation ------------------------------------------------------------------
    def check_tokens(self, field: str, tokens, min_len: int = 0) -> list[int]:
        return check_tokens(field, tokens, self.vocab_size, min_len)

    def check_room(self, field: str, needed: int) -> None:
        require(
            needed <= self.max_context,
            field,
            f"the session would hold {needed} tokens, over max_context {self.max_context}",
        )

    def roll_back_to(self, session: Session, cache_len: int) -> int:
        """Trim the cache to ``cache_len`` (which it must hold); returns tokens dropped."""
        require(cache_len >= 0, "cache_len", f"must be >= 0, got {cache_len}")
        if cache_len > session.length:
            raise FailedPrecondition(
                f"cache_len: expected {cache_len} cached tokens but session "
                f"{session.session_id!r} holds {session.length}"
            )
        removed = session.kv.truncate(cache_len)
        if removed:
            metrics.labelled(metrics.ROLLBACKS, self.role).inc()
            metrics.labelled(metrics.ROLLED_BACK_TOKENS, self.role).inc(removed)
        return removed

    # ---- the shared operations ---------------------------------------------------------
    async def open(
        self, session_id: str, tokens, params: SamplingParams, extra: Any = None
    ) -> Session:
        """A new session with ``tokens`` prefilled."""
        if self.draining:
            raise Unavailable(f"{self.role}: shutting down, not opening new sessions")
        require(
            0 < len(session_id) <= MAX_SESSION_ID_LEN,
            "session_id",
            f"must be 1..{MAX_SESSION_ID_LEN} characters",
        )
        tokens = self.check_tokens("tokens", tokens)
        self.check_room("tokens", len(tokens))
        session = Session(session_id, params, extra=extra)
        self.sessions.add(session)
        try:
            if tokens:
                await self.run(self._prefill(session, tokens), "prefill")
        except BaseException:
            self.sessions.remove(session)
            raise
        return session

    def _prefill(self, session: Session, tokens: list[int]) -> Job:
        yield Feed(session.kv, tokens, 0)

    async def run(self, job: Job, kind: str, wide: bool = False) -> Any:
        return await self.loop.run(job, kind, wide)

    def rollback(self, session: Session, cache_len: int) -> int:
        return self.roll_back_to(session, cache_len)

    def close(self, session: Session) -> bool:
        self.loop.forget(session.kv)
        return self.sessions.remove(session)

    def expired(self, session: Session, reason: str = "ttl") -> None:
        """A session freed because its stream went idle."""
        metrics.SESSION_EVICTIONS.labels(self.role, reason).inc()
        self.close(session)
