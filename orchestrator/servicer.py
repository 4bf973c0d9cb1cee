"""The orchestrator's gRPC edge (thin: proto in, one domain call, proto out)."""

from __future__ import annotations

import asyncio
import time

import grpc

import specdec
from specdec import metrics
from specdec.config import Config
from specdec.errors import SpecdecError
from specdec.transport.server import RunningServer, start_server
from specdec.transport.status import code_of
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .engine import Chunk, Orchestrator, Stats
from .requests import parse

SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name


def stats_to_pb(s: Stats) -> orchestrator_pb2.GenerationStats:
    return orchestrator_pb2.GenerationStats(
        prompt_tokens=s.prompt_tokens,
        generated_tokens=s.generated,
        steps=s.steps,
        drafted_tokens=s.drafted,
        accepted_tokens=s.accepted,
        acceptance_rate=s.accepted / s.drafted if s.drafted else 0.0,
        mean_accepted_length=s.accepted / s.steps if s.steps else 0.0,
        time_to_first_token_s=s.ttft_s,
        tokens_per_second=s.generated / s.total_s if s.total_s > 0 else 0.0,
        total_time_s=s.total_s,
        finish_reason=s.finish_reason,
        gamma=s.gamma,
        wire_bytes_per_token=s.wire_bytes / s.generated if s.generated else 0.0,
        round_trips=s.round_trips,
        fallback_steps=s.fallback_steps,
        adaptive=s.adaptive,
        mean_gamma=s.mean_gamma,
        overlapped_steps=s.overlapped_steps,
        judged_tokens=s.judged,
        steps_s=s.steps_s,
        draft_forward_s=s.draft_forward_s,
        target_forward_s=s.target_forward_s,
    )


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        code = "OK"
        try:
            o = self.orch
            spec = parse(
                request,
                o.cfg.orchestrator,
                o.tokenizer,
                o.target_info,
                o.draft_info,
                o.cfg.target.max_context,
            )
            async for item in o.generate(spec, start, deadline):
                if isinstance(item, Chunk):
                    yield orchestrator_pb2.GenerateResponse(
                        chunk=orchestrator_pb2.Chunk(text=item.text, token_ids=item.token_ids)
                    )
                else:
                    yield orchestrator_pb2.GenerateResponse(stats=stats_to_pb(item))
        except SpecdecError as e:
            code = code_of(e).name
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
        o = self.orch
        c = o.cfg.orchestrator
        return orchestrator_pb2.OrchestratorInfo(
            draft_model_id=o.draft_info.model_id if o.draft_info else "",
            target_model_id=o.target_info.model_id,
            vocab_size=o.target_info.vocab_size,
            default_gamma=c.gamma,
            max_gamma=c.max_gamma,
            max_new_tokens=c.max_new_tokens,
            max_prompt_tokens=c.max_prompt_tokens,
            server_version=specdec.__version__,
        )


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
