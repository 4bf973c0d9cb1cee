"""The orchestrator's public gRPC API, as the gateway calls it.

One ``grpc.aio`` channel (client TLS as configured; round-robin over every
address of a ``dns:///`` name), the client's bearer token forwarded as
``authorization`` metadata, a deadline on every call, and a stream that has
received its first message before the gateway sends any byte to its client.

Not for: HTTP or OpenAI's shapes (``app``, ``openai_schema``); errors stay
``grpc.aio.AioRpcError`` here and are mapped once, in ``errors``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.config import GatewayConfig
from specdec.transport.channels import channel_credentials, keepalive_options
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc


class EmptyStream(Exception):
    """The orchestrator ended a Generate stream without its statistics."""


@dataclass
class Stream:
    """An open Generate call whose first message has arrived."""

    call: grpc.aio.UnaryStreamCall
    first: orchestrator_pb2.GenerateResponse

    async def messages(self) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        """Every message, the first included; the last one carries the statistics.

        After the statistics it waits for the call's status: the orchestrator may
        still be finishing the request (closing sessions), and the cancel that
        frees a disconnected client's sessions must not land on a finished
        request (which would count as CANCELLED there).
        """
        message = self.first
        while True:
            yield message
            if message.HasField("stats"):
                await self.call.code()
                return
            message = await self.call.read()
            if message is grpc.aio.EOF:
                raise EmptyStream("the orchestrator ended the stream without statistics")


def _metadata(authorization: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", authorization),) if authorization else None


class Orchestrator:
    """A client of ``specdec.v1.Orchestrator`` (Generate, Info) and its health service."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        options = [
            # Every address of a dns:/// name gets requests, not just the first.
            ("grpc.lb_policy_name", "round_robin"),
            # Reconnect quickly to a restarted orchestrator (gRPC's default backs off to 120 s).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            # A connection whose peer went silent (node gone, no reset) is found by its
            # unanswered ping (GatewayConfig.keepalive_s), for as long as a call waits.
            *keepalive_options(cfg.keepalive_s),
        ]
        creds = channel_credentials(cfg.orchestrator_tls)
        address = cfg.orchestrator_address
        self.channel = (
            grpc.aio.secure_channel(address, creds, options=options)
            if creds
            else grpc.aio.insecure_channel(address, options=options)
        )
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._target_model_id = ""

    async def info(self, authorization: str | None) -> orchestrator_pb2.OrchestratorInfo:
        info = await self.stub.Info(
            orchestrator_pb2.OrchestratorInfoRequest(),
            timeout=10.0,
            metadata=_metadata(authorization),
        )
        self._target_model_id = info.target_model_id
        return info

    async def model_name(self, authorization: str | None) -> str:
        """The name clients use: ``gateway.model_name``, else the target's model id."""
        if self.cfg.model_name:
            return self.cfg.model_name
        if not self._target_model_id:  # asked once; a model does not change under a name
            await self.info(authorization)
        return self._target_model_id

    async def serving(self, timeout: float = 2.0) -> bool:
        """Whether the orchestrator's health service says SERVING."""
        try:
            r = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    async def open(
        self, request: orchestrator_pb2.GenerateRequest, authorization: str | None
    ) -> Stream:
        """Start Generate and wait for its first message, so that an error comes
        before any byte is sent. Raises ``grpc.aio.AioRpcError``."""
        call = self.stub.Generate(
            request, timeout=self.cfg.request_timeout_s, metadata=_metadata(authorization)
        )
        try:
            first = await call.read()
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            raise EmptyStream("the orchestrator ended the stream without a message")
        return Stream(call, first)

    async def aclose(self) -> None:
        await self.channel.close()
