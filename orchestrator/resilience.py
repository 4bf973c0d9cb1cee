"""Resilience around the ports, for one request: pinning, re-prefill, failover,
fallback. The step (``orchestrator.step``) never sees any of it.

* ``DraftLink``: the draft side. A session lost by the draft (it restarted) is
  re-opened from the token history at once; an outage (unreachable, timed out)
  opens the replica's circuit breaker and the step goes on without a draft (the
  target decodes alone: still exact). Speculation resumes when a breaker allows.
  A failure of the draft on this request alone (``Internal``: a NaN in its
  logits, say) leaves the breaker to other requests and backs off this one: 1,
  2, 4, ... up to ``MAX_OWN_BACKOFF`` steps without a draft before the next try,
  since each try re-opens the session from the whole history.
* ``TargetLink``: the target side. A lost session is re-opened from the
  history; an unreachable replica is retried for ``target_retry_s`` or left
  for another replica serving the same model (equal fingerprint). A new
  request whose target cannot be reached fails at once.

Each link owns its session and its cursor; the engine replaces the cursor
with the one the step computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from specdec import metrics
from specdec.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    SessionLost,
    SpecdecError,
    Unavailable,
)
from specdec.sampling import Proposal, SamplingParams, Verdict
from specdec.wire import WireShape

from .ports import RelayTo, WireCounter
from .replicas import Replica, ReplicaPool
from .step import Cursor

log = logging.getLogger(__name__)
MAX_OWN_BACKOFF = 64  # steps a request goes without a draft after its draft kept failing


# A call whose timeout the request's deadline cut short may end this much before it.
_DEADLINE_SLACK_S = 0.01
_DEADLINE_PASSED = "deadline: the request's deadline passed while generating"


@dataclass
class Budget:
    """The deadlines of one request's calls."""

    deadline: float | None  # time.monotonic() by which the request must be done
    draft_timeout_s: float
    target_timeout_s: float

    def left(self, configured: float) -> float:
        """Seconds one call may take: its configured timeout, within the request's deadline."""
        if self.deadline is None:
            return configured
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(_DEADLINE_PASSED)
        return min(configured, left)

    def passed(self, within: float = 0.0) -> bool:
        """Whether the request's deadline passed (or is less than ``within`` s off: a
        call whose timeout the deadline cut short may end a hair before it)."""
        return self.deadline is not None and time.monotonic() >= self.deadline - within


class _Link:
    """What both links share: a pinned replica, a session, a cursor, the history."""

    role = ""

    def __init__(
        self,
        pool: ReplicaPool,
        session_id: str,
        history: list[int],
        params: SamplingParams,
        budget: Budget,
        counter: WireCounter | None,
        spawn: Callable,
    ) -> None:
        self.pool = pool
        self.session_id = session_id
        self.history = history  # the request's authoritative history (read only here)
        self.params = params
        self.budget = budget
        self.counter = counter
        self.spawn = spawn  # runs a coroutine that must outlive a cancelled request
        self.replica: Replica | None = None
        self.trial = 0.0  # its replica's trial, as its breaker's token (0.0: none)
        self.session = None
        self.cursor: Cursor | None = None

    def pin(self, replica: Replica) -> None:
        if replica is not self.replica:
            self.unpin()
            replica.pinned += 1
            self.replica = replica
        if not self.trial:
            self.trial = replica.breaker.claim()

    def unpin(self) -> None:
        if self.replica is not None:
            if self.trial:  # leaving without an outcome: another request may try
                self.replica.breaker.release(self.trial)
                self.trial = 0.0
            self.replica.pinned -= 1
            self.replica = None

    def _success(self) -> bool:
        """A call to the pinned replica succeeded; True if that closed its breaker."""
        self.trial = 0.0
        return self.replica.breaker.success()

    def _outage(self) -> None:
        """The pinned replica failed as a whole: count it against its breaker."""
        self.trial = 0.0
        self.replica.breaker.failure()

    def drop_session(self) -> None:
        """Forget the session (closing it in the background)."""
        if self.session is not None:
            self.spawn(self.session.close())
        self.session, self.cursor = None, None

    async def close(self) -> None:
        session, self.session, self.cursor = self.session, None, None
        self.unpin()
        if session is not None:
            await session.close()


class DraftLink(_Link):
    role = "draft"

    def __init__(
        self,
        *args,
        shape: WireShape,
        on_fallback: Callable[[str], None],
        on_recovered: Callable[[], None] = lambda: None,
        **kw,
    ) -> None:
        super().__init__(*args, **kw)
        self.shape = shape
        self.on_fallback = on_fallback
        self.on_recovered = on_recovered  # the replica's breaker closed again
        self.prefilled = False  # the opening prefill was tried (at open, or first draft)
        self.own_failures = 0  # the draft's failures on this request in a row (Internal)
        self.skip_steps = 0  # steps left to go without a draft after one of them
        self.skip_reason = ""
        # A retune in flight on the session's stream (``retune``): the stream's next
        # call waits for its reply first (one reply per call, in order).
        self.retuning: asyncio.Task | None = None

    async def _open(self) -> None:
        self.cursor = Cursor.fresh(self.history)
        self.session = await self.replica.port.open(
            self.session_id,
            self.history[:-1],
            self.params,
            self.shape,
            self.budget.left(self.budget.draft_timeout_s),
            self.counter,
        )

    def ended(self) -> asyncio.Future | None:
        """Done once this request's draft session ended on its own
        (``DraftSession.ended``: the draft died, say); None without a session."""
        return self.session.ended() if self.session is not None else None

    def retune(self, gamma: int) -> asyncio.Task:
        """Ask the paced pipeline on the session to draft ``gamma`` tokens a block from
        its next undecided block on (``DraftSession.retune``), in the background: the
        task gives that block's index (0: nothing changed), or raises if the call
        failed. Not an outage in itself: the pipeline's own wait sees a dead draft."""
        session = self.session

        async def call() -> int:
            if session is None:
                return 0
            return await session.retune(gamma, self.budget.left(self.budget.draft_timeout_s))

        self.retuning = asyncio.ensure_future(call())
        return self.retuning

    async def close(self) -> None:
        if self.retuning is not None:  # (its reply no longer matters)
            self.retuning.cancel()
            await self._after_retune()
        await super().close()

    async def _after_retune(self) -> None:
        """Let a retune in flight have its reply before the stream's next call."""
        task, self.retuning = self.retuning, None
        if task is not None:
            await asyncio.wait((task,))
            if not task.cancelled():
                task.exception()  # (seen by whoever asked for it, if anyone still does)

    async def prefill(self) -> None:
        """Open a session ahead of the first drafting step (failures only mean no
        speculation yet)."""
        self.prefilled = True
        replica = self.pool.pick()
        if replica is None:
            return
        self.pin(replica)
        try:
            await self._open()
        except SpecdecError as e:
            if self.budget.passed(_DEADLINE_SLACK_S):  # the request's deadline, not an outage
                self.drop_session()
                self.unpin()
                return
            self._failed(e)
            return
        self._succeeded()

    async def propose(
        self,
        gamma: int,
        seed: int,
        ahead: Cursor | None = None,
        relay: RelayTo | None = None,
        guess: bool = False,
    ) -> Proposal | None:
        """A draft of gamma tokens from ``self.cursor``, or None (this step falls back).
        ``relay``: the draft also sends it on to the target (``Proposal.relayed``).
        ``guess``: see ``DraftSession.propose``.

        ``ahead``: draft from this cursor instead (drafting on while the target
        verifies, as if every pending draft will be accepted). Such a draft is only
        worth having from the live session: nothing is re-opened for it, and a
        failure does not count as a fallback step (the verdict's bonus serves). It
        has no tokens when the draft already knows the verdict rejects a draft
        (``DraftOn.ahead``): the step would discard it.
        """
        await self._after_retune()
        if ahead is not None:
            if self.session is None:
                return None
            try:
                proposal = await self.session.propose(
                    ahead,
                    gamma,
                    seed,
                    self.budget.left(self.budget.draft_timeout_s),
                    ahead=True,
                    guess=guess,
                )
            except SpecdecError as e:
                if self.budget.passed():
                    return None
                self._failed(e, fallback=False)
                return None
            self._succeeded()
            return proposal
        if self.skip_steps > 0:  # backing off after the draft failed on this request
            self.skip_steps -= 1
            self.on_fallback(self.skip_reason)
            return None
        if self.session is None:
            mine = self.replica is not None and (self.trial or self.replica.usable())
            replica = self.replica if mine else self.pool.pick()
            if replica is None:
                self.on_fallback("breaker_open")
                return None
            self.pin(replica)
        for attempt in (1, 2):
            try:
                if self.session is None:
                    await self._open()
                proposal = await self.session.propose(
                    self.cursor,
                    gamma,
                    seed,
                    self.budget.left(self.budget.draft_timeout_s),
                    relay,
                    guess=guess,
                )
                self._succeeded()
                return proposal
            except SpecdecError as e:
                if self.budget.passed():
                    raise DeadlineExceeded(_DEADLINE_PASSED) from None
                if isinstance(e, SessionLost) and attempt == 1:
                    log.warning("draft lost session %s: re-prefilling", self.session_id)
                    self.drop_session()
                    continue
                self._failed(e)
                return None
        return None

    def _succeeded(self) -> None:
        self.own_failures = 0
        if self._success():
            self.on_recovered()

    def _failed(self, e: SpecdecError, fallback: bool = True) -> None:
        """Give up on the pinned replica for now: breaker, close, fall back."""
        reason = _reason(e)
        log.warning(
            "draft %s failed (%s): speculating again after back-off",
            self.replica.address if self.replica else "?",
            reason,
        )
        # This request's own failure (a NaN in its logits), or the replica is full (at
        # max_sessions: it is up, and serves the others): back off this request.
        if isinstance(e, (Internal, ResourceExhausted)):
            self.own_failures += 1
            self.skip_steps = min(1 << (self.own_failures - 1), MAX_OWN_BACKOFF)
            self.skip_reason = reason
        elif self.replica is not None:
            self._outage()
        self.drop_session()
        self.unpin()
        if fallback:
            self.on_fallback(reason)

    async def rollback(self) -> None:
        await self._after_retune()
        if self.session is None:
            return
        try:
            await self.session.rollback(
                self.cursor.cache_len, self.budget.left(self.budget.draft_timeout_s)
            )
        except SpecdecError as e:
            if self.budget.passed(_DEADLINE_SLACK_S):  # the request's deadline, not an outage
                raise DeadlineExceeded(_DEADLINE_PASSED) from None
            self._failed(e)


class TargetLink(_Link):
    role = "target"

    def __init__(self, *args, retry_s: float, relay_timeout_s: float = 5.0, **kw) -> None:
        super().__init__(*args, **kw)
        self.retry_s = retry_s
        self.relay_timeout_s = relay_timeout_s
        self.relays_failed = False  # a relayed verdict never came: verify directly
        self.model: str | None = None  # fingerprint of the model this request runs on

    async def _open(self) -> None:
        """Prefill the whole history. A target that kept p for the next position
        (``next_logits``) needs no pending token in its first verify, and a step that
        drafts nothing no pass before its first draw; one that did not (an older
        release) gets the last token again, from one position back."""
        self.cursor = Cursor.fresh(self.history)
        self.session = await self.replica.port.open(
            self.session_id,
            self.history,
            self.params,
            self.budget.left(self.budget.target_timeout_s),
            self.counter,
        )
        if self.session.next_logits:
            self.cursor = Cursor(len(self.history), ())

    async def open(self) -> None:
        """Pin the least-loaded replica and prefill; a new request fails fast (after
        trying every replica once, those behind an open breaker last). A replica at
        its ``max_sessions`` is up: the next one is tried, and if every one is full
        the request ends with RESOURCE_EXHAUSTED."""
        tried: set[str] = set()
        full: ResourceExhausted | None = None
        while True:
            replica = self.pool.pick(model=self.model)
            if replica is None or replica.address in tried:
                replica = self.pool.pick_trial(tried, self.model)
            if replica is None:
                if full is not None:
                    raise full
                raise Unavailable(f"target: no healthy replica at {self.pool.spec}")
            tried.add(replica.address)
            self.pin(replica)
            try:
                await self._open()
            except (Unavailable, DeadlineExceeded):
                if self.budget.passed(_DEADLINE_SLACK_S):
                    raise
                # Down, or hung past target_timeout_s (stopped, cut off without a
                # reset): an outage either way.
                self._outage()
                self.drop_session()
                continue
            except ResourceExhausted as e:
                self._success()  # it answered: up, and full
                self.drop_session()
                full = e
                continue
            self._success()
            # From its first token on, the request stays on this model.
            self.model = replica.info.model_fingerprint
            return

    def relay_to(self, seed: int, pit: bool, draft_idle: bool = False) -> RelayTo | None:
        """Where a draft may send this step's proposal straight on (None: the session
        takes no relays, or there is none yet)."""
        if self.session is None or not self.session.relay_token or self.relays_failed:
            return None
        token, address = self.session.relay_token, self.replica.address
        return RelayTo(address, token, self.cursor, seed, pit, draft_idle=draft_idle)

    def cancel_relay(self, seed: int) -> None:
        """The relayed verify with this seed was not confirmed: never to be run."""
        if self.session is not None:
            self.session.cancel_relay(seed)

    async def verify(
        self,
        proposal: Proposal | None,
        seed: int,
        dense_p: bool,
        pit: bool = False,
        run: int = 1,
        follow: tuple[int, ...] = (),
        draft_idle: bool = False,
        draft_ended: asyncio.Future | None = None,
    ) -> Verdict:
        """The verdict on ``proposal`` from ``self.cursor`` (or a plain run of ``run``
        tokens), riding out restarts. A relayed proposal's q went to the target
        only: if that target fails before its verdict, the step decodes plain on the
        session that replaces it (``Verdict.drafts_dropped``). ``follow``: a
        pipeline's next verdict (``TargetSession.verify``), relayed in the same way.
        ``draft_idle``: no draft works meanwhile (``Verify.draft_idle``).
        ``draft_ended``: the session of the draft that paces the pipeline ended
        (``DraftLink.ended``): if it is done and no verdict came within
        ``DRAFT_ENDED_GRACE_S`` after, nothing more will come, so the step decodes
        plain at once rather than after ``relay_timeout_s``."""
        retry_until = time.monotonic() + self.retry_s
        delay = 0.05
        dropped = False
        hung: set[str] = set()  # replicas that let a call of this one time out
        while True:
            relayed = bool(follow) or (proposal is not None and proposal.relayed)
            opening = self.session is None
            try:
                if self.session is None:
                    await self._open()
                timeout = self.budget.left(self.budget.target_timeout_s)
                if relayed:
                    timeout = min(timeout, self.relay_timeout_s)
                verify = self.session.verify(
                    self.cursor,
                    proposal,
                    seed,
                    dense_p,
                    timeout,
                    pit,
                    run,
                    follow,
                    draft_idle=draft_idle,
                )
                if follow and draft_ended is not None:
                    verdict = await _unless_ended(verify, draft_ended, DRAFT_ENDED_GRACE_S)
                else:
                    verdict = await verify
                self._success()
                verdict.drafts_dropped = dropped
                return verdict
            except SessionLost as e:
                log.warning("target lost session %s (%s): re-prefilling", self.session_id, e)
                self.drop_session()
            except ResourceExhausted:
                # Up, but short of room; its breaker is no business of this. Re-opening
                # (after a restart) found it full: another replica of the model may
                # have some. A pass ran out of memory: the same session, after a wait.
                self._success()
                if self.budget.passed(_DEADLINE_SLACK_S):
                    raise DeadlineExceeded(_DEADLINE_PASSED) from None
                if time.monotonic() > retry_until:
                    raise
                if opening:
                    self._fail_over(outage=False)
            except _DraftEnded:
                # No block will come: its draft's session ended (the draft died, say).
                # The cancelled wait ended this target session too: the plain step
                # below runs on a new one.
                log.warning(
                    "request %s: the draft pacing its steps ended its session; the step "
                    "decodes plain",
                    self.session_id,
                )
                self.drop_session()
                proposal, run, dropped, follow = None, 1, True, ()
                metrics.labelled(metrics.RELAYED_STEPS, "lost").inc()
                continue
            except DeadlineExceeded as e:
                if self.budget.passed(_DEADLINE_SLACK_S):
                    raise
                if not relayed:
                    # No answer within target_timeout_s though the request has time
                    # left: the replica hangs (stopped, cut off without a reset). An
                    # outage: its breaker opens, and the request moves to another
                    # replica of the same model, once each.
                    hung.add(self.replica.address)
                    if not self._fail_over() or self.replica.address in hung:
                        raise Unavailable(f"{e}; no other replica to move to") from None
                    continue
                # The relay was lost on its way (the draft reached another replica, or
                # the message died with a connection): this request relays no more.
                log.warning(
                    "no verdict for a relayed proposal within relay_timeout_s (%g s) from "
                    "%s: request %s verifies directly from now on",
                    self.relay_timeout_s,
                    self.replica.address,
                    self.session_id,
                )
                self.relays_failed = True
                self.drop_session()
            except Unavailable:
                if self.budget.passed() or time.monotonic() > retry_until:
                    raise
                # Another replica of the same model if there is one; otherwise wait
                # for this one to come back.
                self._fail_over()
            except (InvalidArgument, Internal):
                raise  # this request's own failure: no retry, no breaker
            if relayed:  # its q went only to that target: this step decodes plain
                proposal, run, dropped, follow = None, 1, True, ()
                metrics.labelled(metrics.RELAYED_STEPS, "lost").inc()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _fail_over(self, outage: bool = True) -> bool:
        """The pinned replica failed (``outage``: count it against its breaker), drop
        the session, and pin another replica of the same model if there is one
        (re-prefilled from the history on the next call; one behind an open breaker
        too, as a trial). Returns whether it moved."""
        if outage:
            self._outage()
        self.drop_session()
        other = self.pool.pick(exclude=self.replica, model=self.model)
        if other is None:
            other = self.pool.pick_trial({self.replica.address}, self.model)
        if other is None:
            return False
        log.warning(
            "target %s failed: request %s moves to %s",
            self.replica.address,
            self.session_id,
            other.address,
        )
        metrics.TARGET_FAILOVERS.inc()
        self.pin(other)
        return True

    async def rollback(self) -> None:
        if self.session is None:
            return
        try:
            await self.session.rollback(
                self.cursor.cache_len, self.budget.left(self.budget.target_timeout_s)
            )
        except (SessionLost, Unavailable, DeadlineExceeded):
            if self.budget.passed(_DEADLINE_SLACK_S):
                raise
            # The next verify opens the session again, prefilled from the history (so
            # nothing is left to trim) and riding out the restart as any call does.
            self.drop_session()


# After a pacing draft's session ends, how long a verdict may still come (a block it
# relayed before it ended, in its verify): about a large model's pass, not a timeout.
DRAFT_ENDED_GRACE_S = 0.5


class _DraftEnded(Exception):
    """A pipeline's verdict will not come: the draft pacing it ended its session."""


async def _unless_ended(call, ended: asyncio.Future, grace_s: float):
    """``call``'s result, or ``_DraftEnded`` (``call`` cancelled) when ``ended`` is
    done and ``call`` is not ``grace_s`` after. ``ended`` is never cancelled here."""
    task = asyncio.ensure_future(call)
    try:
        await asyncio.wait((task, ended), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            await asyncio.wait((task,), timeout=grace_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait((task,))  # (a cancellation of this caller still propagates)
    if not task.cancelled():
        task.exception()  # (retrieved: the session is given up either way)
    raise _DraftEnded


def _reason(e: SpecdecError) -> str:
    """A bounded metric label for a draft failure."""
    if isinstance(e, DeadlineExceeded):
        return "timeout"
    return getattr(e, "code_name", type(e).__name__).lower()
