"""The orchestrator's gRPC servicer (thin: proto in, one domain call, proto out)."""

from __future__ import annotations

import asyncio
import time

import grpc

from specdec import metrics
from specdec.config import Config
from specdec.errors import SpecdecError
from specdec.server import RunningServer, start_server
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .engine import Orchestrator

SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        code = "OK"
        try:
            async for response in self.orch.generate(request, deadline):
                yield response
        except SpecdecError as e:
            code = e.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code = "CANCELLED"
            raise
        except BaseException:
            code = "INTERNAL"
            raise
        finally:
            metrics.REQUESTS.labels(code).inc()

    async def Info(self, request, context):
        return self.orch.info()


async def serve(cfg: Config, tokenizer=None) -> tuple[RunningServer, Orchestrator]:
    """Connect to draft and target, then start the public API; returns (server, domain)."""
    o = cfg.orchestrator
    orch = Orchestrator(cfg, tokenizer)
    await orch.connect()
    running = await start_server(
        lambda s: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(
            OrchestratorServicer(orch), s
        ),
        [SERVICE_NAME],
        o.host,
        o.port,
        "orchestrator",
        o.tls,
        o.max_message_bytes,
        o.auth_tokens,
    )
    return running, orch
