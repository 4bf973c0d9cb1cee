"""The compiled kernels (specdec.kernels) do what their references in numpy and torch
do: the judge draws the same tokens for the same uniforms, decoding gives the same
SparseQs, and both refuse what the references refuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specdec import kernels
from specdec.errors import InvalidArgument, NonFiniteLogits
from specdec.rng import generator, uniforms
from specdec.sampling import (
    SamplingParams,
    SparseQ,
    draft_position,
    inverse_cdf,
    probs_from_logits,
    residual_distribution,
    sparse_q,
    verify_draft,
)
from specdec.wire import pack_q, unpack_q

from .test_fuzz import VOCAB, packed_qs

PARAMS = [
    SamplingParams(1.0),
    SamplingParams(0.7),
    SamplingParams(1.3, top_k=20),
    SamplingParams(1.0, top_p=0.8),
]


def _reference(*args):
    """verify_draft on the reference path (numpy and torch)."""
    kernels.ENABLED = False
    try:
        return verify_draft(*args)
    finally:
        kernels.ENABLED = True


def _case(seed: int, vocab: int, gamma: int, params: SamplingParams, entries: int, eps: float):
    """Target logits [gamma + 1, vocab] and a draft's x_i ~ q_i from nearby logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(gamma + 1, vocab, generator=g) * 3
    rng = np.random.default_rng(seed)
    drafts, qs = [], []
    for i in range(gamma):
        q = sparse_q(logits[i] + torch.randn(vocab, generator=g), params, entries, eps)
        drafts.append(q.sample(rng))
        qs.append(q)
    return logits, drafts, qs


def _close_call(logits, drafts, qs, params, u, i: int, a: int, b: int) -> bool:
    """Whether draws a and b at row i differ only by rounding: the exact float64 CDF
    of the row crosses u_i times its mass within 1e-9 of it between a and b."""
    p = probs_from_logits(logits.double(), params)
    if i < len(drafts):
        row = residual_distribution(p[i : i + 1], qs[i].dense()[None])[0]
    else:
        row = p[i]
    cdf = row.cumsum(0)
    return abs(float(cdf[min(a, b)]) - float(u[i]) * float(cdf[-1])) < 1e-9


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.sampled_from([2, 7, 64, 1000, 4096]),
    gamma=st.integers(0, 6),
    params=st.sampled_from(PARAMS),
    entries=st.sampled_from([0, 1, 8, 256]),
    eps=st.sampled_from([0.0, 0.01]),
    float64=st.booleans(),
)
def test_the_compiled_judge_draws_what_the_reference_draws(
    seed, vocab, gamma, params, entries, eps, float64
):
    logits, drafts, qs = _case(seed, vocab, gamma, params, entries, eps)
    if float64:
        logits = logits.double()
    u = uniforms(seed, gamma + 1)
    ours = verify_draft(logits, drafts, qs, params, u)
    ref = _reference(logits, drafts, qs, params, u)
    assert ours.p_draft == ref.p_draft and ours.q_draft == ref.q_draft
    for i, (a, b) in enumerate(
        zip(
            ref.residual_tokens + [ref.bonus_token],
            ours.residual_tokens + [ours.bonus_token],
            strict=True,
        )
    ):
        assert a == b or _close_call(logits, drafts, qs, params, u, i, a, b), (i, a, b)


def test_a_row_without_residual_mass_draws_from_p():
    """p == q at a position: x is never rejected there, and the kernel's residual
    draw comes from p, as ``residual_distribution``'s does."""
    vocab, scale = 16, 2**16
    q = SparseQ(np.array([1, 4, 9]), np.array([40000, 20000, 5000]), 536, vocab)
    p = torch.stack([q.dense(), torch.full((vocab,), 1 / vocab, dtype=torch.float64)])
    meta = np.array([4, 3, 536], dtype=np.int64)
    for s in range(50):
        u = uniforms(s, 2)
        out = np.empty(4)
        assert kernels.judge(p.numpy(), meta, q.ids, q.counts, scale, u.numpy(), out) == kernels.OK
        rows = torch.cat([residual_distribution(p[:1], q.dense()[None]), p[1:]])
        assert torch.equal(rows[0], p[0])  # (the reference's rule for an empty row)
        assert out[2:].tolist() == inverse_cdf(rows, u).tolist()
        assert out[:2].tolist() == [float(p[0, 4]), q.prob(4)]


@pytest.mark.parametrize("row", [0, 2])
def test_non_finite_logits_are_refused_as_by_the_reference(row):
    logits, drafts, qs = _case(3, 50, 2, SamplingParams(1.0), 8, 0.0)
    logits[row, 7] = float("nan")
    for enabled in (True, False):
        kernels.ENABLED = enabled
        try:
            with pytest.raises(NonFiniteLogits):
                verify_draft(logits, drafts, qs, SamplingParams(1.0), uniforms(1, 3))
        finally:
            kernels.ENABLED = True


def test_warm_compiles_without_error():
    kernels.warm()


def _outcome(pb, drafts, enabled: bool, vocab: int = VOCAB):
    """unpack_q's SparseQs as lists, or its error's message, with the kernels on or off."""
    kernels.ENABLED = enabled
    try:
        qs = unpack_q(pb, vocab, drafts)
        return [(q.ids.tolist(), q.counts.tolist(), q.tail, q.bits) for q in qs]
    except InvalidArgument as e:
        return str(e)
    finally:
        kernels.ENABLED = True


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_compiled_decoding_accepts_and_refuses_what_the_reference_does(data):
    """Valid, corrupted and random PackedQs (the fuzz test's): the same SparseQs, or the
    same error naming the same field, with the kernels on and off."""
    drafts = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    pb = data.draw(packed_qs(drafts, clean=False))
    if pb is None or len(pb.sizes) != len(drafts) or len(pb.tails) != len(drafts):
        return  # refused before any decoding, on either path
    assert _outcome(pb, drafts, True) == _outcome(pb, drafts, False)


def test_compiled_decoding_of_a_demo_sized_draft():
    """4 positions of 1,024 listed tokens out of 4,096, escapes in both fields."""
    g = torch.Generator().manual_seed(5)
    qs = [sparse_q(torch.randn(4096, generator=g) * 3, SamplingParams(1.0), 1024, 0.0)]
    qs += [sparse_q(torch.randn(4096, generator=g) * 3, SamplingParams(1.0), 1024, 0.0)] * 3
    drafts = [int(q.ids[5]) for q in qs]
    pb = pack_q(qs)
    assert pb.id_escapes or pb.count_escapes
    ours = _outcome(pb, drafts, True, 4096)
    assert ours == _outcome(pb, drafts, False, 4096)
    assert ours == [(q.ids.tolist(), q.counts.tolist(), q.tail, q.bits) for q in qs]


def _corrupt(pb, how: str) -> None:
    if how == "extra id escape":
        pb.id_escapes.append(3)
    elif how == "extra count escape":
        pb.count_escapes.append(3)
    elif how == "missing id escape":
        pb.id_deltas = pb.id_deltas[:-1] + b"\xff"
    elif how == "id at the vocabulary":  # the last id of q_2: 0 + 40 (vocab 40 below)
        pb.id_deltas = pb.id_deltas[:4] + b"\x28"
    elif how == "repeated id":
        pb.id_deltas = pb.id_deltas[:1] + b"\x00" + pb.id_deltas[2:]
    elif how == "zero count":  # q_1's counts 0, 2^16 - 4, 2: the mass still adds up
        pb.counts = b"\x00" + pb.counts[1:2] + b"\x02" + pb.counts[3:]
    elif how == "mass off by one":
        pb.tails[1] += 1
    elif how == "drafted token not listed, no tail":  # ids 2, 3, 8 and all the mass
        pb.id_deltas = pb.id_deltas[:2] + b"\x05" + pb.id_deltas[3:]
        pb.tails[0] = 0
        pb.counts = b"\x03" + pb.counts[1:]
    elif how == "empty position":  # q_2 lists nothing and has all the mass as its tail
        # (the last position: the reference once failed to index its sums there)
        pb.sizes[1], pb.tails[1] = 0, 2**16
        pb.id_deltas, pb.counts = pb.id_deltas[:3], pb.counts[:3]
        pb.count_escapes[:] = pb.count_escapes[:1]
    elif how == "every position empty":  # (the reference once failed to index its sums)
        pb.sizes[:], pb.tails[:] = [0, 0], [2**16, 2**16]
        pb.id_deltas, pb.counts = b"", b""
        del pb.id_escapes[:], pb.count_escapes[:]
    elif how == "tail with every token listed":  # q_2 lists all 40 tokens, and has a tail
        pb.sizes[1] = 40
        pb.id_deltas = pb.id_deltas[:3] + bytes([0] + [1] * 39)
        pb.counts = pb.counts[:3] + b"\x01" * 40
        pb.count_escapes[:] = pb.count_escapes[:1]
        pb.tails[1] = 2**16 - 40


CORRUPTIONS = [
    "extra id escape",
    "extra count escape",
    "missing id escape",
    "id at the vocabulary",
    "repeated id",
    "zero count",
    "mass off by one",
    "drafted token not listed, no tail",
    "empty position",
    "every position empty",
    "tail with every token listed",
]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_compiled_decoding_refuses_each_corruption_as_the_reference_does(how):
    vocab = 40
    qs = [
        SparseQ(np.array([2, 3, 9]), np.array([1, 2**16 - 4, 1]), 2, vocab),
        SparseQ(np.array([0, 39]), np.array([300, 2**16 - 400]), 100, vocab),
    ]
    pb = pack_q(qs)
    assert _outcome(pb, [9, 5], True, vocab) == _outcome(pb, [9, 5], False, vocab)
    _corrupt(pb, how)
    ours = _outcome(pb, [9, 5], True, vocab)
    assert isinstance(ours, str) and ours == _outcome(pb, [9, 5], False, vocab), ours


def _q_off(logits, params, k, bits=16):
    kernels.ENABLED = False
    try:
        return sparse_q(logits, params, k, 0.0, bits)
    finally:
        kernels.ENABLED = True


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.sampled_from([2, 5, 64, 1000, 4096]),
    k=st.sampled_from([0, 1, 3, 64, 1024]),
    temperature=st.sampled_from([1.0, 0.7, 1.5]),
    bits=st.sampled_from([16, 8, 30]),
    scale_of_logits=st.sampled_from([0.1, 3.0, 30.0]),
    ties=st.booleans(),
    float64=st.booleans(),
)
def test_the_compiled_draft_q_is_the_references_up_to_rounding(
    seed, vocab, k, temperature, bits, scale_of_logits, ties, float64
):
    """The reference's counts within one (float rounding and the order of equal
    remainders; the same k tokens considered: ties at the k-th score take the lowest
    ids); a valid distribution; and the draw is exactly ``SparseQ.sample``'s from the
    same stream."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g) * scale_of_logits
    if ties:  # a run of equal logits across the cut
        logits = logits.round()
    if float64:
        logits = logits.double()
    params = SamplingParams(temperature)
    ours, ref = sparse_q(logits, params, k, 0.0, bits), _q_off(logits, params, k, bits)
    # Only the k largest logits are listed, ties at the k-th taking the lowest ids.
    z = logits.numpy()
    allowed = set(np.lexsort((np.arange(vocab), -z))[: k or vocab].tolist())
    assert set(ours.ids.tolist()) <= allowed and set(ref.ids.tolist()) <= allowed
    assert ours.counts.sum() + ours.tail == 2**bits and (ours.counts > 0).all()
    assert (np.diff(ours.ids) > 0).all() and ours.tail >= 0
    assert ours.tail == 0 or len(ours.ids) < vocab
    if bits >= 16:  # (at 8 bits an entry may round to 0 on one side only)
        # The reference scales and exponentiates in float32: at 30 bits its counts are
        # off by its roundings of logits up to ~150 times 2^30. A token whose count
        # rounds to 0 on one side only is listed on the other.
        close = 1 + 2**bits * 3e-5
        a, b = np.zeros(vocab, np.int64), np.zeros(vocab, np.int64)
        a[ours.ids], b[ref.ids] = ours.counts, ref.counts
        assert np.abs(a - b).max() <= close and abs(ours.tail - ref.tail) <= close
    x, q = draft_position(logits, params, k, 0.0, bits, generator(seed))
    assert q.ids.tolist() == ours.ids.tolist() and q.counts.tolist() == ours.counts.tolist()
    assert x == q.sample(generator(seed))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
def test_the_compiled_draft_q_refuses_non_finite_logits(bad):
    logits = torch.randn(50)
    if bad == "all -inf":
        logits[:] = float("-inf")
    else:
        logits[3] = bad
    for enabled in (True, False):
        kernels.ENABLED = enabled
        try:
            with pytest.raises(NonFiniteLogits):
                draft_position(logits, SamplingParams(1.0), 8, 0.0, 16, generator(1))
        finally:
            kernels.ENABLED = True


@st.composite
def q_lists(draw):
    """1-6 SparseQs: ids in any order (ascending or not), counts and id gaps on both
    sides of the escape byte."""
    vocab = draw(st.sampled_from([3, 300, 4096, 151_936]))
    out = []
    for _ in range(draw(st.integers(1, 6))):
        ids = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40, unique=True))
        if draw(st.booleans()):
            ids.sort()
        count = st.one_of(st.sampled_from([1, 254, 255, 256, 2**16]), st.integers(1, 70_000))
        counts = draw(st.lists(count, min_size=len(ids), max_size=len(ids)))
        out.append(SparseQ(np.array(ids, dtype=np.int64), np.array(counts), 0, vocab))
    return out


@settings(max_examples=300, deadline=None)
@given(q_lists())
def test_compiled_encoding_is_the_references_message(qs):
    """Byte for byte what ``_pack_lists`` writes (which sorts unordered ids)."""
    kernels.ENABLED = False
    try:
        ref = pack_q(qs)
    finally:
        kernels.ENABLED = True
    assert pack_q(qs) == ref


def test_compiled_encoding_escapes_at_255_exactly():
    """Gaps and counts of 254, 255 and 256: 255 and above go to the escapes."""
    qs = [
        SparseQ(np.array([255, 510, 764, 1020]), np.array([254, 255, 256, 2**16]), 0, 2000),
        SparseQ(np.array([1, 3]), np.array([255, 1]), 0, 2000),
    ]
    pb = pack_q(qs)
    assert pb == pack_q([qs[0], SparseQ(np.array([3, 1]), np.array([1, 255]), 0, 2000)])
    assert list(pb.id_escapes) == [255, 255, 256] and list(pb.count_escapes) == [
        255,
        256,
        2**16,
        255,
    ]
    assert pb.id_deltas == bytes([255, 255, 254, 255, 1, 2]) and pb.counts[:4] == bytes(
        [254, 255, 255, 255]
    )


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.sampled_from([1, 2, 7, 409, 4096]),
    d=st.sampled_from([4, 160, 1100]),  # (above 1040 the products are float64)
    rows=st.integers(1, 6),
    temperature=st.sampled_from([1.0, 0.7, 1.3, 0.05, 20.0]),
    top_k=st.sampled_from([0, 3]),
    top_p=st.sampled_from([1.0, 0.8]),
    spread=st.sampled_from([0.0, 1.0, 1000.0]),
    pairs=st.booleans(),
)
@example(seed=1, vocab=7, d=4, rows=2, temperature=1.0, top_k=0, top_p=1.0, spread=0.0, pairs=False)
@example(seed=2, vocab=409, d=160, rows=3, temperature=0.7, top_k=0, top_p=1.0, spread=1.0,
         pairs=True)  # fmt: skip
@example(seed=3, vocab=4096, d=160, rows=2, temperature=0.05, top_k=0, top_p=1.0,
         spread=1000.0, pairs=False)  # fmt: skip
def test_the_compiled_hidden_state_q_is_the_references_bit_for_bit(
    seed, vocab, d, rows, temperature, top_k, top_p, spread, pairs
):
    """``derive_q`` with the kernels gives every position the same ids and counts as
    its numpy reference: the hidden-state wire's draft and target may run either, so
    the two must agree to the last bit, with and without top-k / top-p, from equal
    logits (spread 0: every token at one step; ``pairs``: rows of the head repeated,
    so that tokens tie, at the maximum too, where the leftover goes to the first) to
    rows where most tokens weigh 0."""
    from specdec.hidden_q import QuantHead, derive_q

    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, d, generator=g) * spread
    if pairs:
        weight[1::2] = weight[: vocab // 2 * 2 : 2]
    head = QuantHead.from_weight(weight)
    codes = torch.randint(-127, 128, (rows, d), generator=g).numpy().astype(np.int8)
    scales = np.float32(torch.rand(rows, generator=g).numpy() * 0.1).astype(np.float64)
    params = SamplingParams(temperature, top_k=top_k, top_p=top_p)
    ours = derive_q(head, codes, scales, params)
    kernels.ENABLED = False
    try:
        ref = derive_q(head, codes, scales, params)
    finally:
        kernels.ENABLED = True
    for a, b in zip(ours, ref, strict=True):
        assert a.ids.tolist() == b.ids.tolist() and a.counts.tolist() == b.counts.tolist()
        assert (a.tail, a.vocab, a.bits) == (b.tail, b.vocab, b.bits)
        assert int(a.counts.sum()) + a.tail == 2**a.bits
