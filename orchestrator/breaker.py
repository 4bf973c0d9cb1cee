"""A circuit breaker for the draft: after a failure, speculation pauses and
requests are served by the target alone; it is retried after a back-off that
doubles on each further failure. One breaker per draft replica, shared by all
requests, so a dead draft costs one timeout, not one per request.
"""

from __future__ import annotations

import time


class CircuitBreaker:
    def __init__(self, retry_after_s: float, retry_max_s: float) -> None:
        self.retry_after_s = retry_after_s
        self.retry_max_s = retry_max_s
        self.failures = 0
        self.open_until = 0.0

    def allow(self, now: float | None = None) -> bool:
        """True while closed, or when the back-off has passed (a trial call)."""
        return (time.monotonic() if now is None else now) >= self.open_until

    def success(self) -> bool:
        """A call succeeded; True if that closed the breaker (the replica is back)."""
        if not self.failures:
            return False
        self.failures = 0
        self.open_until = 0.0
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
