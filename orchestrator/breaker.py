"""A circuit breaker per replica, shared by all requests, so that a dead replica
costs one timeout, not one per request.

closed --failure--> open --back-off passes--> half-open --trial succeeds--> closed
                     ^                             |
                     +-------trial fails-----------+  (the back-off doubles)

While open, requests leave the replica alone (a draft's requests decode with the
target alone: still exact). When the back-off has passed, the first request to
pin the replica makes the one trial call; the others keep away until it ends, so
a replica that is still dead costs one request a timeout, not every live one.
A trial whose request ends without an outcome (cancelled, or its own deadline
passed) gives the trial back; one never given back lapses after ``trial_s``.
"""

from __future__ import annotations

import time


class CircuitBreaker:
    def __init__(self, retry_after_s: float, retry_max_s: float, trial_s: float = 5.0) -> None:
        self.retry_after_s = retry_after_s
        self.retry_max_s = retry_max_s
        self.trial_s = trial_s  # the longest a trial keeps the others away
        self.failures = 0
        self.open_until = 0.0
        self.trial_until = 0.0  # a trial is in flight until then

    @property
    def closed(self) -> bool:
        return not self.failures

    def allow(self, now: float | None = None) -> bool:
        """True while closed, or when the back-off has passed and no trial is in flight."""
        if not self.failures:
            return True
        now = time.monotonic() if now is None else now
        return now >= self.open_until and now >= self.trial_until

    def claim(self, now: float | None = None) -> float:
        """A request pins the replica: if its next call is the trial (the breaker is
        half-open), which keeps the others away until it ends, the trial's token
        (its deadline, for ``release``); else 0.0."""
        if not self.failures:
            return 0.0
        now = time.monotonic() if now is None else now
        self.trial_until = now + self.trial_s
        return self.trial_until

    def release(self, token: float) -> None:
        """The trial ``token`` ended without an outcome: another request may try (not
        if that trial lapsed and another request's is in flight now)."""
        if self.trial_until == token:
            self.trial_until = 0.0

    def success(self) -> bool:
        """A call succeeded; True if that closed the breaker (the replica is back)."""
        if not self.failures:
            return False
        self.failures = 0
        self.open_until = 0.0
        self.trial_until = 0.0
        return True

    def failure(self, now: float | None = None) -> None:
        """A call failed. While the breaker is already open the outage is already
        counted: many requests failing at once (all in flight when a replica died)
        count once, so the back-off doubles per failed trial, not per request."""
        now = time.monotonic() if now is None else now
        if now < self.open_until:
            return
        delay = min(self.retry_after_s * 2**self.failures, self.retry_max_s)
        self.failures += 1
        self.open_until = now + delay
        self.trial_until = 0.0
