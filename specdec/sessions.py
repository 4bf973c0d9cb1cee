"""The store of live sessions in a model service: limit, TTL and gauges.

Not for: cache contents (``specdec.model.KVSession`` owns those).
"""

from __future__ import annotations

import time

from specdec import metrics
from specdec.errors import AlreadyExists, NotFound, ResourceExhausted
from specdec.model import KVSession


class SessionStore:
    def __init__(self, role: str, max_sessions: int, ttl_s: float) -> None:
        self.role = role
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._sessions: dict[str, KVSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def add(self, session: KVSession) -> None:
        self.expire()
        if session.session_id in self._sessions:
            raise AlreadyExists(f"session_id: session {session.session_id!r} already exists")
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(
                f"sessions: the limit of {self.max_sessions} live sessions is reached"
            )
        self._sessions[session.session_id] = session
        self.update_gauges()

    def get(self, session_id: str) -> KVSession:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(
                f"session_id: no live session {session_id!r} (closed, expired or lost in a restart)"
            )
        session.last_used = time.monotonic()
        return session

    def remove(self, session_id: str) -> bool:
        existed = self._sessions.pop(session_id, None) is not None
        self.update_gauges()
        return existed

    def expire(self, now: float | None = None) -> int:
        """Free sessions idle for longer than the TTL; returns how many."""
        now = time.monotonic() if now is None else now
        stale = [s for s, v in self._sessions.items() if now - v.last_used > self.ttl_s]
        for sid in stale:
            del self._sessions[sid]
        if stale:
            metrics.SESSION_EVICTIONS.labels(self.role, "ttl").inc(len(stale))
            self.update_gauges()
        return len(stale)

    def clear(self) -> None:
        self._sessions.clear()
        self.update_gauges()

    def update_gauges(self) -> None:
        metrics.LIVE_SESSIONS.labels(self.role).set(len(self._sessions))
        metrics.CACHED_TOKENS.labels(self.role).set(sum(s.length for s in self._sessions.values()))
