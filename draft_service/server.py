"""Draft service: ``Propose`` streams drafted tokens with their proposal q.

Each drafted token is sampled from q, the warped draft distribution truncated
to its ``wire_top_k`` most likely entries; that truncated q is exactly what
goes on the wire, so the orchestrator's acceptance test stays exact.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import torch

from specdec.config import ModelServiceConfig
from specdec.errors import require
from specdec.model import KVSession
from specdec.model_service import ModelService, SessionServicerMixin, params_from_pb
from specdec.sampling import SamplingParams, draft_distribution, sparse_to_dense
from specdec.server import RunningServer, start_server
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

MAX_GAMMA = 64
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
    ):
        logits = self.timed_forward(kind, session, feed)[-1]  # [vocab]
        ids, probs = draft_distribution(logits, params, wire_top_k)  # [k], [k]
        if ids.numel() == 1:
            return int(ids[0]), ids, probs
        pick = torch.multinomial(probs, 1, generator=generator)
        return int(ids[pick]), ids, probs

    def _prepare(self, session: KVSession, cache_len: int) -> None:
        self.truncate(session, cache_len)

    async def propose(
        self, request: draft_pb2.ProposeRequest
    ) -> AsyncIterator[draft_pb2.DraftToken]:
        session = self.svc_session(request)
        params = params_from_pb(request.params)
        gamma = request.gamma
        require(1 <= gamma <= MAX_GAMMA, "gamma", f"must be in [1, {MAX_GAMMA}], got {gamma}")
        require(request.wire_top_k >= 0, "wire_top_k", "must be >= 0")
        feed = self.check_tokens("append_tokens", request.append_tokens, min_len=1)
        self.check_room("gamma", request.cache_len + len(feed) + gamma)
        generator = torch.Generator().manual_seed(request.seed)
        await self.run(self._prepare, session, request.cache_len)
        kind = "prefill" if len(feed) > 1 else "propose"
        for index in range(gamma):
            token, ids, probs = await self.run(
                self._draft_one, session, feed, params, generator, request.wire_top_k, kind
            )
            if request.wire_top_k == 0 and not params.greedy:
                q = common_pb2.Distribution(
                    probs=sparse_to_dense(ids, probs, self.vocab_size).tolist()
                )
            else:
                q = common_pb2.Distribution(token_ids=ids.tolist(), probs=probs.tolist())
            yield draft_pb2.DraftToken(index=index, token_id=token, q=q, cache_len=session.length)
            feed, kind = [token], "propose"
        self.sessions.update_gauges()

    def svc_session(self, request) -> KVSession:
        return self.session_at(request.session_id, request.cache_len)


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
