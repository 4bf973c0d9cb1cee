"""Target service: ``Verify`` checks gamma drafted tokens in one forward pass.

It returns p_i(x_i) for each draft, a draw from the residual
norm(max(0, p_i - q_i)) for each position and a bonus draw from p_{gamma+1};
the orchestrator decides acceptance with its own uniforms.
"""

from __future__ import annotations

import grpc
import numpy as np
import torch

from specdec.config import ModelServiceConfig
from specdec.errors import require
from specdec.model import KVSession
from specdec.model_service import MAX_GAMMA, ModelService, SessionServicerMixin, params_from_pb
from specdec.sampling import SamplingParams, VerifyResult, verify_draft
from specdec.server import RunningServer, start_server
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetModel(ModelService):
    """The target model's domain: sessions plus verification."""

    def dense_q(self, draft_tokens: list[int], draft_q, device: torch.device) -> torch.Tensor:
        """The wire's q rows as a dense [gamma, vocab] tensor on ``device``, validated.

        Checks run on the small wire values with numpy (converting a repeated
        proto field is ~8x faster than through torch.tensor); only the dense
        result is built on the device (no gamma x vocab host-to-device copy).
        """
        vocab = self.vocab_size
        q = torch.zeros(len(draft_q), vocab, dtype=torch.float32, device=device)
        for i, (x, dist) in enumerate(zip(draft_tokens, draft_q, strict=True)):
            field = f"draft_q[{i}]"
            probs = np.array(dist.probs, dtype=np.float32)  # [k] or [vocab]
            if dist.token_ids:
                ids = np.array(dist.token_ids, dtype=np.int64)  # [k]
                require(
                    len(ids) == len(probs), field, "token_ids and probs must have equal lengths"
                )
                require(
                    bool(((ids >= 0) & (ids < vocab)).all()),
                    field,
                    f"token id outside the vocabulary [0, {vocab})",
                )
            else:
                require(
                    len(probs) == vocab,
                    field,
                    f"a dense q needs {vocab} probabilities, got {len(probs)}",
                )
                ids = np.arange(vocab)
            require(
                bool((probs >= 0).all()) and abs(float(probs.sum()) - 1.0) < 1e-3,
                field,
                "probabilities must be >= 0 and sum to 1",
            )
            require(
                float(probs[ids == x].sum()) > 0,
                field,
                f"drafted token {x} has q = 0; it cannot have been drawn from q",
            )
            q[i].index_put_(
                (torch.from_numpy(ids).to(device),),
                torch.from_numpy(probs).to(device),
                accumulate=True,
            )
        return q

    def _verify(
        self,
        session: KVSession,
        cache_len: int,
        pending: list[int],
        drafts: list[int],
        draft_q,
        params: SamplingParams,
        seed: int,
        keep_p: bool,
    ) -> VerifyResult:
        # [gamma, vocab], validated before the cache changes
        q = self.dense_q(drafts, draft_q, self.runner.device)
        self.truncate(session, cache_len)
        gamma = len(drafts)
        kind = "verify" if gamma else ("prefill" if len(pending) > 1 else "decode")
        logits = self.timed_forward(kind, session, pending + drafts, gamma + 1)  # [gamma+1, V]
        generator = torch.Generator(logits.device).manual_seed(seed)
        return verify_draft(
            logits,
            torch.tensor(drafts, dtype=torch.long, device=logits.device),
            q,
            params,
            generator,
            keep_p,
        )

    async def verify(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        session = self.session_at(request.session_id, request.cache_len)
        params = params_from_pb(request.params)
        pending = self.check_tokens("pending_tokens", request.pending_tokens, min_len=1)
        drafts = self.check_tokens("draft_tokens", request.draft_tokens)
        require(len(drafts) <= MAX_GAMMA, "draft_tokens", f"at most {MAX_GAMMA} drafted tokens")
        require(
            len(request.draft_q) == len(drafts),
            "draft_q",
            f"needs one distribution per drafted token ({len(drafts)}), got {len(request.draft_q)}",
        )
        self.check_room("draft_tokens", request.cache_len + len(pending) + len(drafts))
        result = await self.run(
            self._verify,
            session,
            request.cache_len,
            pending,
            drafts,
            request.draft_q,
            params,
            request.seed,
            request.return_dense_p,
        )
        self.sessions.update_gauges()
        response = target_pb2.VerifyResponse(
            p_draft=result.p_draft.tolist(),
            residual_tokens=result.residual_tokens.tolist(),
            bonus_token=result.bonus_token,
            cache_len=session.length,
        )
        if result.p is not None:
            response.dense_p.extend(common_pb2.Distribution(probs=row.tolist()) for row in result.p)
        return response


class TargetServicer(SessionServicerMixin, target_pb2_grpc.TargetServiceServicer):
    def __init__(self, svc: TargetModel) -> None:
        self.svc = svc

    async def Verify(self, request, context: grpc.aio.ServicerContext):
        return await self.svc.verify(request)


async def serve(
    cfg: ModelServiceConfig, model=None, tokenizer=None
) -> tuple[RunningServer, TargetModel]:
    """Load the target model and start its server; returns (server, domain)."""
    svc = TargetModel("target", cfg, model, tokenizer)
    running = await start_server(
        lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(TargetServicer(svc), s),
        [SERVICE_NAME],
        cfg.host,
        cfg.port,
        "target",
        cfg.tls,
    )
    svc.start_sweeper()
    return running, svc
