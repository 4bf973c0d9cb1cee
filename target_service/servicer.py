"""The target service's gRPC edge: protobuf in, one domain call, protobuf out."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

from orchestrator.step import Cursor, follows_in_full, guess_holds
from specdec import tracing
from specdec.config import ModelServiceConfig
from specdec.errors import InvalidArgument
from specdec.sampling import Verdict
from specdec.transport.relay import RelayInboxes
from specdec.transport.server import RunningServer, start_server
from specdec.transport.session_stream import session_stream
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.wire import info_to_pb, params_from_pb, unpack_q

from .verifier import Verifier

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, svc: Verifier) -> None:
        self.svc = svc
        self.inboxes = RelayInboxes()  # open sessions, for verifies a draft relays
        self.relays: set[asyncio.Queue] = set()  # each open Relay stream's answers
        svc.on_drained(self._end_relays)

    def _end_relays(self) -> None:
        """Drained: each draft's relay stream ends (OK), as its handler reads None."""
        for acks in self.relays:
            acks.put_nowait(None)

    async def Session(self, requests, context):
        async for reply in session_stream(
            self.svc,
            requests,
            self.svc.cfg.session_ttl_s,
            self._open,
            self._step,
            self.inboxes,
            self.svc.decode_ahead,
        ):
            yield reply

    async def Relay(self, requests, context):
        """Queue each relayed verify on its session; its verdict goes out on the
        session's own stream. A refusal is answered here, and so is the verdict of a
        relay that asks for an echo (``specdec.transport.relay``)."""
        acks: asyncio.Queue = asyncio.Queue()

        def echo(tag: int, verdict: target_pb2.Verdict) -> None:
            acks.put_nowait(target_pb2.RelayAck(tag=tag, accepted=True, verdict=verdict))

        async def read() -> None:
            try:
                async for m in requests:
                    tracing.mark("relay")
                    request = target_pb2.TargetRequest(verify=m.verify)
                    back = functools.partial(echo, m.tag) if m.echo else None
                    ids = (m.verify.seed, m.verify.pipeline)
                    reason = self.inboxes.deliver(m.relay_token, request, ids, back)
                    if reason:
                        acks.put_nowait(
                            target_pb2.RelayAck(tag=m.tag, accepted=False, reason=reason)
                        )
                acks.put_nowait(None)
            except Exception as e:  # the stream broke: the handler ends with it
                acks.put_nowait(e)

        reader = asyncio.get_running_loop().create_task(read())
        self.relays.add(acks)
        try:
            while (ack := await acks.get()) is not None:
                if isinstance(ack, Exception):
                    raise ack
                yield ack
        finally:
            self.relays.discard(acks)
            reader.cancel()

    async def _open(self, m: common_pb2.OpenSession):
        session = await self.svc.open(m.session_id, m.tokens, params_from_pb(m.params))
        return session, target_pb2.TargetReply(
            opened=common_pb2.SessionOpened(
                cache_len=session.length, next_logits=session.extra.length == session.length
            )
        )

    async def _step(self, session, kind: str, m: target_pb2.TargetRequest):
        if kind == "verify":
            tracing.mark("verify")
            v = m.verify
            cache_len, pending = v.cache_len, v.pending_tokens
            if v.HasField("chain"):  # a pipelined block: only right after its block
                cursor = _follows(session.extra.verify, v.chain, cache_len, pending)
                if cursor is None:
                    return None  # dropped: the draft learns why from the verdict before
                cache_len, pending = cursor.cache_len, cursor.pending
                tracing.mark(_chain_mark(v.chain))
            pending, drafts = self.svc.check_verify(session, cache_len, pending, v.draft_tokens)
            qs = unpack_q(
                v.draft_q, self.svc.vocab_size, drafts, head=self.svc.head, params=session.params
            )
            tracing.mark("unpacked")
            verdict = await self.svc.verify(
                session,
                cache_len,
                pending,
                drafts,
                qs,
                v.seed,
                v.return_dense_p,
                v.return_pit,
                v.run_tokens,
                v.guess_tokens,
                v.draft_idle,
            )
            out = target_pb2.Verdict(
                p_draft=verdict.p_draft,
                q_draft=verdict.q_draft,
                residual_tokens=verdict.residual_tokens,
                bonus_token=verdict.bonus_token,
                cache_len=verdict.cache_len,
                compute_s=verdict.compute_s,
                forward_s=verdict.forward_s,
                batch_tokens=verdict.batch_tokens,
                run_tokens=verdict.run_tokens,
                seed=v.seed,
                wide=verdict.wide,
                draft_forward_s=v.draft_forward_s,
            )
            if verdict.mass_above is not None:
                out.mass_above.extend(verdict.mass_above)
                out.p_at.extend(verdict.p_at)
            if verdict.p is not None:
                out.dense_p.extend(verdict.p.flatten().tolist())
            if v.pipeline:
                out.draft_tokens.extend(drafts)
            # What a pipelined block that follows this verify is judged on.
            session.extra.verify = _Last(v.seed, cache_len + len(pending), len(drafts), out)
            if v.pipeline:  # greedy: decode on from where this leaves the target, meanwhile
                self.svc.after_verdict(
                    session, cache_len + len(pending), drafts, verdict, v.alternates
                )
            tracing.mark("reply")
            return target_pb2.TargetReply(verdict=out)
        if kind == "rollback":
            # No pipelined block follows across a rollback, nor a continuation of its own.
            session.extra.verify = session.extra.ahead = None
            removed = self.svc.rollback(session, m.rollback.cache_len)
            return target_pb2.TargetReply(
                rolled_back=common_pb2.RolledBack(cache_len=session.length, removed=removed)
            )
        raise InvalidArgument("kind", "a target session takes open, verify or rollback")

    async def Info(self, request, context):
        return info_to_pb(self.svc.info)


@dataclass(frozen=True)
class _Last:
    """A session's last verify: its seed, the end of the cursor it ran from, its
    drafts and its verdict as sent (the values its caller judges)."""

    seed: int
    end: int
    drafts: int
    verdict: target_pb2.Verdict


def _follows(last: _Last | None, chain: target_pb2.Chain, cache_len: int, pending):
    """The cursor a pipelined block starts from, or None if it does not follow."""
    if last is None or last.seed != chain.after_seed:
        return None
    v = last.verdict
    if chain.after_rejection and not chain.rejected_at:
        return Cursor(cache_len, tuple(pending))
    if len(chain.uniforms) != last.drafts:
        return None
    judged = Verdict(list(v.p_draft), list(v.q_draft), list(v.residual_tokens), v.bonus_token)
    u = list(chain.uniforms)
    if chain.after_rejection:  # a guess: only for the rejection it was drafted for
        token = chain.residual_token
        if not guess_holds(last.drafts, judged, u, chain.rejected_at, token):
            return None
        return Cursor(last.end + chain.rejected_at - 1, (token,))  # (settle's)
    return follows_in_full(last.end, last.drafts, judged, u, chain.match, chain.first_token)


def _chain_mark(chain: target_pb2.Chain) -> str:
    """The trace mark of a pipelined block that runs (``benchmarks.pipeline_timeline``)."""
    if chain.rejected_at:
        return "chain-guess"
    return "chain-fresh" if chain.after_rejection else "chain-follower"


async def serve(
    cfg: ModelServiceConfig, model=None, tokenizer=None
) -> tuple[RunningServer, Verifier]:
    """Load the target model and start its server; returns (server, domain)."""
    svc = Verifier(cfg, model, tokenizer)
    svc.start()
    running = await start_server(
        lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(TargetServicer(svc), s),
        [SERVICE_NAME],
        cfg.host,
        cfg.port,
        "target",
        cfg.tls,
    )
    return running, svc
