"""The draft service's gRPC edge: protobuf in, one domain call, protobuf out."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from orchestrator.step import Cursor
from specdec import metrics, tracing
from specdec.config import MAX_GAMMA, ModelServiceConfig
from specdec.errors import InvalidArgument, require
from specdec.sampling import Verdict
from specdec.transport.relay import RelayClient
from specdec.transport.server import RunningServer, start_server
from specdec.transport.session_stream import session_stream
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2
from specdec.wire import DEFAULT_Q_BITS, WireShape, info_to_pb, pack_q, params_from_pb

from .drafter import Drafter
from .pipeline import Pipeline

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, svc: Drafter) -> None:
        self.svc = svc
        self.relay: RelayClient | None = None  # made on the first relayed propose

    def relay_client(self) -> RelayClient:
        if self.relay is None:
            cfg = self.svc.cfg
            self.relay = RelayClient(
                cfg.relay_tls, 16 * 1024 * 1024, cfg.relay_send_timeout_s, cfg.relay_keepalive_s
            )
        return self.relay

    async def aclose(self) -> None:
        if self.relay is not None:
            await self.relay.aclose()

    async def Session(self, requests, context):
        async for reply in session_stream(
            self.svc, requests, self.svc.cfg.session_ttl_s, self._open, self._step
        ):
            yield reply

    async def _open(self, m: common_pb2.OpenSession):
        shape = WireShape(
            m.wire_top_k, float(m.wire_eps), m.wire_bits or DEFAULT_Q_BITS, m.wire_hidden
        )
        session = await self.svc.open_draft(m.session_id, m.tokens, params_from_pb(m.params), shape)
        return session, draft_pb2.DraftReply(
            opened=common_pb2.SessionOpened(cache_len=session.length)
        )

    async def _step(self, session, kind: str, m: draft_pb2.DraftRequest):
        if kind == "propose":
            tracing.mark("propose")
            p = m.propose
            piped = p.HasField("pipeline") and p.HasField("relay") and bool(p.relay.target)
            if piped:
                self._check_pipeline(p)
            draft_on = not piped and p.HasField("relay") and p.relay.target
            draft_on = draft_on and p.relay.HasField("draft_on")
            if draft_on:
                self._check_draft_on(p)
            # A sampled step that drafts ahead: its verify's residual draws are guessed,
            # and the blocks after them drafted as the next step will ask (drafter).
            on = p.relay.draft_on
            guess_next = (on.gamma, on.seed) if draft_on and on.ahead else None
            proposal = await self.svc.propose(
                session,
                p.cache_len,
                p.append_tokens,
                p.gamma,
                p.seed,
                guess_next,
                guess=p.guess_residuals,
            )
            guesses = proposal.alternates if not session.params.greedy else None
            tracing.mark("drafted")
            q = pack_q(proposal.qs)
            relayed, relay_bytes = False, 0
            if p.HasField("relay") and p.relay.target:
                # Straight to the target, built in place (the relay is on the step's
                # path; the reply to the orchestrator is not); q comes back to the
                # orchestrator only if it could not be sent.
                request = target_pb2.RelayedVerify(relay_token=p.relay.relay_token)
                verify = request.verify
                verify.CopyFrom(p.relay.verify)
                verify.draft_tokens[:] = proposal.tokens
                verify.draft_q.CopyFrom(q)
                if guesses:
                    verify.guess_tokens[:] = guesses
                on_verdict = pipe = None
                if draft_on:
                    on_verdict = self._draft_on(session, p, proposal.tokens)
                elif piped:
                    pipe = Pipeline(
                        self.svc,
                        session,
                        self.relay_client(),
                        p.relay.target,
                        p.relay.relay_token,
                        p.pipeline.key,
                        p.gamma,
                        p.pipeline.depth,
                        verify.return_pit,
                        verify.draft_idle,
                        (p.pipeline.stream_seed, p.pipeline.stream_position),
                    )
                    t = Cursor(verify.cache_len, tuple(verify.pending_tokens))
                    d = Cursor(p.cache_len, tuple(p.append_tokens))
                    first = pipe.first(d, t, proposal, p.pipeline.tokens)
                    on_verdict, verify.seed = first.echo, first.seed
                    verify.pipeline = p.pipeline.key
                relayed, relay_bytes = await self.relay_client().send(
                    p.relay.target, request, on_verdict
                )
                if relayed and pipe is not None:
                    self.svc.start_pipeline(session, pipe)
                tracing.mark("relayed")
            out = draft_pb2.Proposal(
                tokens=proposal.tokens,
                cache_len=proposal.cache_len,
                compute_s=proposal.compute_s,
                forward_s=proposal.forward_s,
                batch_tokens=proposal.batch_tokens,
                relayed=relayed,
                relay_bytes=relay_bytes,
                lead_s=proposal.lead_s,
            )
            if not relayed:
                out.q.CopyFrom(q)
                if guesses:
                    out.guess_tokens[:] = guesses
            tracing.mark("reply")
            return draft_pb2.DraftReply(proposal=out)
        if kind == "rollback":
            removed = await self.svc.rollback_draft(session, m.rollback.cache_len)
            return draft_pb2.DraftReply(
                rolled_back=common_pb2.RolledBack(cache_len=session.length, removed=removed)
            )
        if kind == "retune":
            g = m.retune.gamma
            require(1 <= g <= MAX_GAMMA, "retune.gamma", f"must be in [1, {MAX_GAMMA}], got {g}")
            from_block = self.svc.retune_pipeline(session, g)
            return draft_pb2.DraftReply(retuned=draft_pb2.Retuned(from_block=from_block))
        raise InvalidArgument("kind", "a draft session takes open, propose, rollback or retune")

    def _draft_on(self, session, p: draft_pb2.Propose, drafts) -> Callable[[Any], None]:
        """What to do with this proposal's echoed verdict: draft on (``DraftOn``)."""
        on = p.relay.draft_on
        cursor = Cursor(p.cache_len, tuple(p.append_tokens))
        u, gamma, seed, ahead = list(on.uniforms), on.gamma, on.seed, on.ahead
        proposes = session.extra.proposes
        # A verdict that never comes (its relay lost) must not keep the session's cache.
        ref = weakref.ref(session)

        def on_verdict(v: target_pb2.Verdict) -> None:
            tracing.mark("echo")
            live = ref()
            if live is None or len(v.p_draft) != len(drafts):
                metrics.labelled(metrics.DRAFTED_ON, "skipped").inc()
                return
            verdict = Verdict(
                list(v.p_draft), list(v.q_draft), list(v.residual_tokens), v.bonus_token
            )
            self.svc.draft_on(live, proposes, cursor, drafts, verdict, u, gamma, seed, ahead)

        return on_verdict

    @staticmethod
    def _check_pipeline(p: draft_pb2.Propose) -> None:
        pipe = p.pipeline
        require(pipe.key != 0, "pipeline.key", "must be a nonzero 64-bit key")
        require(
            pipe.tokens >= p.gamma + 1,
            "pipeline.tokens",
            f"must be at least gamma + 1 ({p.gamma + 1}), got {pipe.tokens}",
        )
        require(pipe.depth <= 4, "pipeline.depth", f"must be in [0, 4], got {pipe.depth}")
        require(not p.guess_residuals, "pipeline", "a pipelined propose takes no guess_residuals")

    @staticmethod
    def _check_draft_on(p: draft_pb2.Propose) -> None:
        on = p.relay.draft_on
        require(
            len(on.uniforms) == p.gamma,
            "relay.draft_on.uniforms",
            f"needs one uniform per drafted token ({p.gamma}), got {len(on.uniforms)}",
        )
        require(
            1 <= on.gamma <= MAX_GAMMA,
            "relay.draft_on.gamma",
            f"must be in [1, {MAX_GAMMA}], got {on.gamma}",
        )

    async def Info(self, request, context):
        return info_to_pb(self.svc.info)


async def serve(
    cfg: ModelServiceConfig, model=None, tokenizer=None
) -> tuple[RunningServer, Drafter]:
    """Load the draft model and start its server; returns (server, domain)."""
    svc = Drafter(cfg, model, tokenizer)
    svc.start()
    servicer = DraftServicer(svc)
    svc.on_close(servicer.aclose)
    running = await start_server(
        lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s),
        [SERVICE_NAME],
        cfg.host,
        cfg.port,
        "draft",
        cfg.tls,
    )
    return running, svc
