"""Property-based fuzzing of every public RPC through real services (hypothesis).

Each test drives one RPC with generated requests: random field values,
boundary numbers, NaN and infinities, huge repeated fields, session ids that
are live, empty, too long or odd, wrong cache lengths, malformed packed
distributions (sizes, escapes, counts, bits, duplicate ids, tails) and session
messages in the wrong order. (A session is its stream: after ``open`` no
message names a session, so there is no "unknown session id" to send.)
An *oracle* written from the proto comments (not from the services' code)
predicts each outcome:

* a valid message gets its reply, and the reply is checked (cache lengths,
  token counts, q_i(x_i) read from the q that was sent, a draft's q decoded
  by the reference decoder below);
* an invalid one ends its stream with a documented status (INVALID_ARGUMENT
  naming a field that is wrong, FAILED_PRECONDITION for a cache length the
  session does not have, ALREADY_EXISTS for a live session id), never
  INTERNAL or UNKNOWN.

After every example the three processes are alive and live sessions and
cached tokens are back where they were; after every test a normal request
still succeeds. Raw garbage bytes go to every method too (generic calls with
identity serializers): a status comes back and the service survives.

Runs are reproducible (``derandomize``: the seed is derived from the test) and
leave no example database. ``SPECDEC_FUZZ_EXAMPLES`` scales the examples per
RPC (default 300) for a deeper run.
"""

from __future__ import annotations

import math
import os
import queue
import time
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.runtime.loading import load_tokenizer
from specdec.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

from .stack import free_port, local_stack
from .tiny import vocab_size

EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

VOCAB = vocab_size()
# Small limits, so that every boundary is cheap to reach and valid requests are quick.
MAX_CONTEXT = 64  # draft and target
MAX_NEW = 16  # orchestrator.max_new_tokens
MAX_PROMPT = 40  # orchestrator.max_prompt_tokens
MAX_GAMMA_REQUEST = 16  # orchestrator.max_gamma (default)
MAX_STOPS = 8  # orchestrator.max_stop_sequences (default)
MAX_STOP_CHARS = 256
MAX_SESSION_ID = 128
MODEL_MAX_GAMMA = 64  # specdec.config.MAX_GAMMA
MIN_TEMPERATURE = 1e-4
HELD = "held"  # a session id kept live on draft and target during the tests
HELD_TOKENS = [1, 2, 3]
TIMEOUT = 30

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
EXISTS = grpc.StatusCode.ALREADY_EXISTS
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
# What unparseable bytes get: the interceptor's INVALID_ARGUMENT naming the request
# (specdec.transport.server; before it, grpc's own UNKNOWN or an INTERNAL came back).
UNPARSEABLE = {INVALID}
# The codes the protos document for a message that parses.
DOCUMENTED = {OK, INVALID, PRECONDITION, EXISTS, EXHAUSTED}


# ---- the stack -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz(tmp_path_factory, llama_pair):
    """A stack with small limits, a live session "held" on draft and target, and the
    target's tokenizer (to count a text prompt's tokens)."""
    with local_stack(
        tmp_path_factory.mktemp("fuzz"),
        *llama_pair,
        draft__max_context=MAX_CONTEXT,
        target__max_context=MAX_CONTEXT,
        orchestrator__max_new_tokens=MAX_NEW,
        orchestrator__max_prompt_tokens=MAX_PROMPT,
    ) as stack:
        channels = {r: grpc.insecure_channel(stack.address(r)) for r in stack.ROLES}
        held = [
            Stream(draft_pb2_grpc.DraftServiceStub(channels["draft"]), 3600),
            Stream(target_pb2_grpc.TargetServiceStub(channels["target"]), 3600),
        ]
        opening = common_pb2.OpenSession(session_id=HELD, tokens=HELD_TOKENS)
        held[0].ask(draft_pb2.DraftRequest(open=opening))
        held[1].ask(target_pb2.TargetRequest(open=opening))
        f = Fuzz(stack, channels, load_tokenizer(str(llama_pair[1])))
        f.baseline = {"draft": (1, len(HELD_TOKENS)), "target": (1, len(HELD_TOKENS))}
        f.settled()
        yield f
        for s in held:
            s.close()
        f.baseline = {"draft": (0, 0), "target": (0, 0)}
        f.settled()
        assert stack.metric("orchestrator", "specdec_live_requests") == 0
        for ch in channels.values():
            ch.close()


@dataclass
class Fuzz:
    stack: object
    channels: dict
    tokenizer: object
    baseline: dict | None = None

    def gauges(self, role: str) -> tuple[float, float]:
        """(live sessions, cached tokens) of a model service, from one scrape."""
        values = {}
        for line in self.stack.metrics_text(role).splitlines():
            name = line.split("{", 1)[0]
            if name in ("specdec_model_live_sessions", "specdec_model_cached_tokens"):
                if f'role="{role}"' in line:
                    values[name] = float(line.rsplit(" ", 1)[1])
        return values["specdec_model_live_sessions"], values["specdec_model_cached_tokens"]

    def settled(self, timeout: float = 10.0) -> None:
        """All three processes alive; live sessions and cached tokens back to the baseline."""
        for role in self.stack.ROLES:
            assert self.stack.proc(role).poll() is None, f"{role} died"
        deadline = time.monotonic() + timeout
        while True:
            now = {r: self.gauges(r) for r in ("draft", "target")}
            if now == self.baseline:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"sessions/cached tokens {now}, expected {self.baseline}")
            time.sleep(0.02)

    def still_serves(self) -> None:
        """A normal request after the fuzzing still succeeds, end to end."""
        ids, _, stats = self.stack.generate_raw(
            prompt="still here", max_new_tokens=8, temperature=0.0, gamma=3
        )
        assert stats.generated_tokens == len(ids) == 8 and stats.drafted_tokens > 0


class Stream:
    """One session stream driven message by message (the next is chosen after a reply)."""

    def __init__(self, stub, timeout: float = TIMEOUT) -> None:
        self.outbox: queue.Queue = queue.Queue()
        self.call = stub.Session(iter(self.outbox.get, None), timeout=timeout)

    def ask(self, message):
        """The reply to ``message``; raises grpc.RpcError if the stream ends with a status."""
        self.outbox.put(message)
        try:
            return next(self.call)
        except StopIteration:
            raise AssertionError("the stream ended without a reply or a status") from None

    def close(self) -> None:
        self.outbox.put(None)
        assert list(self.call) == []  # ends cleanly, with no further reply

    def abandon(self) -> None:
        """Cancel (if still running) and let the request-sending thread finish."""
        self.call.cancel()
        self.outbox.put(None)


# ---- values ------------------------------------------------------------------------------
INT32 = st.one_of(
    st.sampled_from([0, 1, -1, 2, 3, VOCAB - 1, VOCAB, 63, 64, 65, 255, 256, 2**31 - 1, -(2**31)]),
    st.integers(-(2**31), 2**31 - 1),
)
UINT32 = st.one_of(
    st.sampled_from([0, 1, 2, 254, 255, 256, 2**16, 2**30, 2**31, 2**32 - 1]),
    st.integers(0, 2**32 - 1),
)
UINT64 = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
FLOAT32 = st.one_of(
    st.sampled_from(
        [0.0, -0.0, 1.0, 0.5, 2.0, -1.0, 1e-4, 9.9e-5, 1e-38, 1e-45, 3.4e38, 1e39]
        + [math.nan, math.inf, -math.inf, 1.0000001, 0.9999999]
    ),
    st.floats(width=32),
)
TOKEN = st.integers(0, VOCAB - 1)


def token_lists(valid_size=(0, 12)) -> st.SearchStrategy[list[int]]:
    """Mostly valid ids; sometimes any int32; sometimes one value repeated a lot."""
    lo, hi = valid_size
    return st.one_of(
        st.lists(TOKEN, min_size=lo, max_size=hi),
        st.lists(TOKEN, min_size=lo, max_size=hi),
        st.lists(INT32, max_size=hi),
        st.builds(
            lambda v, n: [v] * n,
            st.sampled_from([1, VOCAB - 1, VOCAB, -1]),
            st.sampled_from([MAX_CONTEXT - 1, MAX_CONTEXT, MAX_CONTEXT + 1, 5000, 300_000]),
        ),
    )


SESSION_IDS = st.one_of(
    st.sampled_from(["s", "s", "", HELD, "x" * MAX_SESSION_ID, "x" * (MAX_SESSION_ID + 1)]),
    st.sampled_from(["é" * MAX_SESSION_ID, "\x00", "../../etc/passwd"]),
    st.text(max_size=140),
)
PARAMS = st.builds(common_pb2.SamplingParams, temperature=FLOAT32, top_k=INT32, top_p=FLOAT32)
GOOD_PARAMS = st.builds(
    common_pb2.SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([0, 0, 5]),
    top_p=st.sampled_from([0.0, 1.0, 0.9]),
)


def opens(draft: bool, clean: bool) -> st.SearchStrategy[common_pb2.OpenSession]:
    """OpenSession messages: valid ones (``clean``), or anything."""
    wire = {}
    if draft:
        wire = dict(
            wire_top_k=st.one_of(st.sampled_from([0, 1, 4, 16, VOCAB, VOCAB + 1]), INT32),
            wire_eps=st.one_of(st.sampled_from([0.0, 0.1, 0.49, 0.5]), FLOAT32),
            wire_bits=st.one_of(st.sampled_from([0, 1, 4, 8, 16, 30, 31]), INT32),
        )
    good_wire = {}
    if draft:
        good_wire = dict(
            wire_top_k=st.sampled_from([0, 3, 16]),
            wire_eps=st.sampled_from([0.0, 0.1]),
            wire_bits=st.sampled_from([0, 8]),
        )
    good = st.builds(
        common_pb2.OpenSession,
        session_id=st.sampled_from(["s", "s", "s", "s", HELD]),
        tokens=st.lists(TOKEN, max_size=12),
        params=GOOD_PARAMS,
        **good_wire,
    )
    wild = st.builds(
        common_pb2.OpenSession,
        session_id=SESSION_IDS,
        tokens=token_lists(),
        params=st.one_of(GOOD_PARAMS, PARAMS),
        **wire,
    )
    return good if clean else wild


def sorted_ids(k: int) -> st.SearchStrategy[list[int]]:
    return st.lists(TOKEN, min_size=1, max_size=k, unique=True).map(sorted)


@st.composite
def q_positions(draw, drafts: list[int], clean: bool) -> list:
    """bits and a q for each drafted token, (ids, counts, tail): a valid one if ``clean``
    (else the drafted token may be missing from a q without a tail)."""
    out = []
    bits = draw(st.sampled_from([16, 16, 1, 2, 8, 30]))
    scale = 1 << bits
    for x in drafts:
        ids = draw(sorted_ids(12))
        if (clean or draw(st.booleans())) and 0 <= x < VOCAB and x not in ids:
            ids = sorted([*ids, x])  # mostly the drafted token is listed
        ids = ids[:scale]
        tail = 0
        if len(ids) < VOCAB and len(ids) < scale and draw(st.booleans()):
            tail = draw(st.integers(1, scale - len(ids)))
        left = scale - tail
        counts = [left // len(ids)] * len(ids)
        counts[0] += left - sum(counts)
        out.append((ids, counts, tail))
    return [bits, out]


def encode_q(bits: int, positions) -> common_pb2.PackedQ:
    """PackedQ as common.proto describes it: ascending ids delta-coded from 0, values
    one byte each with 255 escaping to the matching escapes field."""
    deltas, counts, id_esc, count_esc = [], [], [], []
    for ids, cs, _ in positions:
        for d in [ids[0]] + [b - a for a, b in zip(ids, ids[1:], strict=False)]:
            deltas.append(min(d, 255))
            if d >= 255:
                id_esc.append(d)
        for c in cs:
            counts.append(min(c, 255))
            if c >= 255:
                count_esc.append(c)
    return common_pb2.PackedQ(
        sizes=[len(p[0]) for p in positions],
        id_deltas=bytes(deltas),
        id_escapes=id_esc,
        counts=bytes(counts),
        count_escapes=count_esc,
        tails=[p[2] for p in positions],
        bits=bits,
    )


@st.composite
def packed_qs(draw, drafts: list[int], clean: bool) -> common_pb2.PackedQ | None:
    """A q for ``drafts``: valid (``clean``); or valid, with one corruption, random
    fields, or none."""
    how = "valid"
    if not clean:
        how = draw(st.sampled_from(["valid", "corrupt", "corrupt", "random", "absent"]))
    if how == "absent":
        return None
    if how == "random":
        return common_pb2.PackedQ(
            sizes=draw(st.lists(st.one_of(st.integers(0, 4), UINT32), max_size=6)),
            id_deltas=draw(st.binary(max_size=24)),
            id_escapes=draw(st.lists(UINT32, max_size=3)),
            counts=draw(st.binary(max_size=24)),
            count_escapes=draw(st.lists(UINT32, max_size=3)),
            tails=draw(st.lists(st.one_of(st.integers(0, 4), UINT32), max_size=6)),
            bits=draw(st.one_of(st.integers(0, 31), UINT32)),
        )
    bits, positions = draw(q_positions(drafts, clean))
    q = encode_q(bits, positions)
    if how == "valid":
        return q
    corruption = draw(
        st.sampled_from(
            [
                "size",
                "tail",
                "bits",
                "count_zero",
                "count_byte",
                "duplicate_id",
                "escape_missing",
                "escape_extra",
                "id_beyond_vocab",
                "truncate",
                "drop_position",
                "huge",
            ]
        )
    )
    if corruption == "size" and q.sizes:
        i = draw(st.integers(0, len(q.sizes) - 1))
        q.sizes[i] = draw(st.sampled_from([0, q.sizes[i] + 1, max(0, q.sizes[i] - 1), 2**32 - 1]))
    elif corruption == "tail" and q.tails:
        i = draw(st.integers(0, len(q.tails) - 1))
        q.tails[i] = draw(st.sampled_from([q.tails[i] + 1, 2**32 - 1, 1 << bits]))
    elif corruption == "bits":
        q.bits = draw(st.sampled_from([0, 31, 32, 255, 2**32 - 1, bits + 1]))
    elif corruption == "count_zero" and q.counts:
        i = draw(st.integers(0, len(q.counts) - 1))
        q.counts = q.counts[:i] + b"\x00" + q.counts[i + 1 :]
    elif corruption == "count_byte" and q.counts:
        i = draw(st.integers(0, len(q.counts) - 1))
        q.counts = q.counts[:i] + bytes([draw(st.integers(0, 255))]) + q.counts[i + 1 :]
    elif corruption == "duplicate_id" and len(q.id_deltas) > 1:
        i = draw(st.integers(1, len(q.id_deltas) - 1))
        q.id_deltas = q.id_deltas[:i] + b"\x00" + q.id_deltas[i + 1 :]
    elif corruption == "escape_missing":
        q.id_deltas += b"\xff"
    elif corruption == "escape_extra":
        q.count_escapes.append(draw(UINT32))
    elif corruption == "id_beyond_vocab" and q.id_deltas:
        q.id_deltas = b"\xff" + q.id_deltas[1:]
        q.id_escapes.insert(0, draw(st.sampled_from([VOCAB, 2**32 - 1, 300])))
    elif corruption == "truncate":
        q.counts = q.counts[:-1]
    elif corruption == "drop_position" and q.sizes:
        del q.tails[-1]
    elif corruption == "huge":
        q.sizes.extend([1] * 100_000)
        q.id_deltas += b"\x01" * 100_000
    return q


# ---- the oracle ----------------------------------------------------------------------------
@dataclass
class Expect:
    """An outcome the proto comments promise: a reply, or a status naming one of ``fields``."""

    code: grpc.StatusCode = OK
    fields: tuple[str, ...] = ()


def invalid(*fields: str) -> Expect:
    return Expect(INVALID, fields)


def names_one_of(details: str, fields: tuple[str, ...]) -> bool:
    """The message starts with one of ``fields`` or a part of it ("draft_q[0]: ...")."""
    named = details.split(":", 1)[0]
    return any(named == f or named.startswith((f + ".", f + "[")) for f in fields)


def params_errors(p: common_pb2.SamplingParams, prefix: str = "params.") -> list[str]:
    """common.proto SamplingParams: temperature 0 or >= 1e-4, top_k >= 0, top_p in (0, 1]
    with 0 read as 1."""
    t, top_p = p.temperature, p.top_p or 1.0
    wrong = []
    if not (math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)):
        wrong.append(prefix + "temperature")
    if p.top_k < 0:
        wrong.append(prefix + "top_k")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        wrong.append(prefix + "top_p")
    return wrong


def tokens_ok(tokens, min_len: int = 0) -> bool:
    return len(tokens) >= min_len and all(0 <= t < VOCAB for t in tokens)


def expect_open(m: common_pb2.OpenSession, draft: bool) -> Expect:
    wrong = params_errors(m.params)
    if draft:
        if m.wire_top_k < 0:
            wrong.append("wire_top_k")
        if not 0 <= m.wire_eps < 0.5:
            wrong.append("wire_eps")
        if not 1 <= (m.wire_bits or 16) <= 30:
            wrong.append("wire_bits")
    if not 0 < len(m.session_id) <= MAX_SESSION_ID:
        wrong.append("session_id")
    if not tokens_ok(m.tokens) or len(m.tokens) > MAX_CONTEXT:
        wrong.append("tokens")
    if wrong:
        return invalid(*wrong)
    if m.session_id == HELD:
        return Expect(EXISTS, ("session_id",))
    return Expect()


def decode_q(pb: common_pb2.PackedQ, drafts: list[int]):
    """The reference decoder (from common.proto): [(ids, counts, tail, bits)] per drafted
    token, or None if ``pb`` is not a distribution over the vocabulary for each drafted
    token that gives it a positive probability."""
    gamma = len(drafts)
    if len(pb.sizes) != gamma or len(pb.tails) != gamma:
        return None
    if gamma == 0:
        return []
    bits = pb.bits or 16
    if not 1 <= bits <= 30:
        return None

    def unescape(data: bytes, escapes):
        if sum(b == 255 for b in data) != len(escapes):
            return None
        it = iter(escapes)
        return [next(it) if b == 255 else b for b in data]

    deltas = unescape(pb.id_deltas, pb.id_escapes)
    counts = unescape(pb.counts, pb.count_escapes)
    total = sum(pb.sizes)
    if deltas is None or counts is None or not total == len(deltas) == len(counts):
        return None
    out, start = [], 0
    for size, tail, x in zip(pb.sizes, pb.tails, drafts, strict=True):
        d, c = deltas[start : start + size], counts[start : start + size]
        start += size
        ids = list(accumulate(d))
        if (
            size == 0
            or 0 in d[1:]
            or ids[-1] >= VOCAB
            or min(c) <= 0
            or sum(c) + tail != 1 << bits
            or (tail and size >= VOCAB)
            or (x not in ids and tail == 0)
        ):
            return None
        out.append((ids, c, tail, bits))
    return out


def q_of(position, x: int) -> float:
    ids, counts, tail, bits = position
    if x in ids:
        return counts[ids.index(x)] / (1 << bits)
    return tail / ((1 << bits) * (VOCAB - len(ids)))


def room_errors(cache_len: int, needed: int, room_field: str) -> list[str]:
    """A cache length must be >= 0, and the session may not outgrow max_context."""
    wrong = []
    if cache_len < 0:
        wrong.append("cache_len")
    if needed > MAX_CONTEXT:
        wrong.append(room_field)
    return wrong


# ---- session messages ----------------------------------------------------------------------
def cache_lens(length: int) -> st.SearchStrategy[int]:
    """Mostly the length the session has (or one it can roll back to), often wrong."""
    return st.one_of(
        st.just(length),
        st.just(length),
        st.integers(0, length),
        st.sampled_from([length + 1, length - 1, -1, 0, MAX_CONTEXT, MAX_CONTEXT + 1]),
        INT32,
    )


def gammas() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, -1, 4, 64, 65, 2**31 - 1]), INT32)


# Most messages have every field valid (they may still not fit the session), so that
# streams get deep; the others have any values.
CLEAN = st.sampled_from([True] * 5 + [False])


@dataclass
class SessionModel:
    """What a session should hold, by the oracle."""

    length: int = -1  # -1: not open yet
    greedy: bool = False
    wire_top_k: int = 0
    kept_at: int = -1  # target: the cache length its last pass's logits follow (-1: none)


def next_kind(data, s: SessionModel, step: str) -> tuple[str, bool]:
    """The kind of the next message (mostly the right one) and whether it is clean."""
    kind = data.draw(
        st.sampled_from(["open", step, step, step, step, "rollback", "empty"])
        if s.length >= 0
        else st.sampled_from(["open"] * 12 + [step, "rollback", "empty"])
    )
    return kind, data.draw(CLEAN)


def session_control(data, s: SessionModel, request, draft: bool, step: str):
    """The message kinds draft and target sessions share (open, an empty message,
    rollback): (message, expected outcome, clean). When the next message is the
    service's own ``step`` instead: (None, the outcome expected so far, clean)."""
    kind, clean = next_kind(data, s, step)
    if kind == "open":
        m = data.draw(opens(draft=draft, clean=clean))
        e = expect_open(m, draft=draft) if s.length < 0 else invalid("open")
        return request(open=m), e, clean
    e = invalid("open") if s.length < 0 else None
    if kind == "empty":
        return request(), e if s.length < 0 else invalid("kind"), clean
    if kind == "rollback":
        c = data.draw(st.integers(0, max(s.length, 0)) if clean else cache_lens(max(s.length, 0)))
        m = request(rollback=common_pb2.Rollback(cache_len=c))
        if s.length >= 0:
            e = invalid("cache_len") if c < 0 else Expect(PRECONDITION, ("cache_len",))
            e = Expect() if 0 <= c <= s.length else e
        return m, e, clean
    return None, e, clean


def draft_message(data, s: SessionModel):
    """The next draft message for a session in state ``s``, and the expected outcome."""
    m, e, clean = session_control(data, s, draft_pb2.DraftRequest, draft=True, step="propose")
    if m is not None:
        return m, e
    if clean:
        c = data.draw(st.sampled_from([s.length] * 4 + [s.length - 1, s.length + 1]))
        append = data.draw(st.lists(TOKEN, min_size=1, max_size=4))
        gamma = data.draw(st.integers(1, 4))
    else:
        c = data.draw(cache_lens(max(s.length, 0)))
        append = data.draw(token_lists(valid_size=(1, 4)))
        gamma = data.draw(gammas())
    m = draft_pb2.DraftRequest(
        propose=draft_pb2.Propose(
            cache_len=c, append_tokens=append, gamma=gamma, seed=data.draw(UINT64)
        )
    )
    if s.length >= 0:
        wrong = room_errors(c, c + len(append) + gamma, "gamma")
        if not 1 <= gamma <= MODEL_MAX_GAMMA:
            wrong.append("gamma")
        if not tokens_ok(append, min_len=1):
            wrong.append("append_tokens")
        e = invalid(*wrong) if wrong else Expect()
        if not wrong and c > s.length:
            e = Expect(PRECONDITION, ("cache_len",))
    return m, e


def check_draft_reply(m, reply, s: SessionModel) -> None:
    kind = m.WhichOneof("kind")
    if kind == "open":
        assert reply.WhichOneof("kind") == "opened", reply
        assert reply.opened.cache_len == len(m.open.tokens)
        s.length = len(m.open.tokens)
        s.greedy = m.open.params.temperature == 0
        s.wire_top_k = m.open.wire_top_k
    elif kind == "rollback":
        c = m.rollback.cache_len
        assert (reply.rolled_back.cache_len, reply.rolled_back.removed) == (c, s.length - c)
        s.length = c
    else:
        p, gamma = m.propose, m.propose.gamma
        out = reply.proposal
        assert len(out.tokens) == gamma and tokens_ok(out.tokens), out
        assert out.cache_len == p.cache_len + len(p.append_tokens) + gamma - 1
        qs = decode_q(out.q, list(out.tokens))
        assert qs is not None, f"the draft sent a q its own tokens do not fit: {out.q}"
        for ids, _, tail, _ in qs:
            assert s.wire_top_k <= 0 or len(ids) <= s.wire_top_k
            assert not s.greedy or (len(ids) == 1 and tail == 0)
        s.length = out.cache_len


def target_message(data, s: SessionModel):
    """The next target message for a session in state ``s``, and the expected outcome."""
    m, e, clean = session_control(data, s, target_pb2.TargetRequest, draft=False, step="verify")
    if m is not None:
        return m, e
    if clean:
        c = data.draw(st.sampled_from([s.length] * 4 + [s.length - 1, s.length + 1]))
        pending = data.draw(st.lists(TOKEN, min_size=1, max_size=4))
        drafts = data.draw(st.lists(TOKEN, max_size=4))
    else:
        c = data.draw(cache_lens(max(s.length, 0)))
        pending = data.draw(token_lists(valid_size=(1, 4)))
        drafts = data.draw(token_lists())
    q = data.draw(packed_qs(drafts, clean))
    v = target_pb2.Verify(
        cache_len=c,
        pending_tokens=pending,
        draft_tokens=drafts,
        seed=data.draw(UINT64),
        return_dense_p=data.draw(st.booleans()),
    )
    if q is not None:
        v.draft_q.CopyFrom(q)
    m = target_pb2.TargetRequest(verify=v)
    if s.length >= 0:
        wrong = room_errors(c, c + len(pending) + len(drafts), "draft_tokens")
        if not tokens_ok(pending):
            wrong.append("pending_tokens")
        if not tokens_ok(drafts) or len(drafts) > MODEL_MAX_GAMMA:
            wrong.append("draft_tokens")
        elif decode_q(v.draft_q, drafts) is None:
            wrong.append("draft_q")
        e = invalid(*wrong) if wrong else Expect()
        if not wrong and not pending and c != s.kept_at:
            # No pending token needs the logits the last pass kept at exactly cache_len.
            e = Expect(PRECONDITION, ("pending_tokens",))
        elif not wrong and c > s.length:
            e = Expect(PRECONDITION, ("cache_len",))
    return m, e


def check_target_reply(m, reply, s: SessionModel) -> None:
    kind = m.WhichOneof("kind")
    if kind == "open":
        assert reply.WhichOneof("kind") == "opened", reply
        assert reply.opened.cache_len == len(m.open.tokens)
        s.length = len(m.open.tokens)
        s.greedy = m.open.params.temperature == 0
        # The prefill keeps p for the next position (none without a prefill).
        assert reply.opened.next_logits == bool(m.open.tokens), reply
        s.kept_at = s.length if m.open.tokens else -1
    elif kind == "rollback":
        c = m.rollback.cache_len
        assert (reply.rolled_back.cache_len, reply.rolled_back.removed) == (c, s.length - c)
        if c < s.length:
            s.kept_at = -1
        s.length = c
    else:
        v, out = m.verify, reply.verdict
        drafts = list(v.draft_tokens)
        gamma = len(drafts)
        assert out.cache_len == v.cache_len + len(v.pending_tokens) + gamma
        assert len(out.p_draft) == len(out.q_draft) == len(out.residual_tokens) == gamma
        assert all(0 <= p <= 1 for p in out.p_draft), out.p_draft
        assert not s.greedy or set(out.p_draft) <= {0.0, 1.0}
        qs = decode_q(v.draft_q, drafts)
        assert list(out.q_draft) == [q_of(q, x) for q, x in zip(qs, drafts, strict=True)]
        assert tokens_ok(out.residual_tokens) and tokens_ok([out.bonus_token])
        assert len(out.dense_p) == ((gamma + 1) * VOCAB if v.return_dense_p else 0)
        s.length = s.kept_at = out.cache_len


def drive(f: Fuzz, stub, data, next_message, check_reply, codes: Counter) -> None:
    """One session stream of up to six messages, each checked against the oracle."""
    s = SessionModel()
    stream = Stream(stub)
    try:
        for _ in range(data.draw(st.sampled_from([4, 6, 5, 3, 2, 1]), label="messages")):
            m, e = next_message(data, s)
            try:
                reply = stream.ask(m)
            except grpc.RpcError as err:
                codes[err.code().name] += 1
                assert err.code() == e.code, (e, err.code(), err.details())
                assert names_one_of(err.details(), e.fields), (e, err.details())
                break
            assert e.code == OK, (e, reply)
            check_reply(m, reply, s)
            codes["OK"] += 1
        else:
            stream.close()
    finally:
        stream.abandon()
    f.settled()


def reached(codes: Counter) -> None:
    """The generated streams got deep and met every outcome (else the fuzzing is weak)."""
    assert codes["OK"] > EXAMPLES and codes["INVALID_ARGUMENT"] > EXAMPLES // 10, codes
    assert codes["FAILED_PRECONDITION"] >= EXAMPLES // 60, codes
    assert codes["ALREADY_EXISTS"] >= EXAMPLES // 60, codes


def test_fuzz_draft_session(fuzz):
    codes: Counter = Counter()

    @FUZZ
    @given(data=st.data())
    def run(data):
        stub = draft_pb2_grpc.DraftServiceStub(fuzz.channels["draft"])
        drive(fuzz, stub, data, draft_message, check_draft_reply, codes)

    run()
    print(f"\ndraft Session: message outcomes {dict(codes)}")
    reached(codes)
    fuzz.still_serves()


def test_fuzz_target_session(fuzz):
    codes: Counter = Counter()

    @FUZZ
    @given(data=st.data())
    def run(data):
        stub = target_pb2_grpc.TargetServiceStub(fuzz.channels["target"])
        drive(fuzz, stub, data, target_message, check_target_reply, codes)

    run()
    print(f"\ntarget Session: message outcomes {dict(codes)}")
    reached(codes)
    fuzz.still_serves()


# ---- the services' own fields: relays, drafting on, pipelines, chains ---------------------
# Fields only the orchestrator and the draft send each other (a relay's address and
# token, the verify it carries, DraftOn, Pipeline, guesses, a Chain, plain runs). A
# peer of another version, or a bug, may send them wrong: the answer must still be a
# documented status, never INTERNAL or UNKNOWN, the services must stay up, and
# nothing the fields start (a relay, a head start, a pipeline) may outlive the stream.
# Relays go to this stack's own target or to a closed loopback port, nowhere else.
OWN_EXAMPLES = max(50, EXAMPLES // 3)
SMALL_UINT32 = st.one_of(st.integers(0, 12), UINT32)
UNIFORMS = st.lists(st.one_of(st.floats(0, 1, exclude_max=True), FLOAT32, st.floats()), max_size=7)


@st.composite
def chains(draw) -> target_pb2.Chain:
    return target_pb2.Chain(
        after_seed=draw(UINT64),
        uniforms=draw(UNIFORMS),
        match=draw(st.booleans()),
        first_token=draw(st.one_of(TOKEN, INT32)),
        after_rejection=draw(st.booleans()),
        rejected_at=draw(SMALL_UINT32),
        residual_token=draw(st.one_of(TOKEN, INT32)),
    )


@st.composite
def own_verify_fields(draw, v: target_pb2.Verify) -> None:
    """Set some of the fields the orchestrator and the draft add to a Verify."""
    if draw(st.booleans()):
        v.run_tokens = draw(SMALL_UINT32)
    if draw(st.booleans()):
        v.return_pit = True
    if draw(st.booleans()):
        v.cancel_relays[:] = draw(st.lists(UINT64, max_size=3))
    if draw(st.booleans()):
        v.guess_tokens[:] = draw(st.lists(st.one_of(TOKEN, INT32), max_size=6))
    if draw(st.booleans()):
        v.alternates[:] = draw(st.lists(st.one_of(TOKEN, INT32), max_size=6))
    if draw(st.booleans()):
        v.pipeline = draw(UINT64)
    if draw(st.booleans()):
        v.chain.CopyFrom(draw(chains()))


@st.composite
def own_proposes(draw, length: int, relay_to: list[str]) -> draft_pb2.DraftRequest:
    """A propose the session could take, with relay, DraftOn and Pipeline fields."""
    cache_len = draw(st.sampled_from([length] * 6 + [length - 1, length + 1, -1]))
    p = draft_pb2.Propose(
        cache_len=cache_len,
        append_tokens=draw(st.lists(TOKEN, min_size=1, max_size=3)),
        gamma=draw(st.one_of(st.integers(1, 4), INT32)),
        seed=draw(UINT64),
        guess_residuals=draw(st.booleans()),
    )
    if draw(st.booleans()):
        p.relay.target = draw(st.sampled_from(relay_to))
        p.relay.relay_token = draw(st.binary(max_size=24))
        v = p.relay.verify
        v.cache_len = draw(st.one_of(st.integers(0, MAX_CONTEXT), INT32))
        v.pending_tokens[:] = draw(st.lists(st.one_of(TOKEN, INT32), max_size=3))
        v.seed = draw(UINT64)
        draw(own_verify_fields(v))
        if draw(st.booleans()):
            on = p.relay.draft_on
            on.uniforms[:] = draw(UNIFORMS)
            on.gamma = draw(st.one_of(st.integers(1, 4), INT32))
            on.seed = draw(UINT64)
            on.ahead = draw(st.booleans())
    if draw(st.booleans()):
        p.pipeline.key = draw(UINT64)
        p.pipeline.tokens = draw(SMALL_UINT32)
        p.pipeline.depth = draw(SMALL_UINT32)
    return draft_pb2.DraftRequest(propose=p)


@st.composite
def own_verifies(draw, length: int, kept_at: int) -> target_pb2.TargetRequest:
    """A verify the session could take, with the fields of relays, pipelines and runs."""
    drafts = draw(st.lists(TOKEN, max_size=4))
    pending = draw(st.lists(TOKEN, min_size=0 if kept_at == length else 1, max_size=2))
    v = target_pb2.Verify(
        cache_len=draw(st.sampled_from([length] * 6 + [length + 1, -1])),
        pending_tokens=pending,
        draft_tokens=drafts,
        seed=draw(UINT64),
    )
    q = draw(packed_qs(drafts, True))
    if q is not None:
        v.draft_q.CopyFrom(q)
    draw(own_verify_fields(v))
    return target_pb2.TargetRequest(verify=v)


def drive_own(f: Fuzz, data, role: str, codes: Counter, relay_to: list[str]) -> None:
    """A session opened right, then up to four messages with the services' own fields;
    each gets its reply or ends the stream with a documented status."""
    if role == "draft":
        stub, request = draft_pb2_grpc.DraftServiceStub(f.channels["draft"]), draft_pb2.DraftRequest
    else:
        stub = target_pb2_grpc.TargetServiceStub(f.channels["target"])
        request = target_pb2.TargetRequest
    tokens = data.draw(st.lists(TOKEN, min_size=1, max_size=8), label="prompt")
    params = common_pb2.SamplingParams(temperature=data.draw(st.sampled_from([0.0, 1.0])))
    opening = common_pb2.OpenSession(session_id=f"own-{time.monotonic_ns()}", tokens=tokens)
    opening.params.CopyFrom(params)
    stream = Stream(stub)
    try:
        length, kept_at = stream.ask(request(open=opening)).opened.cache_len, -1
        for _ in range(data.draw(st.integers(1, 4), label="messages")):
            if role == "draft":
                m = data.draw(own_proposes(length, relay_to))
            else:
                m = data.draw(own_verifies(length, kept_at))
            try:
                reply = stream.ask(m)
            except grpc.RpcError as err:
                codes[err.code().name] += 1
                assert err.code() in DOCUMENTED, (err.code(), err.details(), m)
                break
            codes["OK"] += 1
            if role == "draft":
                length = reply.proposal.cache_len
            else:
                length = kept_at = reply.verdict.cache_len
        else:
            stream.outbox.put(None)
            for _ in stream.call:  # (a reply to a verify relayed onto it may still come)
                pass
    finally:
        stream.abandon()
    f.settled()


@pytest.mark.parametrize("role", ["draft", "target"])
def test_fuzz_the_services_own_fields(fuzz, role):
    codes: Counter = Counter()
    relay_to = [fuzz.stack.address("target"), f"127.0.0.1:{free_port()}", ""]

    @settings(FUZZ, max_examples=OWN_EXAMPLES)
    @given(data=st.data())
    def run(data):
        drive_own(fuzz, data, role, codes, relay_to)

    run()
    print(f"\n{role} Session, the services' own fields: message outcomes {dict(codes)}")
    assert codes["OK"] > OWN_EXAMPLES // 4 and codes["INVALID_ARGUMENT"] > 0, codes
    fuzz.still_serves()


# ---- Generate ----------------------------------------------------------------------------
TEXTS = st.one_of(
    st.text(alphabet="abcdefghij ABC.,!?", min_size=1, max_size=30),
    st.text(max_size=60),
    st.sampled_from(["", "a" * MAX_PROMPT, "a" * (MAX_PROMPT + 1), "<eos>", "\n\n", "a" * 100_000]),
)
CHAT = st.builds(
    orchestrator_pb2.ChatMessages,
    messages=st.lists(
        st.builds(
            orchestrator_pb2.ChatMessage,
            role=st.sampled_from(["user", "system", "", "x"]),
            content=st.text(max_size=20),
        ),
        max_size=3,
    ),
)
STOPS = st.one_of(
    st.lists(st.text(alphabet="abcde .", min_size=1, max_size=3), max_size=3),
    st.lists(st.text(max_size=300), max_size=10),
    st.sampled_from([[""], ["x" * MAX_STOP_CHARS], ["x" * (MAX_STOP_CHARS + 1)], ["x"] * 10_000]),
)


@st.composite
def generate_requests(draw) -> orchestrator_pb2.GenerateRequest:
    """Half of them with every field valid (small), half with any values."""
    if draw(st.booleans()):  # clean
        r = orchestrator_pb2.GenerateRequest(
            max_new_tokens=draw(st.integers(1, 6)),
            temperature=draw(st.sampled_from([0.0, 1.0, 0.7, 1e-5])),
            top_k=draw(st.sampled_from([0, 3])),
            top_p=draw(st.sampled_from([0.0, 0.9])),
            stop=draw(st.lists(st.text(alphabet="abcde .", min_size=1, max_size=3), max_size=3)),
            dense=draw(st.booleans()),
        )
        if draw(st.booleans()):
            r.text = draw(st.text(alphabet="abcdefghij ABC.,!?", min_size=1, max_size=30))
        else:
            r.token_ids.ids.extend(draw(st.lists(TOKEN, min_size=1, max_size=12)))
        if draw(st.booleans()):
            r.gamma = draw(st.integers(0, 5))
    else:
        r = orchestrator_pb2.GenerateRequest(
            max_new_tokens=draw(st.one_of(st.integers(1, 6), INT32)),
            temperature=draw(FLOAT32),
            top_k=draw(INT32),
            top_p=draw(FLOAT32),
            stop=draw(STOPS),
            dense=draw(st.booleans()),
        )
        prompt = draw(st.sampled_from(["text", "token_ids", "messages", None]))
        if prompt == "text":
            r.text = draw(TEXTS)
        elif prompt == "token_ids":
            r.token_ids.ids.extend(draw(token_lists(valid_size=(1, 12))))
        elif prompt == "messages":
            r.messages.CopyFrom(draw(CHAT))
        if draw(st.booleans()):
            r.gamma = draw(st.one_of(st.integers(0, 5), INT32, st.sampled_from([16, 17])))
    if draw(st.booleans()):
        r.seed = draw(UINT64)
    return r


def expect_generate(r: orchestrator_pb2.GenerateRequest, tokenizer) -> tuple[Expect, int]:
    """The outcome orchestrator.proto promises for ``r``, and its prompt's length."""
    kind = r.WhichOneof("prompt")
    if kind is None:
        return invalid("prompt"), 0
    if kind == "messages":  # the tiny tokenizer has no chat template
        return invalid("messages"), 0
    if kind == "text":
        prompt = tokenizer.encode(r.text) if r.text else []
        if not prompt:
            return invalid("text"), 0
    else:
        prompt = list(r.token_ids.ids)
        if not tokens_ok(prompt, min_len=1):
            return invalid("token_ids"), 0
    wrong = []
    if len(prompt) > MAX_PROMPT:
        wrong.append(kind)
    if not 1 <= r.max_new_tokens <= MAX_NEW:
        wrong.append("max_new_tokens")
    p = common_pb2.SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)
    if 0 < p.temperature < MIN_TEMPERATURE:
        p.temperature = 0.0  # vanishing temperatures are greedy
    wrong += params_errors(p, prefix="")
    # gamma unset without a seed: chosen per step, up to max_gamma (room is kept for it)
    adaptive = not r.HasField("gamma") and not r.HasField("seed")
    gamma = r.gamma if r.HasField("gamma") else (MAX_GAMMA_REQUEST if adaptive else 4)
    if not 0 <= gamma <= MAX_GAMMA_REQUEST:
        wrong.append("gamma")
    if len(r.stop) > MAX_STOPS or not all(0 < len(s) <= MAX_STOP_CHARS for s in r.stop):
        wrong.append("stop")
    if len(prompt) + r.max_new_tokens + gamma + 1 > MAX_CONTEXT:
        wrong.append("max_new_tokens")
    return (invalid(*wrong) if wrong else Expect()), len(prompt)


def test_fuzz_generate(fuzz):
    codes: Counter = Counter()
    stub = orchestrator_pb2_grpc.OrchestratorStub(fuzz.channels["orchestrator"])

    @FUZZ
    @given(r=generate_requests())
    def run(r):
        e, prompt_len = expect_generate(r, fuzz.tokenizer)
        ids, stats = [], None
        try:
            for msg in stub.Generate(r, timeout=TIMEOUT):
                assert stats is None, "a message after the statistics"
                if msg.HasField("chunk"):
                    ids += msg.chunk.token_ids
                else:
                    stats = msg.stats
        except grpc.RpcError as err:
            codes[err.code().name] += 1
            assert err.code() == e.code, (e, err.code(), err.details())
            assert names_one_of(err.details(), e.fields), (e, err.details())
        else:
            codes["OK"] += 1
            assert e.code == OK, (e, stats)
            assert stats is not None and stats.generated_tokens == len(ids), stats
            assert stats.prompt_tokens == prompt_len and tokens_ok(ids)
            assert stats.finish_reason in ("length", "stop"), stats  # the tiny pair has no EOS
            assert len(ids) == r.max_new_tokens or stats.finish_reason == "stop"
            if not r.HasField("gamma") and not r.HasField("seed"):
                assert stats.adaptive and 0 <= stats.gamma <= MAX_GAMMA_REQUEST, stats
            else:
                assert not stats.adaptive and stats.gamma == (r.gamma if r.HasField("gamma") else 4)
        fuzz.settled()

    run()
    print(f"\nGenerate: outcomes {dict(codes)}")
    assert codes["OK"] > EXAMPLES // 10 and codes["INVALID_ARGUMENT"] > EXAMPLES // 3
    assert fuzz.stack.metric("orchestrator", "specdec_live_requests") == 0
    fuzz.still_serves()


# ---- Info --------------------------------------------------------------------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def unknown_fields(draw) -> bytes:
    """A well-formed encoding of fields the empty request message does not know."""
    out = b""
    for _ in range(draw(st.integers(0, 5))):
        number = draw(st.one_of(st.integers(1, 20), st.integers(1, 2**29 - 1)))
        wire = draw(st.sampled_from([0, 1, 2, 5]))
        out += varint(number << 3 | wire)
        if wire == 0:
            out += varint(draw(st.integers(0, 2**64 - 1)))
        elif wire == 1:
            out += draw(st.binary(min_size=8, max_size=8))
        elif wire == 5:
            out += draw(st.binary(min_size=4, max_size=4))
        else:
            payload = draw(st.one_of(st.binary(max_size=40), st.just(b"z" * 100_000)))
            out += varint(len(payload)) + payload
    return out


INFO_METHODS = {
    "draft": "/specdec.v1.DraftService/Info",
    "target": "/specdec.v1.TargetService/Info",
    "orchestrator": "/specdec.v1.Orchestrator/Info",
}


@pytest.mark.parametrize("role", list(INFO_METHODS))
def test_fuzz_info(fuzz, role):
    """Info ignores fields it does not know (forward compatibility) and always answers
    the same; random metadata changes nothing."""
    method = INFO_METHODS[role]
    call = fuzz.channels[role].unary_unary(method)
    reference = call(b"", timeout=TIMEOUT)
    # Custom keys only ("x-..."); a "-bin" key would need bytes.
    metadata_keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-_.0123456789").map(
        lambda k: "x-" + k.removesuffix("-bin")
    )

    @FUZZ
    @given(
        body=unknown_fields(),
        metadata=st.lists(
            st.tuples(
                metadata_keys,
                st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126)),
            ),
            max_size=3,
        ),
    )
    def run(body, metadata):
        assert call(body, metadata=metadata, timeout=TIMEOUT) == reference

    run()
    fuzz.settled()
    fuzz.still_serves()


# ---- garbage bytes to every method --------------------------------------------------------
METHODS = {
    "/specdec.v1.Orchestrator/Generate": ("orchestrator", "unary_stream"),
    "/specdec.v1.Orchestrator/Info": ("orchestrator", "unary_unary"),
    "/specdec.v1.DraftService/Session": ("draft", "stream_stream"),
    "/specdec.v1.DraftService/Info": ("draft", "unary_unary"),
    "/specdec.v1.TargetService/Session": ("target", "stream_stream"),
    "/specdec.v1.TargetService/Info": ("target", "unary_unary"),
    "/specdec.v1.TargetService/Relay": ("target", "stream_stream"),
}
REQUEST_TYPES = {
    "Generate": orchestrator_pb2.GenerateRequest,
    "Orchestrator/Info": orchestrator_pb2.OrchestratorInfoRequest,
    "DraftService/Session": draft_pb2.DraftRequest,
    "TargetService/Session": target_pb2.TargetRequest,
    "TargetService/Relay": target_pb2.RelayedVerify,
    "Info": common_pb2.InfoRequest,
}


def request_type(method: str):
    return next(t for k, t in REQUEST_TYPES.items() if method.endswith(k))


def parses(message_type, data: bytes) -> bool:
    try:
        message_type.FromString(data)
    except DecodeError:
        return False
    return True


@pytest.mark.parametrize("method", list(METHODS))
def test_garbage_bytes_get_a_status_and_the_service_survives(fuzz, method):
    role, shape = METHODS[method]
    channel = fuzz.channels[role]
    call = getattr(channel, shape)(method)  # no serializers: raw bytes in and out
    message_type = request_type(method)
    seen: Counter = Counter()

    @settings(FUZZ, max_examples=max(50, EXAMPLES // 6))
    @given(
        messages=st.lists(
            st.one_of(st.binary(max_size=64), st.binary(min_size=1000, max_size=4000)),
            min_size=1,
            max_size=1 if shape != "stream_stream" else 3,
        )
    )
    def run(messages):
        try:
            if shape == "unary_unary":
                call(messages[0], timeout=TIMEOUT)
            elif shape == "unary_stream":
                list(call(messages[0], timeout=TIMEOUT))
            else:
                list(call(iter(messages), timeout=TIMEOUT))
            code = OK
        except grpc.RpcError as err:
            code = err.code()
            assert code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), (
                err.details()
            )
        good = all(parses(message_type, m) for m in messages)
        seen[("parses" if good else "unparseable", code.name)] += 1
        if good and shape == "unary_unary":
            assert code == OK  # unknown fields are ignored
        elif good:  # a message of no use (no prompt, not an open) at best: a field error
            assert code in DOCUMENTED, code
        else:  # the status says so (or an earlier message's error ended the call)
            assert code in (UNPARSEABLE | DOCUMENTED) - {OK}, code
        fuzz.settled()

    run()
    print(f"\n{method}: {dict(seen)}")
    assert any(k[0] == "unparseable" for k in seen), "no unparseable input was generated"
    fuzz.still_serves()


@pytest.mark.parametrize("role", ["draft", "target", "orchestrator"])
def test_a_message_over_the_size_limit_is_refused(fuzz, role):
    """A message over max_message_bytes (16 MiB) is RESOURCE_EXHAUSTED; nothing else breaks."""
    huge = [2**31 - 1] * 4_000_000  # 5 bytes each: 20 MB
    with pytest.raises(grpc.RpcError) as err:
        if role == "orchestrator":
            stub = orchestrator_pb2_grpc.OrchestratorStub(fuzz.channels[role])
            r = orchestrator_pb2.GenerateRequest(max_new_tokens=1)
            r.token_ids.ids.extend(huge)
            list(stub.Generate(r, timeout=TIMEOUT))
        else:
            stub = (draft_pb2_grpc.DraftServiceStub if role == "draft" else
                    target_pb2_grpc.TargetServiceStub)(fuzz.channels[role])  # fmt: skip
            request = draft_pb2.DraftRequest if role == "draft" else target_pb2.TargetRequest
            m = request(open=common_pb2.OpenSession(session_id="big", tokens=huge))
            Stream(stub).ask(m)
    assert err.value.code() == EXHAUSTED, err.value
    fuzz.settled()
    fuzz.still_serves()


def test_no_session_outgrows_the_models_positions(gpt2_stack):
    """Found while fuzzing: GPT-2 embeds 1024 positions (``n_positions``) but the services
    took sessions up to max_context (2048). A longer one crashed the forward (INTERNAL),
    and through the orchestrator one such prompt opened the target's breaker: every
    request failed with UNAVAILABLE for the back-off. Now it is INVALID_ARGUMENT."""
    stack = gpt2_stack
    limit = 1024
    with grpc.insecure_channel(stack.address("target")) as ch:
        info = target_pb2_grpc.TargetServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=10)
        assert info.max_context == limit
        stream = Stream(target_pb2_grpc.TargetServiceStub(ch))
        opened = stream.ask(
            target_pb2.TargetRequest(
                open=common_pb2.OpenSession(session_id="long", tokens=[5] * 1020)
            )
        )
        assert opened.opened.cache_len == 1020
        with pytest.raises(grpc.RpcError) as err:
            stream.ask(
                target_pb2.TargetRequest(
                    verify=target_pb2.Verify(cache_len=1020, pending_tokens=[5] * (limit - 1019))
                )
            )
        stream.abandon()
    assert err.value.code() == INVALID and err.value.details().startswith("draft_tokens:")
    with grpc.insecure_channel(stack.orchestrator_address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        r = orchestrator_pb2.GenerateRequest(max_new_tokens=4)
        r.token_ids.ids.extend([5] * (limit + 1))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(r, timeout=TIMEOUT))
    assert err.value.code() == INVALID, err.value.details()
    # The prompt alone leaves no room: its field is named, not max_new_tokens.
    assert err.value.details().startswith("token_ids: "), err.value.details()
    assert "maximum context length is 1024 tokens" in err.value.details()
    ids, _, stats = stack.generate_raw(prompt="fine", max_new_tokens=4, temperature=0.0)
    assert stats.generated_tokens == len(ids) == 4
