"""Draft service: ``Propose`` streams drafted tokens with their proposal q.

Each drafted token is sampled from q, the warped draft distribution truncated
to its ``wire_top_k`` most likely entries; that truncated q is exactly what
goes on the wire, so the orchestrator's acceptance test stays exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import torch

from specdec.config import ModelServiceConfig
from specdec.errors import require
from specdec.model import KVSession
from specdec.model_service import MAX_GAMMA, ModelService, SessionServicerMixin, params_from_pb
from specdec.sampling import SamplingParams, draft_distribution, sparse_to_dense
from specdec.server import RunningServer, start_server
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftModel(ModelService):
    """The draft model's domain: sessions plus proposing."""

    def _draft_one(
        self,
        session: KVSession,
        feed: list[int],
        params: SamplingParams,
        generator: torch.Generator,
        wire_top_k: int,
        kind: str,
    ) -> tuple[int, common_pb2.Distribution]:
        """Feed tokens, then draw x from q; returns x and q as it goes on the wire."""
        logits = self.timed_forward(kind, session, feed)[-1]  # [vocab]
        ids, probs = draft_distribution(logits, params, wire_top_k)  # [k], [k]
        pick = 0 if ids.numel() == 1 else int(torch.multinomial(probs, 1, generator=generator))
        if wire_top_k == 0 and not params.greedy:
            q = common_pb2.Distribution(probs=sparse_to_dense(ids, probs, self.vocab_size).tolist())
        else:
            q = common_pb2.Distribution(token_ids=ids.tolist(), probs=probs.tolist())
        return int(ids[pick]), q

    def _draft_all(
        self,
        request: draft_pb2.ProposeRequest,
        session: KVSession,
        params: SamplingParams,
        feed: list[int],
        emit,
    ) -> None:
        """Draft gamma tokens on the forward thread, handing each to ``emit`` at once."""
        self.truncate(session, request.cache_len)
        generator = torch.Generator(self.runner.device).manual_seed(request.seed)
        kind = "prefill" if len(feed) > 1 else "propose"
        for index in range(request.gamma):
            token, q = self._draft_one(session, feed, params, generator, request.wire_top_k, kind)
            emit(draft_pb2.DraftToken(index=index, token_id=token, q=q, cache_len=session.length))
            feed, kind = [token], "propose"

    async def propose(
        self, request: draft_pb2.ProposeRequest
    ) -> AsyncIterator[draft_pb2.DraftToken]:
        session = self.session_at(request.session_id, request.cache_len)
        params = params_from_pb(request.params)
        gamma = request.gamma
        require(1 <= gamma <= MAX_GAMMA, "gamma", f"must be in [1, {MAX_GAMMA}], got {gamma}")
        require(request.wire_top_k >= 0, "wire_top_k", "must be >= 0")
        feed = self.check_tokens("append_tokens", request.append_tokens, min_len=1)
        self.check_room("gamma", request.cache_len + len(feed) + gamma)
        # One hop to the forward thread for the whole draft (not one per token);
        # tokens come back through a queue as soon as each exists.
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        work = self.run(self._draft_all, request, session, params, feed, emit)
        work = asyncio.ensure_future(work)
        work.add_done_callback(lambda _: queue.put_nowait(None))
        while (item := await queue.get()) is not None:
            yield item
        await work  # re-raises a failure of the forward thread
        self.sessions.update_gauges()


class DraftServicer(SessionServicerMixin, draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, svc: DraftModel) -> None:
        self.svc = svc

    async def Propose(self, request, context: grpc.aio.ServicerContext):
        async for token in self.svc.propose(request):
            yield token


async def serve(
    cfg: ModelServiceConfig, model=None, tokenizer=None
) -> tuple[RunningServer, DraftModel]:
    """Load the draft model and start its server; returns (server, domain)."""
    svc = DraftModel("draft", cfg, model, tokenizer)
    running = await start_server(
        lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(DraftServicer(svc), s),
        [SERVICE_NAME],
        cfg.host,
        cfg.port,
        "draft",
        cfg.tls,
    )
    svc.start_sweeper()
    return running, svc
