"""The one codec between domain values and protobuf, with the one validator of each.

Sampling parameters, token lists and proposal distributions cross the wire
here and nowhere else: services, the orchestrator, tests and benchmarks all
encode and decode through these functions, and every check of a field lives
next to its decoder (errors name the field and the allowed range).
Not for: the math (``specdec.sampling``) or transport details.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from specdec import kernels
from specdec.errors import InvalidArgument, require
from specdec.hidden_q import HiddenQ, QuantHead, derive_q
from specdec.runtime.loading import ModelInfo
from specdec.sampling import Proposal, SamplingParams, SparseQ
from specdec.v1 import common_pb2

# Version of the draft/target session protocol (ModelInfo.protocol_version).
PROTOCOL_VERSION = 2
# Temperatures below this are refused by the services; the orchestrator treats
# them as greedy (logits / 1e-37 overflow to inf). It is 1e-4 as the wire's float32
# carries it, so that a client's 1e-4 is allowed.
MIN_TEMPERATURE = float(np.float32(1e-4))
DEFAULT_Q_BITS = 16
MAX_Q_BITS = 30
_ESCAPE = 255


# ---- sampling parameters -------------------------------------------------------------------
def check_params(temperature: float, top_k: int, top_p: float, prefix: str = "") -> SamplingParams:
    """Validated sampling parameters. A top_p of 0 means unset (1)."""
    t, k, p = float(temperature), int(top_k), float(top_p) or 1.0
    require(
        math.isfinite(t) and (t == 0.0 or t >= MIN_TEMPERATURE),
        f"{prefix}temperature",
        f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {temperature}",
    )
    require(k >= 0, f"{prefix}top_k", f"must be >= 0 (0 disables), got {top_k}")
    require(math.isfinite(p) and 0 < p <= 1, f"{prefix}top_p", f"must be in (0, 1], got {top_p}")
    return SamplingParams(temperature=t, top_k=k, top_p=p)


def params_from_pb(pb: common_pb2.SamplingParams, field: str = "params") -> SamplingParams:
    return check_params(pb.temperature, pb.top_k, pb.top_p, prefix=f"{field}.")


def params_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)


# ---- token lists -------------------------------------------------------------------------
def check_tokens(field: str, values: Sequence[int], vocab: int, min_len: int = 0) -> list[int]:
    """Token ids in [0, vocab), at least ``min_len`` of them."""
    tokens = list(values)
    require(len(tokens) >= min_len, field, f"must hold at least {min_len} token(s)")
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    require(bad is None, field, f"token id {bad} outside the vocabulary [0, {vocab})")
    return tokens


# ---- proposal distributions --------------------------------------------------------------
@dataclass(frozen=True)
class WireShape:
    """How a session's q is cut and quantized (set by the orchestrator at open)."""

    max_entries: int = 1024  # most tokens listed (0: no limit)
    eps: float = 0.0  # mass that may go to the tail instead of the list
    bits: int = DEFAULT_Q_BITS  # counts are out of 2^bits
    hidden: bool = False  # sampled q sent as hidden states (specdec.hidden_q) instead

    def check(self) -> WireShape:
        require(self.max_entries >= 0, "wire_top_k", f"must be >= 0, got {self.max_entries}")
        require(0.0 <= self.eps < 0.5, "wire_eps", f"must be in [0, 0.5), got {self.eps}")
        require(
            1 <= self.bits <= MAX_Q_BITS,
            "wire_bits",
            f"must be in [1, {MAX_Q_BITS}], got {self.bits}",
        )
        return self


def _bytes_with_escapes(values: np.ndarray) -> tuple[bytes, list[int]]:
    small = np.minimum(values, _ESCAPE).astype(np.uint8)
    return small.tobytes(), values[values >= _ESCAPE].tolist()


def _from_bytes(field: str, data: bytes, escapes: Sequence[int]) -> np.ndarray:
    values = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    hits = values == _ESCAPE
    require(
        int(hits.sum()) == len(escapes),
        field,
        f"{int(hits.sum())} escaped values but {len(escapes)} escapes",
    )
    if len(escapes):
        values[hits] = np.asarray(escapes, dtype=np.int64)
    return values


def pack_q(qs: Sequence[SparseQ]) -> common_pb2.PackedQ:
    """q_1..q_gamma on the wire (see PackedQ in common.proto): as hidden-state codes
    when every q was derived from one (``HiddenQ``), else as lists."""
    if not qs:
        return common_pb2.PackedQ(bits=DEFAULT_Q_BITS)
    if all(isinstance(q, HiddenQ) for q in qs):
        return common_pb2.PackedQ(
            hidden_codes=b"".join(q.code.tobytes() for q in qs),
            hidden_scales=[q.code_scale for q in qs],
            bits=qs[0].bits,
        )
    bits = qs[0].bits
    if any(q.bits != bits for q in qs):
        raise ValueError("every q of one draft is quantized to the same bits")
    if all(q.is_point for q in qs):
        return _pack_points(qs, bits)
    if kernels.ENABLED:
        pb = _pack_compiled(qs, bits)
        if pb is not None:
            return pb
    return _pack_lists(qs, bits)


def _pack_compiled(qs: Sequence[SparseQ], bits: int) -> common_pb2.PackedQ | None:
    """``_pack_lists``' message from one compiled pass (``kernels.encode_q``), or None
    where some position's ids do not ascend (``_pack_lists`` sorts them). Its twenty
    numpy calls cost tens of microseconds each right after a forward pass."""
    sizes = [len(q.ids) for q in qs]
    ids = np.concatenate([q.ids for q in qs])  # [total]
    counts = np.concatenate([q.counts for q in qs])
    total = len(ids)
    values = np.empty(2 * total, dtype=np.uint8)  # the ids' bytes, then the counts'
    escapes = np.empty(2 * total, dtype=np.int64)
    n_ids, n_counts = kernels.encode_q(
        ids,
        counts,
        np.array(sizes, dtype=np.int64),
        values[:total],
        escapes[:total],
        values[total:],
        escapes[total:],
    )
    if n_ids < 0:
        return None
    return common_pb2.PackedQ(
        sizes=sizes,
        id_deltas=values[:total].tobytes(),
        id_escapes=escapes[:n_ids].tolist(),
        counts=values[total:].tobytes(),
        count_escapes=escapes[total : total + n_counts].tolist(),
        tails=[q.tail for q in qs],
        bits=bits,
    )


def _pack_lists(qs: Sequence[SparseQ], bits: int) -> common_pb2.PackedQ:
    sizes = [len(q.ids) for q in qs]
    ids = np.concatenate([q.ids for q in qs])  # [total]
    counts = np.concatenate([q.counts for q in qs])
    starts = np.cumsum(sizes) - sizes  # each position's ids count from 0 again
    deltas = np.diff(ids, prepend=0)
    deltas[starts] = ids[starts]
    unordered = deltas <= 0
    unordered[starts] = False
    if unordered.any():  # some position's ids are not ascending
        # (The draft lists ascending ids, ``sampling.sparse_q``; other callers may not.)
        # By position, then by id. The keys are distinct, so any sort gives this order;
        # numpy's stable sort takes less than half the time of its default on them.
        row = np.repeat(np.arange(len(qs)), sizes)  # [total] the position of each entry
        order = np.argsort(row * qs[0].vocab + ids, kind="stable")
        ids, counts = ids[order], counts[order]
        deltas = np.diff(ids, prepend=0)
        deltas[starts] = ids[starts]
    id_bytes, id_esc = _bytes_with_escapes(deltas)
    c_bytes, c_esc = _bytes_with_escapes(counts)
    return common_pb2.PackedQ(
        sizes=sizes,
        id_deltas=id_bytes,
        id_escapes=id_esc,
        counts=c_bytes,
        count_escapes=c_esc,
        tails=[q.tail for q in qs],
        bits=bits,
    )


def _pack_points(qs: Sequence[SparseQ], bits: int) -> common_pb2.PackedQ:
    """``pack_q`` of points (greedy drafts: one token each, no tail), byte for byte
    the general path's message, in plain Python. Right after a forward pass every
    numpy call here costs tens of microseconds (the pass has evicted the caches
    its code and data live in), and the general path makes some twenty of them."""
    ids = [int(q.ids[0]) for q in qs]  # each position's ids count from 0: delta = id
    counts = [int(q.counts[0]) for q in qs]
    return common_pb2.PackedQ(
        sizes=[1] * len(qs),
        id_deltas=bytes(min(i, _ESCAPE) for i in ids),
        id_escapes=[i for i in ids if i >= _ESCAPE],
        counts=bytes(min(c, _ESCAPE) for c in counts),
        count_escapes=[c for c in counts if c >= _ESCAPE],
        tails=[0] * len(qs),
        bits=bits,
    )


def _unpack_points(
    pb: common_pb2.PackedQ, vocab: int, drafts: Sequence[int], bits: int
) -> list[SparseQ] | None:
    """``unpack_q`` of a draft whose every q is a point at its drafted token (what a
    greedy draft sends), in plain Python (see ``_pack_points``); None for anything
    else, which the general path decodes, or refuses naming what is wrong."""
    gamma = len(drafts)
    if (
        len(pb.sizes) != gamma
        or len(pb.id_deltas) != gamma
        or len(pb.counts) != gamma
        or any(n != 1 for n in pb.sizes)
        or any(pb.tails)
    ):
        return None
    scale = 1 << bits
    id_escapes, count_escapes = iter(pb.id_escapes), iter(pb.count_escapes)
    out = []
    for x, d, c in zip(drafts, pb.id_deltas, pb.counts, strict=True):
        token = d if d < _ESCAPE else next(id_escapes, -1)
        count = c if c < _ESCAPE else next(count_escapes, -1)
        if token != x or count != scale or not 0 <= x < vocab:
            return None
        out.append(SparseQ(np.array([x], dtype=np.int64), np.array([scale]), 0, vocab, bits))
    if next(id_escapes, None) is not None or next(count_escapes, None) is not None:
        return None
    return out


def unpack_q(
    pb: common_pb2.PackedQ,
    vocab: int,
    drafts: Sequence[int],
    field: str = "draft_q",
    head: QuantHead | None = None,
    params: SamplingParams | None = None,
) -> list[SparseQ]:
    """The proposals of a draft, validated against the drafted tokens.

    Each must be a distribution over [0, vocab) with distinct ids and positive
    counts summing with its tail to 2^bits, and must give its drafted token a
    positive probability (it was drawn from it). Hidden-state codes are derived
    into q with ``head`` under the session's ``params`` (``specdec.hidden_q``).
    """
    if pb.hidden_codes or pb.hidden_scales:
        return _unpack_hidden(pb, vocab, drafts, field, head, params)
    gamma = len(drafts)
    require(
        len(pb.sizes) == gamma and len(pb.tails) == gamma,
        field,
        f"needs one distribution per drafted token ({gamma}), got {len(pb.sizes)} sizes "
        f"and {len(pb.tails)} tails",
    )
    if gamma == 0:
        return []
    bits = pb.bits or DEFAULT_Q_BITS
    require(1 <= bits <= MAX_Q_BITS, f"{field}.bits", f"must be in [1, {MAX_Q_BITS}], got {bits}")
    points = _unpack_points(pb, vocab, drafts, bits)
    if points is not None:
        return points
    if kernels.ENABLED:
        qs = _unpack_compiled(pb, vocab, drafts, bits)
        if qs is not None:
            return qs
    return _unpack_lists(pb, vocab, drafts, field, bits)


def _unpack_compiled(
    pb: common_pb2.PackedQ, vocab: int, drafts: Sequence[int], bits: int
) -> list[SparseQ] | None:
    """``_unpack_lists``' SparseQs from one compiled pass (``kernels.decode_q``), or None
    where a check fails, for ``_unpack_lists`` to name it. Its forty numpy calls cost
    tens of microseconds each right after a forward pass."""
    sizes, tails = list(pb.sizes), list(pb.tails)
    total = sum(sizes)
    if len(pb.id_deltas) != total or len(pb.counts) != total:
        return None  # (before anything of that size is made)
    meta = np.array([*sizes, *tails, *drafts], dtype=np.int64)  # [3 gamma]
    ids = np.empty(total, dtype=np.int64)
    counts = np.empty(total, dtype=np.int64)
    ok = kernels.decode_q(
        np.frombuffer(pb.id_deltas, dtype=np.uint8),
        np.array(pb.id_escapes, dtype=np.int64),
        np.frombuffer(pb.counts, dtype=np.uint8),
        np.array(pb.count_escapes, dtype=np.int64),
        meta,
        vocab,
        1 << bits,
        ids,
        counts,
    )
    if not ok:
        return None
    out, start = [], 0
    for size, tail in zip(sizes, tails, strict=True):
        out.append(
            SparseQ(ids[start : start + size], counts[start : start + size], tail, vocab, bits)
        )
        start += size
    return out


def _unpack_lists(
    pb: common_pb2.PackedQ, vocab: int, drafts: Sequence[int], field: str, bits: int
) -> list[SparseQ]:
    gamma = len(drafts)
    sizes = np.asarray(pb.sizes, dtype=np.int64)  # [gamma]
    tails = np.asarray(pb.tails, dtype=np.int64)
    total = int(sizes.sum())
    deltas = _from_bytes(f"{field}.id_deltas", pb.id_deltas, pb.id_escapes)
    counts = _from_bytes(f"{field}.counts", pb.counts, pb.count_escapes)
    require(
        len(deltas) == total and len(counts) == total,
        field,
        f"sizes add up to {total} entries but there are {len(deltas)} ids and {len(counts)} counts",
    )
    # Checked for every position at once; a failure names the first bad one.
    ends = np.cumsum(sizes)
    starts = ends - sizes
    first_bad = {}
    empty = sizes == 0
    if empty.any():
        first_bad[int(np.argmax(empty))] = "lists no token"
    if not total:  # (every position is empty: nothing below has an entry to index)
        raise InvalidArgument(f"{field}[0]", first_bad[0])
    row = np.repeat(np.arange(gamma), sizes)  # [total]
    later = np.ones(total, dtype=bool)
    later[starts[~empty]] = False  # the first entry of a position may have delta 0
    dup = later & (deltas <= 0)
    if dup.any():
        first_bad.setdefault(int(row[np.argmax(dup)]), "duplicate token id (ids must be distinct)")
    csum = np.cumsum(deltas)  # [total]; each position's ids restart from 0
    base = np.zeros(gamma, dtype=np.int64)
    base[1:] = np.where(ends[:-1] > 0, csum[np.maximum(ends[:-1], 1) - 1], 0)
    ids = csum - np.repeat(base, sizes)
    outside = ids >= vocab
    if outside.any():
        i = int(np.argmax(outside))
        first_bad.setdefault(
            int(row[i]), f"token id {int(ids[i])} outside the vocabulary [0, {vocab})"
        )
    if (counts <= 0).any():
        first_bad.setdefault(int(row[np.argmax(counts <= 0)]), "counts must be positive")
    running = np.zeros(total + 1, dtype=np.int64)  # (reduceat fails on an empty last position)
    np.cumsum(counts, out=running[1:])
    sums = running[ends] - running[starts]  # [gamma]
    scale = 1 << bits
    off = np.flatnonzero(sums + tails != scale)
    if off.size:
        i = int(off[0])
        first_bad.setdefault(
            i, f"counts ({int(sums[i])}) plus tail ({int(tails[i])}) must add up to 2^{bits}"
        )
    full = np.flatnonzero((tails > 0) & (sizes >= vocab))
    if full.size:
        first_bad.setdefault(int(full[0]), "a tail needs tokens outside the list")
    if first_bad:
        i = min(first_bad)
        raise InvalidArgument(f"{field}[{i}]", first_bad[i])
    # Each drafted token must be listed (counts are positive), or fall in a tail with
    # mass (a tail has unlisted tokens to go to, checked above): q_i(x_i) > 0.
    listed = np.zeros(gamma, dtype=bool)
    listed[row[ids == np.asarray(drafts, dtype=np.int64)[row]]] = True
    never = np.flatnonzero(~listed & (tails == 0))
    if never.size:
        i = int(never[0])
        raise InvalidArgument(
            f"{field}[{i}]", f"drafted token {drafts[i]} has q = 0; it cannot have been drawn"
        )
    return [
        SparseQ(ids[s:e], counts[s:e], int(t), vocab, bits)
        for s, e, t in zip(starts.tolist(), ends.tolist(), tails.tolist(), strict=True)
    ]


def _unpack_hidden(pb, vocab, drafts, field, head, params) -> list[SparseQ]:
    gamma = len(drafts)
    require(
        head is not None and params is not None and not params.greedy,
        f"{field}.hidden_codes",
        "this target holds no draft output layer (target config draft_head), or the "
        "session is greedy: send q as lists",
    )
    require(
        head.vocab == vocab,
        f"{field}.hidden_codes",
        f"the draft head's vocabulary ({head.vocab}) is not the target's ({vocab})",
    )
    require(
        len(pb.hidden_scales) == gamma,
        f"{field}.hidden_scales",
        f"needs one scale per drafted token ({gamma}), got {len(pb.hidden_scales)}",
    )
    require(
        len(pb.hidden_codes) == gamma * head.dim,
        f"{field}.hidden_codes",
        f"needs {head.dim} bytes per drafted token ({gamma * head.dim}), "
        f"got {len(pb.hidden_codes)}",
    )
    scales = np.asarray(pb.hidden_scales, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(scales) | (scales <= 0))
    if bad.size:
        raise InvalidArgument(f"{field}.hidden_scales[{int(bad[0])}]", "must be finite and > 0")
    codes = np.frombuffer(pb.hidden_codes, dtype=np.int8).reshape(gamma, head.dim)
    if gamma == 0:
        return []
    require((codes != -128).all(), f"{field}.hidden_codes", "codes must be in [-127, 127]")
    qs = derive_q(head, codes, scales.astype(np.float64), params)
    for i, (q, x) in enumerate(zip(qs, drafts, strict=True)):
        if q.prob(int(x)) <= 0:
            raise InvalidArgument(
                f"{field}[{i}]", f"drafted token {x} has q = 0; it cannot have been drawn"
            )
    return qs


def drop_first_q(pb: common_pb2.PackedQ) -> common_pb2.PackedQ:
    """The same q_2..q_gamma without q_1, still in wire form (no re-encoding).

    Each position's ids restart from 0 and its escapes follow in order of
    appearance, so the first position is its first ``sizes[0]`` bytes of each
    byte string and as many escapes as those bytes hold 255s. A packing with no
    position is passed on as it is: the target refuses it, naming the field."""
    if pb.hidden_scales:
        dim = len(pb.hidden_codes) // len(pb.hidden_scales)
        return common_pb2.PackedQ(
            hidden_codes=pb.hidden_codes[dim:], hidden_scales=pb.hidden_scales[1:], bits=pb.bits
        )
    if not pb.sizes:
        return pb
    n = pb.sizes[0]
    ids, counts = pb.id_deltas[:n], pb.counts[:n]
    return common_pb2.PackedQ(
        sizes=pb.sizes[1:],
        id_deltas=pb.id_deltas[n:],
        id_escapes=pb.id_escapes[ids.count(_ESCAPE) :],
        counts=pb.counts[n:],
        count_escapes=pb.count_escapes[counts.count(_ESCAPE) :],
        tails=pb.tails[1:],
        bits=pb.bits,
    )


def drop_first(proposal: Proposal) -> Proposal:
    """x_2..x_gamma of a proposal, with their q (a block drafted one token ahead whose
    first token turned out to be the bonus: ``orchestrator.step.settle``)."""
    return replace(
        proposal,
        tokens=proposal.tokens[1:],
        qs=proposal.qs[1:] if proposal.qs is not None else None,
        packed=drop_first_q(proposal.packed) if proposal.packed is not None else None,
    )


# ---- model info --------------------------------------------------------------------------
def info_to_pb(info: ModelInfo) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=info.model_id,
        vocab_size=info.vocab_size,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        dtype=info.dtype,
        device=info.device,
        architecture=info.architecture,
        eos_token_id=info.eos_token_ids[0] if info.eos_token_ids else -1,
        eos_token_ids=info.eos_token_ids,
        max_context=info.max_context,
        model_fingerprint=info.model_fingerprint,
        server_version=info.server_version,
        protocol_version=info.protocol_version,
        head_fingerprint=info.head_fingerprint,
    )


def info_from_pb(pb: common_pb2.ModelInfo) -> ModelInfo:
    eos = tuple(pb.eos_token_ids) or ((pb.eos_token_id,) if pb.eos_token_id >= 0 else ())
    return ModelInfo(
        model_id=pb.model_id,
        vocab_size=pb.vocab_size,
        tokenizer_fingerprint=pb.tokenizer_fingerprint,
        dtype=pb.dtype,
        device=pb.device,
        architecture=pb.architecture,
        eos_token_ids=eos,
        max_context=pb.max_context,
        model_fingerprint=pb.model_fingerprint,
        server_version=pb.server_version,
        protocol_version=pb.protocol_version,
        head_fingerprint=pb.head_fingerprint,
    )
