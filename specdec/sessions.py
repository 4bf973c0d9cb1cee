"""The live sessions of a model service: what each holds, the limit, the gauges.

A session lives exactly as long as its stream (see the services'
``Session`` RPC); this store only counts and finds them.
Not for: cache contents (``specdec.runtime.ragged.SessionKV`` owns those).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from specdec import metrics
from specdec.errors import AlreadyExists, ResourceExhausted
from specdec.runtime.ragged import SessionKV
from specdec.sampling import SamplingParams


@dataclass
class Session:
    """One session of a model service."""

    session_id: str
    params: SamplingParams
    kv: SessionKV = field(default_factory=SessionKV)
    opened: float = field(default_factory=time.monotonic)
    extra: Any = None  # what the role keeps per session (the draft: its wire settings)

    @property
    def length(self) -> int:
        return self.kv.length


class SessionStore:
    def __init__(self, role: str, max_sessions: int) -> None:
        self.role = role
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        # Summed when /metrics is read, not per step: a sum over every live session on
        # each step made a round of steps cost O(sessions^2) on the event loop.
        metrics.labelled(metrics.CACHED_TOKENS, role).set_function(self.cached_tokens)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: Session) -> bool:
        return self._sessions.get(session.session_id) is session

    def add(self, session: Session) -> None:
        if session.session_id in self._sessions:
            raise AlreadyExists(f"session_id: session {session.session_id!r} already exists")
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(
                f"sessions: the limit of {self.max_sessions} live sessions is reached"
            )
        self._sessions[session.session_id] = session
        self.update_gauges()

    def remove(self, session: Session) -> bool:
        existed = self._sessions.get(session.session_id) is session
        if existed:
            del self._sessions[session.session_id]
        self.update_gauges()
        return existed

    def clear(self) -> None:
        self._sessions.clear()
        self.update_gauges()

    def update_gauges(self) -> None:
        metrics.labelled(metrics.LIVE_SESSIONS, self.role).set(len(self._sessions))

    def cached_tokens(self) -> int:
        """Tokens held in all live sessions' caches (read on the metrics thread: the
        values are copied in one step, under the GIL, before they are summed)."""
        return sum(s.length for s in list(self._sessions.values()))
