"""Continuous batching: every session that is ready shares the next forward pass.

A *job* is a generator that yields a ``Feed`` (tokens to append to one
session's cache, and how many logits it wants), receives those logits,
yields its next feed, and finally returns its result. A Verify is a one-feed
job; a Propose is gamma feeds (one per drafted token); a prefill is one feed
that the loop may cut into chunks.

``ForwardLoop`` runs on the service's event loop. Whenever the model is free
it takes every waiting feed, oldest first, up to a token budget, and runs them
as one packed forward (``RaggedRunner``). Short feeds (decode and verify
steps) go first; long ones (prefills) are cut to fit the budget that is left,
and the oldest long one always gets at least a quarter of the budget, so
neither kind starves. A forward blocks the
event loop while it runs (like a model server's decode loop); between
forwards the loop serves RPCs and new jobs join.

Keeping sessions in step (``batch_wait_s``): each session's next job comes
back one network round trip (and, for the target, one drafting) after its
last one finished. Two sessions that start out of phase would stay so, each
forward carrying one of them while the other is on its way back, and batching
would buy nothing. So the loop waits, at most ``batch_wait_s`` after they
left, for the sessions that finished a job in the last forward and are
still open; once they share a forward they come back together. A lone
session never waits (its own next job is the one that arrives).
``kind_wait_s`` gives some kinds of job their own wait: a session leaving a
plain decoding step ("decode") comes back after one round trip to the caller
and nothing else, so waiting longer for it costs little and keeps plain runs
of concurrent requests in one pass; a session leaving a verify comes back only
after the draft's work, which the loop should not sit through. Jobs of a
``BACKGROUND`` kind (the draft's guesses: work nobody waits for yet) are never
waited for, and never wait for others.

Threads (``threads``, CPU): a pass whose every job is a plain decoding step
(``PLAIN``) or a job whose caller says no draft works meanwhile (``run``'s
``wide``: a verify in a step that drafts nothing ahead, the caller's only
request) may run on more torch threads than the others, where the draft
shares the machine's cores: the draft is idle then, and the target can use its
core too. Such a pass goes wide only when no pass with another job around
which a draft works (``DRAFTING``: a verify, the target's own continuation)
ran in the last ``WIDE_AFTER_S``: between two such verifies a draft drafts
(another session's, or the same one drafting ahead), and a second target
thread waiting for its core would slow both (docs/benchmarks.md, "A second
thread for plain passes"). A request's last step, which drafts nothing, and
plain steps while other sessions speculate stay narrow that way. A verify
marked ``wide`` counts as such another job when a different session's marked
verify ran within that time, or shares its pass: each caller knows only its
own draft (two orchestrators' lone requests on one target), and one
session's draft drafts while the other's verify runs. Any other pass (a
prefill, an unmarked verify) keeps the usual count, and the usual count is
back as soon as a wide pass ends, for whatever torch work comes next.

A forward that fails (out of device memory, say) fails no job outright when
it carried several sessions: each of its jobs is run again alone, so that only
a job that fails alone fails. A session's cache grows only when a forward
succeeds, so running a feed again is safe. Running out of device memory is
``ResourceExhausted`` to the job (a caller may retry later), anything else the
exception itself.

Not for: what jobs compute (the draft and target services write them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specdec import tracing
from specdec.errors import Internal, ResourceExhausted

from .ragged import Feed, RaggedRunner

Job = Generator[Feed, torch.Tensor, Any]
# A feed is "long" (a prefill) past this many tokens; shorter ones go first.
LONG_FEED = 64
# Kinds of job that nobody awaits yet: no forward waits on their account.
BACKGROUND = frozenset({"guess"})
# Kinds of job for which no draft works (the target's plain decoding steps): a pass
# of these alone may take more threads (``ForwardLoop.threads``).
PLAIN = frozenset({"decode"})
# Kinds of job around which a draft works (it drafts between a session's verifies;
# it drafts the next blocks during the target's own continuation): a pass of PLAIN
# (or ``wide``) jobs goes wide only once none of these (not ``wide``) has run for
# WIDE_AFTER_S, about two speculative steps of the demo pair, so that a session
# still speculating beside them keeps them narrow.
DRAFTING = frozenset({"verify", "lookahead"})
WIDE_AFTER_S = 0.025

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    job: Job
    future: asyncio.Future
    feed: Feed
    arrived: float = field(default_factory=time.perf_counter)
    kind: str = "step"
    waited: bool = False  # its first forward has run (queue wait recorded)
    alone: bool = False  # its next feed runs in a forward of its own (a shared one failed)
    wide: bool = False  # no draft works meanwhile: its passes may take more threads
    key: int = 0  # id of its session's cache (its key in ``ForwardLoop._waiting``)


@dataclass
class BatchStats:
    """What one forward covered (for metrics)."""

    sessions: int
    tokens: int
    seconds: float
    queue_waits: list[float]
    kinds: list[str]
    wide: bool = False  # it ran on the larger thread count (``ForwardLoop.threads``)


class ForwardLoop:
    """Runs jobs' feeds in shared forward passes."""

    def __init__(
        self,
        runner: RaggedRunner,
        max_batch_tokens: int,
        on_batch: Callable[[BatchStats], None] | None = None,
        batch_wait_s: float = 0.0,
        kind_wait_s: dict[str, float] | None = None,
        threads: tuple[int, int] = (0, 0),
    ) -> None:
        self.runner = runner
        self.max_batch_tokens = max_batch_tokens
        self.on_batch = on_batch
        self.batch_wait_s = batch_wait_s
        self.kind_wait_s = kind_wait_s or {}
        # torch threads for (other passes, a pass of PLAIN jobs alone); (0, 0): as set
        usual, plain = threads
        self.threads = (usual or torch.get_num_threads(), plain) if plain else (0, 0)
        self._narrow_at = -float("inf")  # when a pass with a DRAFTING job last ran
        # The session (key) of the last DRAFTING job marked ``wide``, and when it ran.
        self._marked = (0, -float("inf"))
        # The sessions' jobs, by id of their cache, oldest first (one per session).
        self._waiting: dict[int, _Pending] = {}
        # Sessions (by id of their cache) whose job finished in a forward and that may
        # come back with their next one: until when to wait for it.
        self._returning: dict[int, float] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # The forward a job just came out of (read by the job as it resumes).
        self.last_batch = BatchStats(0, 0, 0.0, [], [])

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drive())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for p in self._waiting.values():
            if not p.future.done():
                p.future.cancel()
        self._waiting.clear()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def forget(self, kv: object) -> None:
        """The session with cache ``kv`` ended: no job of it is coming back."""
        self._returning.pop(id(kv), None)

    async def run(self, job: Job, kind: str = "step", wide: bool = False) -> Any:
        """Drive ``job`` to completion in shared forwards; returns its result.
        ``wide``: its caller says no draft works while it runs (see the module's
        docstring, "Threads").

        A session (a cache) has one job here at a time. A second one fails at once
        (``Internal``, naming both kinds), and alone: in a forward it would fail the
        runner, and with it every other session's job in that forward.

        A caller cancelled while its job waits or runs drops the job: none of its
        feeds runs after that, and the session is free for its next job."""
        try:
            feed = next(job)
        except StopIteration as done:  # a job that needs no forward
            return done.value
        key = id(feed.kv)
        busy = self._waiting.get(key)
        if busy is not None:
            job.close()
            raise Internal(f"session busy: a {kind} job came while its {busy.kind} job runs")
        future = asyncio.get_running_loop().create_future()
        self._returning.pop(key, None)
        self._waiting[key] = _Pending(job, future, feed, kind=kind, key=key, wide=wide)
        self._wake.set()
        try:
            return await future
        finally:
            # Cancelled by the caller: cancelling the caller cancels the future it
            # awaits too. Drop the job now, not at the next forward: the session's next
            # job may come first.
            if future.cancelled():
                p = self._waiting.get(key)
                if p is not None and p.future is future:
                    del self._waiting[key]
                    p.job.close()

    # ---- the loop -----------------------------------------------------------------------
    async def _drive(self) -> None:
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()  # woken in a later turn of the event loop
            else:
                # Let RPCs that arrived during the last forward add their jobs first.
                await asyncio.sleep(0)
            if self._returning and any(p.kind not in BACKGROUND for p in self._waiting.values()):
                await self._gather()
            batch = self._select()
            if batch:
                try:
                    self._forward(batch)
                except Exception as e:  # a fault outside the jobs: theirs, not the loop's
                    log.exception("forward loop: a forward failed")
                    for p, _ in batch:
                        self._finish(p, error=_bare(e))
            batch = None  # (nothing of a forward outlives it while the loop waits)

    async def _gather(self) -> None:
        """Wait for the sessions that left the last forwards to come back, at most
        ``batch_wait_s`` after each left, or its kind's wait (see the module's docstring)."""
        while self._waiting:
            now = time.perf_counter()
            self._returning = {k: t for k, t in self._returning.items() if t > now}
            if not self._returning:
                return
            self._wake.clear()
            timeout = max(self._returning.values()) - now
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                self._returning.clear()
                return

    def _select(self) -> list[tuple[_Pending, Feed]]:
        """The feeds of the next forward: short ones oldest first, then long ones cut to fit."""
        # Callers cancelled that have not resumed yet: none of their feeds runs after it.
        self._drop_cancelled()
        budget = self.max_batch_tokens
        waiting = list(self._waiting.values())
        alone = next((p for p in waiting if p.alone), None)
        if alone is not None:  # after a shared forward failed: one job at a time
            waiting = [alone]
        short = [p for p in waiting if len(p.feed.tokens) <= LONG_FEED]
        long = [p for p in waiting if len(p.feed.tokens) > LONG_FEED]
        chosen: list[tuple[_Pending, Feed]] = []
        if long:  # the oldest prefill always progresses
            budget -= min(len(long[0].feed.tokens), max(1, self.max_batch_tokens // 4))
        for p in short:
            if len(p.feed.tokens) > budget and chosen:
                continue
            chosen.append((p, p.feed))
            budget -= len(p.feed.tokens)
        if long:
            budget += min(len(long[0].feed.tokens), max(1, self.max_batch_tokens // 4))
        for p in long:
            if budget <= 0:
                break
            n = len(p.feed.tokens)
            # A chunk now and the rest later, the rest holding every position it wants
            # logits of; a feed that wants them all runs whole.
            cut = min(budget, n - p.feed.logits)
            if n <= budget or cut <= 0:
                chosen.append((p, p.feed))
                budget -= n
            else:
                chosen.append((p, Feed(p.feed.kv, p.feed.tokens[:cut], 0)))
                budget -= cut
        return chosen

    def _forward(self, batch: list[tuple[_Pending, Feed]]) -> None:
        start = time.perf_counter()
        waits = []
        for p, _ in batch:
            if not p.waited:
                waits.append(start - p.arrived)
                p.waited = True
        tracing.mark("forward")
        # What each feed's session held before: a forward that fails after the runner
        # grew them (a device fault shows at the synchronize) must not have grown them.
        before = [(f, f.kv.length, len(f.hidden_out or ())) for _, f in batch]
        wide = self.threads[1] and self._widen(batch)
        try:
            logits = self.runner.forward([feed for _, feed in batch])
            if logits and logits[0].is_cuda:  # time the work, not the launch
                torch.cuda.synchronize(logits[0].device)  # (where a device fault shows)
        except Exception as e:
            for f, length, kept in before:
                f.kv.length = length
                if f.hidden_out is not None:
                    del f.hidden_out[kept:]
            if len(batch) > 1:  # which job's feed failed it? each runs again, alone
                log.warning(
                    "forward loop: a forward of %d sessions failed (%s: %s); running "
                    "each again alone",
                    len(batch),
                    type(e).__name__,
                    str(e),  # (a record holding the exception would hold its frames)
                )
                for p, _ in batch:
                    p.alone = True
                return
            log.warning(
                "forward loop: a forward failed: %s: %s",
                type(e).__name__,
                str(e),
                exc_info=not isinstance(e, torch.OutOfMemoryError),
            )
            for p, _ in batch:  # alone: this job's own failure
                self._finish(p, error=_bare(e))
            return
        finally:
            if wide:
                torch.set_num_threads(self.threads[0])
        for p, _ in batch:
            p.alone = False
        seconds = time.perf_counter() - start
        tracing.mark("forward_end")
        self.last_batch = stats = BatchStats(
            sessions=len(batch),
            tokens=sum(len(f.tokens) for _, f in batch),
            seconds=seconds,
            queue_waits=waits,
            kinds=[p.kind for p, _ in batch],
            wide=bool(wide),
        )
        for (p, feed), out in zip(batch, logits, strict=True):
            if feed is not p.feed:  # a chunk: the remainder stays queued
                rest = p.feed.tokens[len(feed.tokens) :]
                p.feed = replace(p.feed, tokens=rest)
                continue
            try:
                p.feed = p.job.send(out)
            except StopIteration as done:
                wait = self.kind_wait_s.get(p.kind, self.batch_wait_s)
                if wait > 0 and p.kind not in BACKGROUND:
                    self._returning[id(feed.kv)] = time.perf_counter() + wait
                self._finish(p, result=done.value)
            except Exception as e:
                self._finish(p, error=e)
        if self.on_batch is not None:
            try:
                self.on_batch(stats)
            except Exception:  # (metrics): the jobs have their results
                log.exception("forward loop: on_batch failed")

    def _widen(self, batch: list[tuple[_Pending, Feed]]) -> bool:
        """Give this pass the larger thread count if it may have it (see the module's
        docstring), never more threads than the cores the process may run on now (it
        may have been pinned since it started); returns whether it did."""
        now = time.perf_counter()
        drafting = [p for p, _ in batch if p.kind in DRAFTING]
        if drafting:
            # A marked verify's caller vouches for its own draft only.
            keys = {p.key for p in drafting}
            key, at = self._marked
            other = key not in keys and now - at < WIDE_AFTER_S
            if other or len(keys) > 1 or not all(p.wide for p in drafting):
                self._narrow_at = now
            marked = [p.key for p in drafting if p.wide]
            if marked:
                self._marked = (marked[-1], now)
        if not all(p.kind in PLAIN or p.wide for p, _ in batch):
            return False
        usual, plain = self.threads
        n = min(plain, _cores())
        if now - self._narrow_at < WIDE_AFTER_S or n <= usual:
            return False
        torch.set_num_threads(n)
        return True

    def _drop_cancelled(self) -> None:
        """Take the jobs whose callers were cancelled out of the loop, and close them."""
        cancelled = [k for k, p in self._waiting.items() if p.future.cancelled()]
        for key in cancelled:
            self._waiting.pop(key).job.close()

    def _finish(self, p: _Pending, result: Any = None, error: BaseException | None = None) -> None:
        if self._waiting.get(p.key) is p:
            del self._waiting[p.key]
        if p.future.done():
            return
        if error is not None:
            p.future.set_exception(error)
        else:
            p.future.set_result(result)


def _cores() -> int:
    """The cores this process may run on now."""
    if hasattr(os, "sched_getaffinity"):  # (Linux)
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _bare(e: BaseException) -> BaseException:
    """What a job's caller gets for a forward's failure: out of device memory is
    ResourceExhausted (worth a retry later); and no traceback, whose frames would
    hold the failed forward's tensors until the garbage collector found the cycle
    (exception, frame, batch, future, exception)."""
    if isinstance(e, torch.OutOfMemoryError):
        return ResourceExhausted(f"memory: the device ran out of memory in a forward ({e})")
    return e.with_traceback(None)
