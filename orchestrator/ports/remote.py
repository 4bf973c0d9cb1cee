"""Ports to draft and target services over gRPC: one bidirectional session
stream per request and service.

A call writes one message and reads its reply on the session's stream (about
half the cost of a unary call here, and the session ends with the stream, so
it cannot leak). Failed calls become domain errors
(``specdec.transport.status.error_of``): the engine never sees a status code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from specdec.errors import DeadlineExceeded, Unavailable
from specdec.runtime.loading import ModelInfo
from specdec.sampling import Proposal, SamplingParams, Verdict
from specdec.transport.status import error_of
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.wire import WireShape, info_from_pb, pack_q, params_to_pb

from ..step import Cursor
from . import RelayTo, WireCounter


class _Stream:
    """One session stream: write a request, read its reply."""

    def __init__(self, peer: str, call: Any, counter: WireCounter | None) -> None:
        self.peer = peer
        self.call = call
        self.counter = counter

    async def ask(self, request, timeout: float | None, stale=None):
        """Write ``request`` (None: nothing, the reply is already due) and read its
        reply, passing over replies for which ``stale(reply)`` holds."""
        try:
            async with asyncio.timeout(timeout):
                if request is not None:
                    await self.call.write(request)
                reply = await self.call.read()
                while stale is not None and reply is not grpc.aio.EOF and stale(reply):
                    reply = await self.call.read()
        except grpc.aio.AioRpcError as e:
            raise error_of(e, self.peer) from None
        except TimeoutError:
            self.call.cancel()
            raise DeadlineExceeded(f"{self.peer}: no answer within {timeout:.3g} s") from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as e:  # the stream is over
            raise Unavailable(f"{self.peer}: session stream closed ({e})") from None
        if reply is grpc.aio.EOF:
            code = await self.call.code()
            raise Unavailable(f"{self.peer}: session stream ended ({code.name})")
        if self.counter is not None:
            sent = request.ByteSize() if request is not None else 0
            self.counter.count(self.peer, sent, reply.ByteSize())
        return reply

    async def close(self) -> None:
        if not self.call.done():
            try:
                await self.call.done_writing()
            except Exception:  # already broken: cancelling is all that is left
                pass
            self.call.cancel()


class RemoteDraftSession:
    def __init__(self, stream: _Stream) -> None:
        self.stream = stream
        self._ended: asyncio.Future | None = None

    def ended(self) -> asyncio.Future:
        """Done when the session's stream ends, whoever ends it: the draft died or
        dropped the session, or the connection broke (grpc ends the call at once;
        a draft that hangs with its connection open is seen only by timeouts)."""
        if self._ended is None:
            ended = self._ended = asyncio.get_running_loop().create_future()

            def done(_call) -> None:
                if not ended.done():
                    ended.set_result(None)

            self.stream.call.add_done_callback(done)
        return self._ended

    async def propose(
        self,
        cursor: Cursor,
        gamma: int,
        seed: int,
        timeout: float | None,
        relay: RelayTo | None = None,
        ahead: bool = False,
        guess: bool = False,
    ) -> Proposal:
        propose = draft_pb2.Propose(
            cache_len=cursor.cache_len,
            append_tokens=cursor.pending,
            gamma=gamma,
            seed=seed,
            guess_residuals=guess,
        )
        if relay is not None:
            to = propose.relay
            to.target, to.relay_token = relay.target, relay.token
            v = to.verify
            v.cache_len = relay.cursor.cache_len
            v.pending_tokens[:] = relay.cursor.pending
            v.seed, v.return_pit = relay.seed, relay.pit
            v.draft_idle = relay.draft_idle
            if relay.draft_on is not None:
                on = to.draft_on
                on.uniforms[:] = relay.draft_on.uniforms
                on.gamma, on.seed = relay.draft_on.gamma, relay.draft_on.seed
                on.ahead = relay.draft_on.ahead
            if relay.pipeline is not None:
                pipe = propose.pipeline
                pipe.key, pipe.tokens = relay.pipeline.key, relay.pipeline.tokens
                pipe.depth = relay.pipeline.depth
                pipe.stream_seed, pipe.stream_position = relay.pipeline.stream
        p = (await self.stream.ask(draft_pb2.DraftRequest(propose=propose), timeout)).proposal
        if len(p.tokens) != gamma and not (ahead and not p.tokens):
            raise Unavailable(f"draft: sent {len(p.tokens)} of {gamma} tokens")
        if self.stream.counter is not None and p.relay_bytes:
            self.stream.counter.count("relay", p.relay_bytes, 0)
        return Proposal(
            list(p.tokens),
            None,
            p.cache_len,
            packed=None if p.relayed else p.q,
            compute_s=p.compute_s,
            forward_s=p.forward_s,
            batch_tokens=p.batch_tokens,
            relayed=p.relayed,
            relay_bytes=p.relay_bytes,
            lead_s=p.lead_s,
            alternates=list(p.guess_tokens) or None,
        )

    async def rollback(self, cache_len: int, timeout: float | None) -> int:
        req = draft_pb2.DraftRequest(rollback=common_pb2.Rollback(cache_len=cache_len))
        return (await self.stream.ask(req, timeout)).rolled_back.cache_len

    async def retune(self, gamma: int, timeout: float | None) -> int:
        req = draft_pb2.DraftRequest(retune=draft_pb2.Retune(gamma=gamma))
        return (await self.stream.ask(req, timeout)).retuned.from_block

    async def close(self) -> None:
        await self.stream.close()


class RemoteTargetSession:
    def __init__(
        self, stream: _Stream, relay_token: bytes = b"", next_logits: bool = False
    ) -> None:
        self.stream = stream
        self.relay_token = relay_token
        self.next_logits = next_logits
        self.cancels: list[int] = []  # seeds of unconfirmed relays, sent with the next verify

    def cancel_relay(self, seed: int) -> None:
        self.cancels.append(seed)

    async def verify(
        self,
        cursor: Cursor,
        proposal: Proposal | None,
        seed: int,
        dense_p: bool,
        timeout: float | None,
        pit: bool = False,
        run: int = 1,
        follow: tuple[int, ...] = (),
        draft_idle: bool = False,
    ) -> Verdict:
        if follow:
            return await self._follow(follow, timeout, pit)
        v = target_pb2.Verify(
            cache_len=cursor.cache_len,
            pending_tokens=cursor.pending,
            seed=seed,
            return_dense_p=dense_p,
            return_pit=pit,
            run_tokens=run if run > 1 else 0,
            draft_idle=draft_idle,
        )
        request = None
        if proposal is None or not proposal.relayed:  # a relayed one is at the target
            if proposal is not None and proposal.tokens:
                v.draft_tokens.extend(proposal.tokens)
                v.draft_q.CopyFrom(
                    proposal.packed if proposal.packed is not None else pack_q(proposal.qs)
                )
                if proposal.alternates:  # (sampled: the greedy ones never come here)
                    v.guess_tokens.extend(proposal.alternates)
            if self.cancels:
                v.cancel_relays.extend(self.cancels)
                self.cancels.clear()
            request = target_pb2.TargetRequest(verify=v)

        def stale(reply) -> bool:  # the verdict of a relay this session gave up on
            echoed = reply.verdict.seed  # 0: a target from before relays (it sends none)
            return reply.WhichOneof("kind") == "verdict" and echoed not in (0, seed)

        r = (await self.stream.ask(request, timeout, stale)).verdict
        drafted = len(proposal.tokens) if proposal is not None else 0
        if len(r.p_draft) != drafted:  # never taken for another step's answer
            raise Unavailable(f"target: a verdict on {len(r.p_draft)} drafts, not {drafted}")
        return _verdict(r, pit)

    async def _follow(self, seeds: tuple[int, ...], timeout: float | None, pit: bool) -> Verdict:
        """A pipeline's next verdict: nothing is sent; any other seed's is stale."""

        def stale(reply) -> bool:
            return reply.WhichOneof("kind") == "verdict" and reply.verdict.seed not in seeds

        r = (await self.stream.ask(None, timeout, stale)).verdict
        if len(r.p_draft) != len(r.draft_tokens) or not r.draft_tokens:
            raise Unavailable(f"target: a pipelined verdict on {len(r.p_draft)} drafts")
        return _verdict(r, pit)

    async def rollback(self, cache_len: int, timeout: float | None) -> int:
        req = target_pb2.TargetRequest(rollback=common_pb2.Rollback(cache_len=cache_len))
        reply = await self.stream.ask(req, timeout, lambda r: r.WhichOneof("kind") == "verdict")
        return reply.rolled_back.cache_len

    async def close(self) -> None:
        await self.stream.close()


def _verdict(r: target_pb2.Verdict, pit: bool) -> Verdict:
    """The domain value of a Verdict message."""
    return Verdict(
        p_draft=list(r.p_draft),
        q_draft=list(r.q_draft),
        residual_tokens=list(r.residual_tokens),
        bonus_token=r.bonus_token,
        cache_len=r.cache_len,
        compute_s=r.compute_s,
        forward_s=r.forward_s,
        batch_tokens=r.batch_tokens,
        wide=r.wide,
        mass_above=list(r.mass_above) if pit else None,
        p_at=list(r.p_at) if pit else None,
        p=_dense(r.dense_p, len(r.p_draft) + 1) if r.dense_p else None,
        run_tokens=list(r.run_tokens),
        drafts=list(r.draft_tokens) or None,
        seed=r.seed,
        draft_forward_s=r.draft_forward_s,
    )


def _dense(values, rows: int):
    import torch

    return torch.tensor(list(values), dtype=torch.float32).reshape(rows, -1)


class _RemotePort:
    peer = ""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    async def info(self, timeout: float | None) -> ModelInfo:
        try:
            return info_from_pb(await self.stub.Info(common_pb2.InfoRequest(), timeout=timeout))
        except grpc.aio.AioRpcError as e:
            raise error_of(e, self.peer) from None

    async def _open(self, request, timeout: float | None, counter: WireCounter | None):
        """The session's stream, and the reply to its ``open``."""
        stream = _Stream(self.peer, self.stub.Session(), counter)
        try:
            reply = await stream.ask(request, timeout)
        except BaseException:
            await stream.close()
            raise
        return stream, reply

    async def aclose(self) -> None:
        await self.channel.close()


class RemoteDraft(_RemotePort):
    """A draft service replica behind a channel."""

    peer = "draft"

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(channel)
        self.stub = draft_pb2_grpc.DraftServiceStub(channel)

    async def open(
        self,
        session_id: str,
        tokens: Sequence[int],
        params: SamplingParams,
        shape: WireShape,
        timeout: float | None,
        counter: WireCounter | None = None,
    ) -> RemoteDraftSession:
        req = draft_pb2.DraftRequest(
            open=common_pb2.OpenSession(
                session_id=session_id,
                tokens=tokens,
                params=params_to_pb(params),
                wire_top_k=shape.max_entries,
                wire_eps=shape.eps,
                wire_bits=shape.bits,
                wire_hidden=shape.hidden,
            )
        )
        return RemoteDraftSession((await self._open(req, timeout, counter))[0])


class RemoteTarget(_RemotePort):
    """A target service replica behind a channel."""

    peer = "target"

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(channel)
        self.stub = target_pb2_grpc.TargetServiceStub(channel)

    async def open(
        self,
        session_id: str,
        tokens: Sequence[int],
        params: SamplingParams,
        timeout: float | None,
        counter: WireCounter | None = None,
    ) -> RemoteTargetSession:
        req = target_pb2.TargetRequest(
            open=common_pb2.OpenSession(
                session_id=session_id, tokens=tokens, params=params_to_pb(params)
            )
        )
        stream, reply = await self._open(req, timeout, counter)
        return RemoteTargetSession(stream, reply.opened.relay_token, reply.opened.next_logits)
