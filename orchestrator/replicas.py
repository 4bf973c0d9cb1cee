"""The replicas of a model service, and which one a session is pinned to.

A session's KV cache lives in one draft replica and one target replica, so a
request is pinned to one of each for its whole life. The configured address
names the replicas:

* ``host:port``: one replica (gRPC resolves the name itself);
* ``h1:p1,h2:p2``: a static list;
* ``dns:///name:port``: every address the name resolves to, re-resolved
  every ``resolve_interval_s``: a Kubernetes headless Service gives one
  address per ready pod.

New sessions go to the least-loaded replica (fewest pinned requests) whose
breaker allows it. A replica that disappears from DNS takes no new sessions;
requests pinned to it move to another replica serving the *same model* (equal
``model_fingerprint``) by re-prefilling from their token history (see
``orchestrator.resilience``). Each replica is reached through a port
(``orchestrator.ports``), so a pool of in-process services works the same.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import FailedPrecondition, SpecdecError, Unavailable
from specdec.runtime.loading import ModelInfo

from .breaker import CircuitBreaker

log = logging.getLogger(__name__)
DNS_PREFIX = "dns:///"


def resolve(spec: str) -> list[str]:
    """The replica addresses a configured address names, in a stable order."""
    if spec.startswith(DNS_PREFIX):
        host, _, port = spec[len(DNS_PREFIX) :].rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror:
            return []
        ips = sorted({info[4][0] for info in infos})
        return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]
    return [a.strip() for a in spec.split(",") if a.strip()]


@dataclass
class Replica:
    address: str
    port: Any  # a DraftPort or TargetPort
    breaker: CircuitBreaker
    info: ModelInfo | None = None
    pinned: int = 0  # requests whose session lives here
    gone: bool = False  # vanished from DNS: no new sessions
    rejected: str = ""  # why its Info made it unfit to pair with the others

    def usable(self) -> bool:
        return self.info is not None and not self.gone and self.breaker.allow()


@dataclass
class ReplicaPool:
    """The replicas of one role ("draft" or "target")."""

    role: str
    spec: str
    make_port: Callable[[str], Any]  # address -> port
    retry_after_s: float
    retry_max_s: float
    check: Callable[[ModelInfo], None] = lambda info: None
    resolver: Callable[[str], list[str]] = resolve
    trial_s: float = 5.0  # the longest a breaker's trial call may keep the others away
    replicas: dict[str, Replica] = field(default_factory=dict)

    def _add(self, address: str) -> Replica:
        replica = Replica(
            address,
            self.make_port(address),
            CircuitBreaker(self.retry_after_s, self.retry_max_s, self.trial_s),
        )
        self.replicas[address] = replica
        return replica

    async def refresh(self) -> None:
        """Re-resolve; new replicas are checked (Info) before they get sessions."""
        current = set(self.resolver(self.spec))
        for address, replica in list(self.replicas.items()):
            replica.gone = address not in current
            if replica.gone and replica.pinned == 0:
                await replica.port.aclose()
                del self.replicas[address]
        for address in current:
            replica = self.replicas.get(address) or self._add(address)
            if replica.info is None:
                await self._fetch_info(replica)
        models = {r.info.model_fingerprint for r in self.replicas.values() if r.info}
        if len(models) > 1:
            log.warning(
                "%s pool serves %d different models (fingerprints %s): requests stay on "
                "the model they started on",
                self.role,
                len(models),
                ", ".join(sorted(m[:12] for m in models)),
            )

    async def _fetch_info(self, replica: Replica) -> None:
        try:
            info = await replica.port.info(timeout=2.0)
        except SpecdecError:
            return
        try:
            self.check(info)
        except SpecdecError as e:
            if not replica.rejected:
                log.error("%s replica %s not used: %s", self.role, replica.address, e)
            replica.rejected = str(e)
            return
        replica.info = info

    async def wait_ready(self, timeout_s: float) -> ModelInfo:
        """Resolve until at least one replica answers Info; returns its info."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.refresh()
            ready = [r.info for r in self.replicas.values() if r.info is not None]
            if ready:
                return ready[0]
            rejected = [r.rejected for r in self.replicas.values() if r.rejected]
            if rejected:
                raise FailedPrecondition(rejected[0])
            if time.monotonic() > deadline:
                raise Unavailable(f"{self.role} service at {self.spec} did not answer")
            await asyncio.sleep(0.05)  # (start-up only: a stack is ready sooner)

    def pick(self, exclude: Replica | None = None, model: str | None = None) -> Replica | None:
        """The least-loaded usable replica, other than ``exclude`` if possible,
        serving the model with fingerprint ``model`` if given."""
        usable = [
            r
            for r in self.replicas.values()
            if r.usable()
            and r is not exclude
            and (model is None or r.info.model_fingerprint == model)
        ]
        return min(usable, key=lambda r: (r.pinned, r.address)) if usable else None

    def pick_trial(self, tried: set[str], model: str | None = None) -> Replica | None:
        """A replica to try although its breaker is open (none is usable): the one
        whose back-off ends first, among those not tried yet. A replica that came
        back must not stay unused behind its breaker while requests fail."""
        candidates = [
            r
            for r in self.replicas.values()
            if r.info is not None
            and not r.gone
            and r.address not in tried
            and (model is None or r.info.model_fingerprint == model)
        ]
        return min(candidates, key=lambda r: r.breaker.open_until) if candidates else None

    def any_usable(self) -> bool:
        return any(r.usable() for r in self.replicas.values())

    def first_info(self) -> ModelInfo | None:
        return next((r.info for r in self.replicas.values() if r.info), None)

    async def aclose(self) -> None:
        for replica in self.replicas.values():
            await replica.port.aclose()
        self.replicas.clear()


def fixed(name: str) -> Callable[[str], list[str]]:
    """A resolver that always names the one replica ``name`` (in-process pools)."""
    return lambda spec: [name]
