"""The orchestrator's domain: admission, then one request's loop

    propose (draft) -> verify (target) -> settle (accept/reject, move cursors) -> stream

applying rejection sampling with its own uniforms. The step itself is pure
(``orchestrator.step``); the draft and target are reached through ports
(``orchestrator.ports``), wrapped in ``orchestrator.resilience`` for
re-prefill, failover and fallback. The engine owns each request's
authoritative token history.
Not for: protobuf or status codes (``orchestrator.servicer`` is the edge).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import specdec
from specdec import metrics, tracing
from specdec.config import MAX_GAMMA, Config
from specdec.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    ResourceExhausted,
    Unavailable,
)
from specdec.rng import generator, seeds
from specdec.runtime.loading import (
    ModelInfo,
    check_model_path,
    load_tokenizer,
    tokenizer_fingerprint,
)
from specdec.sampling import Proposal
from specdec.wire import PROTOCOL_VERSION, WireShape, drop_first

from .adaptive import CostModel, PeakLoad, RequestPolicy
from .monitor import ExactnessMonitor, emitted_terms
from .ports import DraftOn, PipelineSpec
from .replicas import ReplicaPool
from .requests import RequestSpec
from .resilience import Budget, DraftLink, TargetLink
from .step import (
    FOLLOWER,
    FRESH,
    GUESS,
    Cursor,
    ahead,
    paced_draws,
    pipeline_draws,
    pipeline_gamma,
    settle,
)
from .text import TextStream

log = logging.getLogger(__name__)
# How long start-up waits for a draft once a target answers (within connect_timeout_s).
DRAFT_WAIT_S = 60.0


@dataclass
class Chunk:
    """Newly accepted output: its text and its token ids (they agree)."""

    text: str
    token_ids: list[int]


@dataclass
class Stats:
    """One request's statistics."""

    prompt_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    judged: int = 0
    steps_s: float = 0.0
    draft_forward_s: float = 0.0
    target_forward_s: float = 0.0
    generated: int = 0
    round_trips: int = 0
    wire_bytes: int = 0
    fallback_steps: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = "length"
    gamma: int = 0
    adaptive: bool = False
    mean_gamma: float = 0.0
    overlapped_steps: int = 0
    fallback_reasons: set = field(default_factory=set)


@dataclass
class Piped:
    """A pipeline the request follows (``Generation.follow``): its key and gamma, the
    step whose verdict comes next, and the kinds of block that step may be
    (``step.FRESH``, ``FOLLOWER``, ``GUESS``), each with draws of its own. A greedy
    step leaves two: after it accepted every draft, its follower is used only if
    the bonus is the follower's first token; after a rejection, a guess only if it
    guessed the token drawn there. This engine learns which from the next verdict's
    seed (``matched``: the draft's cursor if that is the follower)."""

    key: int
    gamma: int
    pit: bool
    depth: int = 1  # blocks drafted ahead at most (0: paced, ``orchestrator.paced``)
    # Paced: the next block's verify seed and uniforms, from the request's own stream
    # (``Generation.rng``) as an asked step draws them.
    seed: int = 0
    u: tuple[float, ...] = ()
    index: int = 0
    kinds: tuple[int, ...] = (FRESH,)
    matched: Cursor | None = None
    rejected_at: int = 0  # greedy: the draft the last verdict rejected (1-based)
    # Adaptive: a retune in flight or (paced) not yet reached (``Generation.retune``):
    # the draft's answer (the block it applies from) and the gamma asked for.
    retune: tuple[asyncio.Task, int] | None = None


class Orchestrator:
    """Pools of draft and target replicas, admission control, and the requests."""

    def __init__(
        self,
        cfg: Config,
        tokenizer=None,
        target_pool: ReplicaPool | None = None,
        draft_pool: ReplicaPool | None = None,
    ) -> None:
        self.cfg = cfg
        o = cfg.orchestrator
        if tokenizer is None:
            key = "orchestrator.tokenizer" if o.tokenizer else "target.model"
            check_model_path(key, o.tokenizer or cfg.target.model)
            tokenizer = load_tokenizer(o.tokenizer or cfg.target.model)
        self.tokenizer = tokenizer
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self._slots = asyncio.Semaphore(o.max_concurrent_requests)
        self.live = 0
        self._load = PeakLoad()  # what the check against plain decoding sees (load())
        self.queued = 0
        self._background: set[asyncio.Task] = set()
        self.draining = False
        self._resolver: asyncio.Task | None = None
        self.target_pool = target_pool
        self.draft_pool = draft_pool
        self._local: list = []  # model services in this process (local_pools)
        self.target_info: ModelInfo | None = None
        self.draft_info: ModelInfo | None = None
        self.cost = CostModel(
            max_gamma=o.max_gamma,
            check_min_requests=o.adaptive_plain_check_min_requests,
            count_lead=o.adaptive_draft_lead,
            explore_tokens=o.adaptive_explore_tokens,
            explore_per_request=o.adaptive_explore_per_request,
            overlap_max_requests=o.adaptive_overlap_max_requests,
            speculate_max_requests=o.adaptive_speculate_max_requests,
        )
        self.monitor = ExactnessMonitor(o.monitor_fraction, o.monitor_window)
        for stage in ("propose", "verify", "rollback", "orchestrator"):
            metrics.STAGE_DURATION.labels(stage)
        for peer in ("draft", "target"):
            metrics.ROUND_TRIPS.labels(peer)

    # ---- lifecycle -------------------------------------------------------------------
    def remote_pools(self) -> None:
        """Pools of gRPC replicas at the configured addresses."""
        from specdec.transport.channels import open_channel

        from .ports.remote import RemoteDraft, RemoteTarget

        o = self.cfg.orchestrator

        def channel(address: str):
            return open_channel(address, o.upstream_tls, o.max_message_bytes, o.keepalive_s)

        self.target_pool = ReplicaPool(
            "target",
            o.target_address,
            lambda a: RemoteTarget(channel(a)),
            o.draft_retry_after_s,
            o.draft_retry_max_s,
            self.check_target,
        )
        self.draft_pool = ReplicaPool(
            "draft",
            o.draft_address,
            lambda a: RemoteDraft(channel(a)),
            o.draft_retry_after_s,
            o.draft_retry_max_s,
            self.check_draft,
        )

    def local_pools(self) -> None:
        """The draft and the target loaded into this process and called directly
        (``orchestrator.local_models``)."""
        from draft_service.drafter import Drafter
        from target_service.verifier import Verifier

        from .ports.local import local_pools

        cfg, o = self.cfg, self.cfg.orchestrator
        # Each model service sets the process's torch threads as it loads: the
        # target, loaded last, has the last word.
        drafter = Drafter(cfg.draft)
        verifier = Verifier(cfg.target)
        self._local = [verifier, drafter]
        for svc in self._local:
            svc.start()
        self.target_pool, self.draft_pool = local_pools(
            drafter, verifier, o.draft_retry_after_s, o.draft_retry_max_s
        )

    async def connect(self) -> None:
        """Find the replicas, wait for a target (and a draft), check they can cooperate."""
        o = self.cfg.orchestrator
        if self.target_pool is None:
            self.local_pools() if o.local_models else self.remote_pools()
        self.target_pool.check = self.check_target
        self.draft_pool.check = self.check_draft
        # A breaker's trial is an open (prefill) and one call, each within its timeout.
        self.target_pool.trial_s = 2 * o.target_timeout_s
        self.draft_pool.trial_s = 2 * o.draft_timeout_s
        self.target_info = await self.target_pool.wait_ready(o.connect_timeout_s)
        try:
            # A draft that is not there yet costs at most DRAFT_WAIT_S more: the target
            # alone serves, and the resolver takes the draft up when it answers.
            wait = min(o.connect_timeout_s, DRAFT_WAIT_S)
            self.draft_info = await self.draft_pool.wait_ready(wait)
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
                    self.draft_info = self.draft_pool.first_info()
                self.update_speculation_gauge()
            except Exception:  # never let a resolver hiccup stop the service
                log.exception("refreshing replicas failed")

    def hidden_wire(self) -> bool:
        """Whether sampled q can go as hidden states (``specdec.hidden_q``): the draft
        serves its output layer's codes and the target holds the same layer."""
        d, t = self.draft_info, self.target_info
        return bool(
            self.cfg.orchestrator.wire_hidden
            and d is not None
            and t is not None
            and d.head_fingerprint
            and d.head_fingerprint == t.head_fingerprint
        )

    def update_speculation_gauge(self) -> None:
        metrics.SPECULATION_ENABLED.set(1 if self.draft_pool.any_usable() else 0)

    def check_target(self, t: ModelInfo) -> None:
        """A target replica must speak our protocol, use our tokenizer, and agree with
        the others on vocabulary and EOS (replicas of another model are kept apart by
        their fingerprint, never mixed within a request)."""
        if t.protocol_version != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"target {t.model_id} speaks protocol {t.protocol_version}, "
                f"this orchestrator {PROTOCOL_VERSION} (server version {t.server_version})"
            )
        if self.fingerprint != t.tokenizer_fingerprint:
            raise FailedPrecondition(
                f"tokenizer: the orchestrator's tokenizer differs from target {t.model_id}'s "
                f"({self.fingerprint[:12]} vs {t.tokenizer_fingerprint[:12]})"
            )
        first = self.target_info
        if first is not None and (first.vocab_size, first.eos_token_ids) != (
            t.vocab_size,
            t.eos_token_ids,
        ):
            raise FailedPrecondition(
                f"target {t.model_id} differs from the other targets in vocabulary or EOS"
            )

    def check_draft(self, d: ModelInfo) -> None:
        """Refuse a draft that does not share the target's vocabulary."""
        t = self.target_info
        problems = []
        if d.protocol_version != PROTOCOL_VERSION:
            problems.append(
                f"protocol draft {d.protocol_version} != orchestrator {PROTOCOL_VERSION}"
            )
        if d.vocab_size != t.vocab_size:
            hint = ""
            if d.vocab_size < t.vocab_size:  # checkpoints of one family padded differently
                hint = f" (a draft of the same tokenizer: set draft.pad_vocab: {t.vocab_size})"
            problems.append(f"vocab_size draft {d.vocab_size} != target {t.vocab_size}{hint}")
        if d.tokenizer_fingerprint != t.tokenizer_fingerprint:
            problems.append(
                f"tokenizer fingerprint draft {d.tokenizer_fingerprint[:12]} != "
                f"target {t.tokenizer_fingerprint[:12]}"
            )
        if problems:
            raise FailedPrecondition(
                f"draft {d.model_id} and target {t.model_id} cannot be paired: "
                + "; ".join(problems)
            )

    def begin_drain(self) -> None:
        """From now on, refuse new requests; running ones finish."""
        self.draining = True

    def load(self) -> int:
        """Requests generating at once, as the check against plain decoding counts
        them: the most in about the last second (``adaptive.PeakLoad``)."""
        return self._load.value(self.live, time.monotonic())

    def idle(self) -> bool:
        return self.live == 0 and self.queued == 0 and not self._background

    def end_idle_streams(self) -> None:
        """Nothing to end: a client's stream is its request."""

    async def aclose(self) -> None:
        for task in list(self._background):
            await asyncio.wait([task], timeout=2.0)
        if self._resolver is not None:
            self._resolver.cancel()
        for pool in (self.draft_pool, self.target_pool):
            if pool is not None:
                await pool.aclose()
        for svc in self._local:
            await svc.aclose()

    def spawn(self, coro) -> None:
        """Run ``coro`` in the background, surviving the caller's cancellation."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- requests --------------------------------------------------------------------
    async def generate(
        self, spec: RequestSpec, start: float, deadline: float | None = None
    ) -> AsyncIterator[Chunk | Stats]:
        """Admission control, then one Generation. ``deadline`` is time.monotonic()-based."""
        if self.draining:
            raise Unavailable("orchestrator: shutting down, not taking new requests")
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
            if deadline is None:
                await self._slots.acquire()
            else:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._slots.acquire()
        except TimeoutError:
            raise DeadlineExceeded(
                f"deadline: the request's deadline passed while it was queued ({self.live} "
                f"generating, at max_concurrent_requests={o.max_concurrent_requests})"
            ) from None
        finally:
            self.queued -= 1
            metrics.QUEUED_REQUESTS.set(self.queued)
        self.live += 1
        self._load.set(self.live, time.monotonic())
        metrics.LIVE_REQUESTS.set(self.live)
        # The loop runs as its own task and hands chunks over a queue: sending a
        # chunk to the client overlaps the next step's calls instead of delaying them.
        queue: asyncio.Queue = asyncio.Queue()
        producer = asyncio.get_running_loop().create_task(
            _produce(Generation(self, spec, start, deadline).run(), queue)
        )
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not producer.done():
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)
            self.live -= 1
            self._load.set(self.live, time.monotonic())
            metrics.LIVE_REQUESTS.set(self.live)
            self._slots.release()


_END = object()


def fallback_seed(seed: int) -> int:
    """The seed of a verify sent after a relay with ``seed`` went unconfirmed: never
    that seed (its verdict may still come, and is told apart by its seed), and a
    function of it, so that a request's output still depends only on its own seed."""
    return (seed * 0x9E3779B97F4A7C15 + 1) % (1 << 64) or 1


async def _produce(items: AsyncIterator, queue: asyncio.Queue) -> None:
    """Put every item of ``items`` on ``queue``, then _END (or the exception)."""
    try:
        async for item in items:
            queue.put_nowait(item)
    except asyncio.CancelledError:
        # Cancelled by the consumer (which is gone: harmless), or a CancelledError from
        # inside (grpc.aio raises one from a call cancelled under its reader): the
        # consumer must not wait on the queue for ever.
        queue.put_nowait(Internal("the request's generation was cancelled from inside"))
        raise
    except Exception as e:
        queue.put_nowait(e)
    else:
        queue.put_nowait(_END)


class Generation:
    """One request: its history, its two links, its loop and its bookkeeping."""

    def __init__(
        self, orch: Orchestrator, spec: RequestSpec, start: float, deadline: float | None
    ) -> None:
        o = orch.cfg.orchestrator
        self.orch = orch
        self.o = o
        self.spec = spec
        self.start = start
        self.sid = uuid.uuid4().hex
        self.history = list(spec.prompt)
        self.pushed = 0  # tokens handed to the text stream (sent or held back)
        self.rng = generator(spec.seed)
        # The next step's draft seed is drawn a step early: a draft drafting on
        # (``DraftOn``) starts the next proposal before this engine asks for it.
        self.next_draft_seed = seeds(self.rng)[0]
        self.stats = Stats(prompt_tokens=len(spec.prompt), gamma=spec.gamma or 0)
        self.policy = RequestPolicy(orch.cost, spec.gamma, spec.overlap, greedy=spec.params.greedy)
        # The next step's (gamma, overlap), chosen a step early when the draft drafts on:
        # its head start is then what the next propose asks for (``choose_next``).
        self.next_choice: tuple[int, bool] | None = None
        self.ahead: Proposal | None = None  # the next draft, drafted during the last verify
        self.pipe: Piped | None = None  # the pipeline this request follows, if any
        self.gammas: collections.Counter = collections.Counter()
        self.text = TextStream(orch.tokenizer, spec.stops, spec.prompt)
        self.eos = set(orch.target_info.eos_token_ids)
        budget = Budget(deadline, o.draft_timeout_s, o.target_timeout_s)
        common = (self.sid, self.history, spec.params, budget, self, orch.spawn)
        self.target = TargetLink(
            orch.target_pool, *common, retry_s=o.target_retry_s, relay_timeout_s=o.relay_timeout_s
        )
        self.draft: DraftLink | None = None
        if spec.max_gamma > 0 and spec.max_new_tokens > 1:
            wire_k = 0 if spec.dense else o.wire_top_k
            shape = WireShape(
                wire_k,
                0.0 if spec.dense else o.wire_eps,
                30 if spec.dense else 16,
                hidden=not spec.dense and not spec.params.greedy and orch.hidden_wire(),
            )
            self.draft = DraftLink(
                orch.draft_pool,
                *common,
                shape=shape,
                on_fallback=self.fallback,
                on_recovered=orch.update_speculation_gauge,
            )

    # ---- bookkeeping -----------------------------------------------------------------
    def count(self, peer: str, sent: int, received: int) -> None:
        """Every call to a model service reports its bytes here (WireCounter)."""
        self.stats.round_trips += 1
        self.stats.wire_bytes += sent + received
        metrics.labelled(metrics.ROUND_TRIPS, peer).inc()
        metrics.labelled(metrics.WIRE_BYTES, peer, "sent").inc(sent)
        metrics.labelled(metrics.WIRE_BYTES, peer, "received").inc(received)

    def fallback(self, reason: str) -> None:
        """A step decoded by the target alone because the draft is unavailable."""
        self.stats.fallback_steps += 1
        self.stats.fallback_reasons.add(reason)
        metrics.labelled(metrics.FALLBACK_STEPS, reason).inc()
        self.orch.update_speculation_gauge()

    # ---- the loop --------------------------------------------------------------------
    async def open(self) -> None:
        """Prefill both caches concurrently; the draft only when the first step may
        draft. A request that starts plain (an adaptive one in a plain epoch of the
        check, or above ``adaptive_speculate_max_requests``) opens its draft on its
        first drafting step, if any: under the load
        where plain decoding leads, its draft prefill would only take cores from the
        others' decoding."""
        if self.draft is None or self.policy.plain_now():
            return await self.target.open()
        target = asyncio.ensure_future(self.target.open())
        try:
            await self.draft.prefill()
        except asyncio.CancelledError:  # the request is gone: its target prefill too
            target.cancel()
            await asyncio.gather(target, return_exceptions=True)
            raise
        except BaseException:
            await target
            raise
        await target

    async def step(self) -> list[int]:
        """One speculation step; returns the tokens it emits.

        With overlap, the draft drafts the next block while the target verifies
        this one, from ``ahead(cursor, drafts)``: as if every draft will be
        accepted. If they all are, that block takes the bonus position (``settle``
        with ``chain``); a greedy request drafts it one token longer and uses it
        when its first token is the bonus (``ahead_first``). Otherwise it is
        discarded and the draft rolls back in its next call.
        """
        if self.pipe is not None:
            return await self.follow()
        tracing.mark("step")
        t0 = time.perf_counter()
        remaining = self.spec.max_new_tokens - self.pushed
        self.policy.pipelined = self.may_pipeline()
        self.policy.paced = self.may_pipeline(overlap=False)
        draft_seed = self.next_draft_seed
        position = self.rng.tell()  # (where a paced pipeline's draws go on from)
        ahead_seed, target_seed, self.next_draft_seed = seeds(self.rng, 3)
        proposal, self.ahead = self.ahead, None
        drafted_now = proposal is None
        overlap = False
        plain_run = self.plain_run(remaining)  # tokens of this step if it is plain
        pit = not self.spec.params.greedy and self.orch.monitor.sample_step()
        relayed = relay_idle = False
        u: list[float] = []  # the acceptance test's uniforms, drawn before any draft
        chosen, self.next_choice = self.next_choice, None
        if proposal is None:
            if chosen is None or self.policy.guard is not None:
                # (a choice made before the check against plain decoding took over
                # at this load is not this step's: the check's epoch decides)
                chosen = self.policy.choose(remaining - 1, plain_run)
            gamma = min(chosen[0], remaining - 1)
            overlap = chosen[1] and gamma > 0
            if gamma and self.draft is not None:
                if not self.draft.prefilled:  # started plain: open the draft now
                    await self.draft.prefill()
                    t0 = time.perf_counter()  # a one-off, not this step's cost
                u = self.rng.random(gamma)
                # The draft sends the proposal straight to the target when it can.
                relay = None
                if self.o.relay and not self.spec.dense and self.relay_pays():
                    relay_idle = self.draft_rests(overlap)
                    relay = self.target.relay_to(target_seed, pit, relay_idle)
                    # The draft drafts the next step on the target's echo, as it will
                    # be asked for: that step's gamma, chosen now (``choose_next``; a
                    # smaller ask near the end takes its first tokens). A step that
                    # drafts ahead says so: the draft then drafts on only if the verdict
                    # leaves that block unused (``DraftOn.ahead``). Not with rollbacks
                    # between steps, nor in what may be the last step.
                    wait = self.o.explicit_rollback or remaining <= gamma + 1
                    if relay is not None and self.pipelines(remaining, gamma, overlap):
                        # The draft paces the steps from here (``follow``); a sequential
                        # step's pipeline drafts nothing ahead (``orchestrator.paced``).
                        depth = self.o.pipeline_depth if overlap else 0
                        stream = (0, 0)
                        if depth:  # every step's draws from the pipeline's key
                            key = seeds(self.rng)[0] or 1
                            draft_seed, target_seed, _ = pipeline_draws(key, 0, FRESH, 0)
                        else:  # paced: this step's draws and the stream's after them
                            key = secrets.randbits(64) or 1  # (it only names the pipeline)
                            stream = (self.spec.seed, position)
                        relay = self.target.relay_to(target_seed, pit, relay_idle and not depth)
                        spec = PipelineSpec(key, remaining, depth, stream)
                        relay = dataclasses.replace(relay, pipeline=spec)
                        self.pipe = Piped(key, gamma, pit, depth, target_seed, tuple(u))
                        wait = True
                    wait = wait or (overlap and not self.o.draft_on_ahead)
                    if relay is not None and self.o.draft_on and not wait:
                        next_gamma = self.choose_next(remaining - gamma - 1, gamma)
                        if next_gamma:
                            on = DraftOn(tuple(u), next_gamma, self.next_draft_seed, overlap)
                            relay = dataclasses.replace(relay, draft_on=on)
                tracing.mark("propose")
                # A sampled step that drafts ahead has its residual draws guessed
                # (draft.sampled_guesses), relayed or not: the same seed, the same draws.
                guess = overlap and not self.spec.params.greedy and self.pipe is None
                proposal = await self.draft.propose(gamma, draft_seed, relay=relay, guess=guess)
                tracing.mark("proposed")
                relayed = proposal is not None and proposal.relayed
                if self.pipe is not None:
                    if relayed:  # its verdict, and those of the steps after it, will come
                        metrics.labelled(metrics.RELAYED_STEPS, "relayed").inc()
                        self.observe_draft(proposal, time.perf_counter() - t0)
                        return await self.follow(t0)
                    self.stop_pipeline()
                if relay is not None:
                    metrics.labelled(
                        metrics.RELAYED_STEPS, "relayed" if relayed else "not_relayed"
                    ).inc()
                    if not relayed:
                        # The target may have it, or still get it: it must refuse it, and
                        # its verdict must not pass for this step's (a seed of its own).
                        self.target.cancel_relay(target_seed)
                        target_seed = fallback_seed(target_seed)
        else:  # drafted during the last verify; keep drafting ahead if it pays
            overlap = self.policy.choose(remaining - 1)[1]
            u = self.rng.random(len(proposal.tokens))
        drafts = proposal.tokens if proposal is not None else []
        t1 = time.perf_counter()
        ahead_task = None
        # Greedy overlap keeps the bonus: the block drafted ahead is one token longer,
        # and used when its first token is the bonus (``settle`` with ``ahead_first``).
        match = self.spec.params.greedy
        # Tokens still wanted if every draft is accepted (and the bonus, when matched).
        left = remaining - len(drafts) - match
        if overlap and drafts and left > 1 and self.draft is not None and self.draft.session:
            next_gamma = min(self.policy.choose(left - 1)[0], MAX_GAMMA - match)
            if next_gamma:
                cursor = ahead(self.draft.cursor, drafts)
                ahead_task = asyncio.ensure_future(
                    self.draft.propose(
                        next_gamma + match, ahead_seed, ahead=cursor, guess=not match
                    )
                )
        run = 1 if drafts else plain_run
        # (A block drafted ahead in the last step may have left the draft guesses to
        # draft, for that step's rejections: they run until its next propose.)
        rests = self.draft_rests(ahead_task is not None or not drafted_now)
        try:
            verdict = await self.target.verify(
                proposal, target_seed, self.spec.dense, pit, run, draft_idle=rests
            )
        except BaseException:
            if ahead_task is not None:
                ahead_task.cancel()
            raise
        t2 = time.perf_counter()
        tracing.mark("verified")
        if verdict.drafts_dropped:  # a relayed proposal lost with its target: a plain step
            proposal, drafts, relayed = None, [], False
        u = u[: len(drafts)]  # none if the draft failed or its relay was lost
        next_proposal = await ahead_task if ahead_task is not None else None
        if next_proposal is not None and not next_proposal.tokens:
            next_proposal = None  # the draft saw the verdict reject a draft: unused
        outcome = settle(
            self.target.cursor,
            self.draft.cursor if self.draft else None,
            drafts,
            verdict,
            u,
            chain=next_proposal is not None and not match,
            ahead_first=next_proposal.tokens[0] if next_proposal is not None and match else None,
        )
        self.apply(outcome, verdict)
        if ahead_task is not None:
            metrics.labelled(
                metrics.OVERLAPPED_STEPS, "used" if outcome.chained else "discarded"
            ).inc()
        if outcome.chained:
            self.ahead = drop_first(next_proposal) if match else next_proposal
            self.stats.overlapped_steps += 1
        self.history.extend(outcome.tokens)
        t3 = time.perf_counter()
        if self.o.explicit_rollback:
            await self.target.rollback()
            # (After a chained step the draft's cache rightly holds the block drafted
            # ahead beyond its cursor: that block is the next step's.)
            if self.draft is not None and not outcome.chained:
                await self.draft.rollback()
        t4 = time.perf_counter()
        idle = relay_idle if relayed else rests  # (what the verify that ran said)
        self.observe(proposal if drafted_now else None, verdict, t1 - t0, t2 - t1, relayed, idle)
        self.orch.cost.observe_step(
            len(drafts),
            ahead_task is not None,
            self.policy.alpha,
            t4 - t0,
            run=1 if drafts else len(outcome.tokens),
            match=match,
            drafted=drafted_now,
            wide=verdict.wide,
        )
        self.policy.observe(len(drafts), outcome.accepted)
        self.record_step(len(drafts), outcome.accepted, t1 - t0, t2 - t1, t4 - t3, t4 - t0)
        tracing.mark("settled")
        return outcome.tokens

    def draft_rests(self, overlap: bool) -> bool:
        """Whether the draft does no work while this step's verify runs: the step drafts
        nothing ahead, and no other request of this orchestrator generates (their
        drafts would). The target may then run the pass on the draft's core too, where
        they share a machine (``Verify.draft_idle``)."""
        return not overlap and self.pipe is None and self.orch.load() <= 1

    def apply(self, outcome, verdict) -> None:
        """Move both cursors to where ``outcome`` leaves them, and show its emitted
        tokens to the live exactness monitor (when the verdict carries their terms)."""
        self.target.cursor = outcome.target
        if self.draft is not None:
            self.draft.cursor = outcome.draft
        if verdict.mass_above:
            self.orch.monitor.observe(
                *emitted_terms(
                    verdict.mass_above,
                    verdict.p_at,
                    outcome.drafted,
                    outcome.accepted,
                    outcome.bonus,
                )
            )

    # ---- pipelined speculation -------------------------------------------------------
    def pipelines(self, remaining: int, gamma: int, overlap: bool) -> bool:
        """Whether this step starts a pipeline (``may_pipeline``), with tokens for
        more than one step."""
        return self.may_pipeline(overlap) and remaining > gamma + 1

    def may_pipeline(self, overlap: bool = True) -> bool:
        """Whether a step that drafts ahead (``overlap``) would start a pipeline now
        (``orchestrator.pipeline``), or a sequential one a paced pipeline, which
        drafts nothing ahead (``orchestrator.paced``): its proposal relayed, at light
        load (a pipeline takes the draft's and the target's time without asking),
        drafting ahead only with a long hop to the draft (``pipeline_starts``), and
        with neither rollbacks between steps nor dense diagnostics. The adaptive
        policy prices such a step as a pipeline's."""
        o = self.o
        if not (o.pipeline if overlap else o.paced):
            return False
        return (
            o.relay
            and self.draft is not None
            and not o.explicit_rollback
            and not self.spec.dense
            and self.relay_pays()
            and (self.pipeline_starts() if overlap else self.pipeline_pays())
        )

    def pipeline_pays(self) -> bool:
        """At light load (``pipeline_max_requests``; 0: at any)."""
        limit = self.o.pipeline_max_requests
        return limit == 0 or self.orch.load() <= limit

    def pipeline_starts(self) -> bool:
        """At light load, and where the orchestrator's hop to the draft is long
        (``pipeline_min_rtt_ms``, against the cost model's measured round trip)."""
        rtt_ms = 1000 * self.orch.cost.rtt_draft_s.value
        return self.pipeline_pays() and rtt_ms >= self.o.pipeline_min_rtt_ms

    def stop_pipeline(self) -> None:
        """Stop following: the rest of the pipeline's blocks are refused (the target
        drops those that no longer follow its last verify in any case), and the
        draft stops at this request's next call."""
        pipe, self.pipe = self.pipe, None
        if pipe is None:
            return
        self.target.cancel_relay(pipe.key)
        c = self.target.cursor
        if not c.pending:  # p for the next position was kept by a pass since redone
            self.target.cursor = Cursor(c.cache_len - 1, (self.history[c.cache_len - 1],))

    async def follow(self, t0: float | None = None) -> list[int]:
        """One pipelined step: its verdict comes unasked; settle it as the draft and
        the target do (``step.pipeline_draws``, ``step.pipeline_gamma``). ``t0``: when
        the step started (the pipeline's first: its propose)."""
        pipe = self.pipe
        t0 = time.perf_counter() if t0 is None else t0
        remaining = self.spec.max_new_tokens - self.pushed
        if pipe.index and not self.pipeline_pays():  # others generate: steps as asked
            self.stop_pipeline()
            return await self.step()
        tracing.mark("follow")
        index = pipe.index
        if not pipe.depth:  # paced: the draws an asked step makes, in the same order
            if index:
                gamma = await self.paced_gamma(pipe, index)
                if gamma is None:  # a retune failed: the draft's gamma is not known
                    self.stop_pipeline()
                    return await self.step()
                g = pipeline_gamma(remaining, gamma)
                pipe.seed, self.next_draft_seed, u = paced_draws(self.rng, g)
                pipe.u = tuple(u)
            expected = {pipe.seed: FRESH}
        else:
            expected = {pipeline_draws(pipe.key, index, k, 0)[1]: k for k in pipe.kinds}
        seed = fallback_seed(next(iter(expected)))  # (a plain step's, if the pipeline is lost)
        try:
            verdict = await self.target.verify(
                None,
                seed,
                False,
                pipe.pit,
                follow=(*expected,),
                draft_ended=self.draft.ended() if self.draft is not None else None,
            )
        except BaseException:
            self.stop_pipeline()
            raise
        t1 = time.perf_counter()
        match = self.spec.params.greedy
        if verdict.drafts_dropped:  # lost with its relay: a plain step on a new session
            self.pipe = None
            drafts, u, nxt, kind = [], [], 0, FRESH
        else:
            kind = expected[verdict.seed]
            if GUESS in expected.values():  # the block before was rejected
                self.orch.cost.observe_guess_cover(kind == GUESS, pipe.rejected_at)
            if kind == FOLLOWER and pipe.matched is not None:  # the greedy block before matched
                self.draft.cursor = pipe.matched
            drafts = verdict.drafts
            if pipe.depth:
                u = pipeline_draws(pipe.key, index, kind, len(drafts))[2]
            else:
                u = list(pipe.u[: len(drafts)])
            nxt = pipeline_gamma(remaining - len(drafts) - match, pipe.gamma, match)
            if verdict.cache_len != self.target.cursor.end + len(drafts):
                self.stop_pipeline()
                raise Internal(
                    f"pipeline: a verdict at cache length {verdict.cache_len}, expected "
                    f"{self.target.cursor.end + len(drafts)}"
                )
        draft_before = self.draft.cursor if self.draft is not None else None
        chains = bool(nxt) and not match and pipe.depth > 0  # (a follower takes the bonus)
        outcome = settle(self.target.cursor, draft_before, drafts, verdict, u, chain=chains)
        self.apply(outcome, verdict)
        self.history.extend(outcome.tokens)
        if self.pipe is not None:
            left = remaining - len(outcome.tokens)
            pipe.index += 1
            pipe.matched = None
            if not pipe.depth:  # nothing drafted ahead: every block is drafted after a verdict
                pipe.kinds = (FRESH,)
            elif outcome.chained:
                pipe.kinds = (FOLLOWER,)
            elif match and drafts and outcome.accepted == len(drafts) and nxt:
                pipe.kinds = (FOLLOWER, FRESH)
                pipe.matched = Cursor(draft_before.end + len(drafts), (verdict.bonus_token,))
            elif match and drafts:  # a rejection: the draft may have guessed its token
                pipe.kinds = (FRESH, GUESS)
                pipe.rejected_at = outcome.accepted + 1
            else:
                pipe.kinds = (FRESH,)
            if kind != FRESH:  # this block was drafted while the one before was verified
                self.stats.overlapped_steps += 1
                metrics.labelled(metrics.OVERLAPPED_STEPS, "used").inc()
            if not pipeline_gamma(left, pipe.gamma):  # the pipeline drafts no more
                self.pipe = None
            else:
                self.retune(pipe, left)
        t2 = time.perf_counter()
        self.observe(None, verdict, 0.0, t1 - t0, relayed=True)
        if index and kind == FRESH:  # drafted after the verdict before it: on the path
            self.stats.draft_forward_s += verdict.draft_forward_s
        if index and drafts:  # (the first block's time includes its propose)
            self.orch.cost.observe_step(
                len(drafts),
                pipe.depth > 0,
                self.policy.alpha,
                t2 - t0,
                match=match,
                drafted=kind == FRESH,
                pipelined=True,
                wide=verdict.wide,
            )
        self.policy.observe(len(drafts), outcome.accepted)
        self.record_step(len(drafts), outcome.accepted, 0.0, t1 - t0, 0.0, t2 - t0)
        tracing.mark("settled")
        return outcome.tokens

    def retune(self, pipe: Piped, left: int) -> None:
        """An adaptive request's choice after a verdict of its pipeline, as its next
        asked step would make it (``left`` tokens still wanted): a gamma other than
        the pipeline's is sent to the draft (``DraftLink.retune``), which drafts every
        block after it with the new gamma. Paced (``orchestrator.paced_retune``):
        from its next undecided block on (the block after this verdict is drafted
        already, as its echo came), whose index it answers (``paced_gamma``).
        Drafting ahead (``orchestrator.pipeline_retune``): this engine reads each
        block's length from its verdict, so it waits for no answer. One retune at a
        time; a choice of plain decoding, or of the other kind of step (drafting
        ahead or not), leaves the pipeline as it is."""
        on = self.o.pipeline_retune if pipe.depth else self.o.paced_retune
        if not on or self.policy.gamma is not None or self.draft is None:
            return
        if pipe.retune is not None:
            if not pipe.depth or not pipe.retune[0].done():  # (paced: ``paced_gamma``)
                return
            pipe.retune = None
        gamma, overlap = self.policy.choose(left - 1, self.plain_run(left))
        # (near the end the choice is cut to the tokens left, as the blocks are anyway)
        if gamma and overlap == bool(pipe.depth) and gamma != min(pipe.gamma, left - 1):
            pipe.retune = (self.draft.retune(gamma), gamma)
            metrics.PIPELINE_RETUNES.inc()
            if pipe.depth:
                pipe.gamma = gamma

    async def paced_gamma(self, pipe: Piped, index: int) -> int | None:
        """The gamma the draft drafted the paced pipeline's block ``index`` with: the
        pipeline's, or a retune's from the block the draft said it applies from
        (waiting for its answer, which comes at once). None: a retune failed."""
        if pipe.retune is None:
            return pipe.gamma
        task, gamma = pipe.retune
        try:
            start = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                return None
            raise
        except Exception:  # (the pipeline's own wait sees a dead draft)
            return None
        if not start:  # no paced pipeline ran there any more: nothing changed
            pipe.retune = None
        elif index >= start:
            pipe.gamma, pipe.retune = gamma, None
        return pipe.gamma

    def choose_next(self, remaining: int, gamma: int) -> int:
        """The gamma the draft drafts on with, for a next step that has at least
        ``remaining`` tokens left: this step's ``gamma`` for a fixed one, the
        policy's choice for an adaptive one, made now and kept for that step
        (``next_choice``). Drafting on a gamma the next step does not ask for would be
        discarded, and an adaptive choice moves from step to step. 0: it will be
        plain. Not under the check against plain decoding, whose epochs change arms
        between steps."""
        if self.policy.gamma is not None or self.policy.guard is not None:
            return gamma
        self.next_choice = self.policy.choose(remaining - 1, self.plain_run(remaining))
        return self.next_choice[0]

    def relay_pays(self) -> bool:
        """Whether to relay this step's proposal: at light load, where the hop it saves
        is on the critical path (``relay_max_requests``; 0: always)."""
        limit = self.o.relay_max_requests
        return limit == 0 or self.orch.load() <= limit

    def plain_run(self, remaining: int) -> int:
        """Tokens the target draws in a row if this step is plain (no draft): up to
        ``plain_run_tokens`` (``plain_run_tokens_busy`` while other requests generate
        too), and at most one more than the request has emitted so far (1, 2, 4, 8,
        ...: the first tokens come as early as one at a time would give them). A run
        saves a round trip per token, and under load keeps the session in the
        target's shared passes. Never for dense diagnostics."""
        if self.spec.dense:
            return 1
        o = self.o
        most = o.plain_run_tokens_busy if self.orch.load() >= 2 else o.plain_run_tokens
        return max(1, min(remaining, most, self.pushed + 1))

    def observe(
        self,
        drafted,
        verdict,
        t_propose: float,
        t_verify: float,
        relayed: bool = False,
        idle: bool = False,
    ) -> None:
        """Feed the cost model with this step's measured times. ``drafted``: the
        proposal drafted in this step (None when it was drafted during the last
        verify, whose time overlapped). ``relayed``: the verify started at the target
        before the proposal's reply came back here, so ``t_verify`` says nothing of
        the target's round trip (the step's calibration still sees the whole).
        ``idle``: the verify said the draft is idle (``Verify.draft_idle``)."""
        cost = self.orch.cost
        self.stats.target_forward_s += verdict.forward_s
        if drafted is not None:
            self.observe_draft(drafted, t_propose)
        cost.observe_verify(
            len(verdict.p_draft),
            t_verify,
            verdict.compute_s,
            verdict.forward_s,
            verdict.batch_tokens,
            passes=1 + len(verdict.run_tokens),
            rtt=not relayed,
            wide=verdict.wide,
            idle=idle,
        )

    def observe_draft(self, drafted, t_propose: float) -> None:
        """Feed the cost model with a propose call's times (``t_propose``: its wall
        time here)."""
        self.stats.draft_forward_s += drafted.forward_s
        self.orch.cost.observe_draft(
            len(drafted.tokens),
            t_propose,
            drafted.compute_s,
            drafted.forward_s,
            drafted.batch_tokens,
            drafted.lead_s,
        )

    def record_step(
        self, gamma: int, n: int, t_propose: float, t_verify: float, t_rb: float, total: float
    ) -> None:
        s = self.stats
        s.steps += 1
        s.steps_s += total
        s.drafted += gamma
        s.judged += n + (n < gamma)
        self.gammas[gamma] += 1
        s.accepted += n
        metrics.STEPS.inc()
        metrics.STEP_GAMMA.observe(gamma)
        if gamma:
            metrics.DRAFTED_TOKENS.inc(gamma)
            metrics.ACCEPTED_TOKENS.inc(n)
            metrics.STEP_ACCEPTED.observe(n)
            for i in range(1, gamma + 1):
                metrics.labelled(metrics.DRAFTED_BY_POSITION, metrics.position_label(i)).inc()
                if i <= n:
                    metrics.labelled(metrics.ACCEPTED_BY_POSITION, metrics.position_label(i)).inc()
            if t_propose > 0:  # (none in a pipelined step: nobody asked the draft)
                metrics.labelled(metrics.STAGE_DURATION, "propose").observe(t_propose)
        metrics.labelled(metrics.STAGE_DURATION, "verify").observe(t_verify)
        if self.o.explicit_rollback:
            metrics.labelled(metrics.STAGE_DURATION, "rollback").observe(t_rb)
        metrics.labelled(metrics.STAGE_DURATION, "orchestrator").observe(
            max(0.0, total - t_propose - t_verify - t_rb)
        )

    async def run(self) -> AsyncIterator[Chunk | Stats]:
        metrics.PROMPT_TOKENS.inc(len(self.spec.prompt))
        finish = "length"
        last = self.start
        # The measured check against plain decoding, for adaptive requests: each step
        # is chosen under, and charged to, the guard of the load it starts at.
        checked = self.spec.gamma is None and self.o.adaptive_plain_check
        cost = self.orch.cost
        charged = None  # (guard, arm, tokens, start) of the last step: charged when the next starts

        def charge(until: float) -> None:
            if charged is not None:
                guard, arm, tokens, since = charged
                guard.record(arm, tokens, until - since, self.orch.load())

        try:
            opened = time.perf_counter()
            self.policy.load = self.orch.load()  # above speculate_max_requests: no draft prefill
            guard = cost.guard(self.policy.greedy, self.policy.load) if checked else None
            self.policy.guard = guard
            arm = guard.arm if guard is not None else None
            await self.open()
            if guard is not None:  # prefill waits behind the drafting of others: it counts
                charged = (guard, arm, 0, opened)
            while self.pushed < self.spec.max_new_tokens:
                began = time.perf_counter()
                charge(began)
                self.policy.load = load = self.orch.load()
                if checked:
                    self.policy.guard = cost.guard(self.policy.greedy, load)
                new = await self.step()
                guard = self.policy.guard
                charged = (guard, self.policy.arm, len(new), began) if guard is not None else None
                new = new[: self.spec.max_new_tokens - self.pushed]
                hit = next((i for i, t in enumerate(new) if t in self.eos), None)
                if hit is not None:
                    new = new[:hit]
                    finish = "eos"
                self.pushed += len(new)
                done = finish == "eos" or self.pushed >= self.spec.max_new_tokens
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
                    yield Chunk(out.text, out.token_ids)
                if done:
                    break
            self.stats.finish_reason = finish
            self.stats.total_s = time.perf_counter() - self.start
            charge(time.perf_counter())
            self.stats.adaptive = self.spec.gamma is None
            if self.stats.steps:
                self.stats.mean_gamma = self.stats.drafted / self.stats.steps
            if self.spec.gamma is None and self.gammas:
                self.stats.gamma = self.gammas.most_common(1)[0][0]
            metrics.REQUEST_DURATION.observe(self.stats.total_s)
            yield self.stats
        finally:
            for reason in self.stats.fallback_reasons:
                metrics.labelled(metrics.FALLBACK_REQUESTS, reason).inc()
            self.orch.spawn(self.close())

    async def close(self) -> None:
        """Free both sessions and unpin this request from its replicas."""
        links: list[Any] = [self.target] + ([self.draft] if self.draft else [])
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
