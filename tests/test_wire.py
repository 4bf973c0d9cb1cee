"""The wire codec (specdec.wire): what goes in comes out, at a 151,936-token
vocabulary too (ids beyond 2^16 escape), and the draft's proposal stays exact
through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.errors import InvalidArgument
from specdec.rng import generator
from specdec.sampling import (
    Proposal,
    SamplingParams,
    SparseQ,
    drafted_probs,
    q_entries,
    quantize,
    residual_distribution,
    sparse_q,
)
from specdec.v1 import common_pb2
from specdec.wire import _pack_lists, _unpack_lists, drop_first, pack_q, unpack_q

from .stats import tv, tv_threshold

QWEN_VOCAB = 151_936


@st.composite
def sparse_qs(draw, vocab: int, bits: int):
    k = draw(st.integers(1, min(300, vocab)))
    ids = np.array(draw(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k, unique=True)))
    weights = np.array(draw(st.lists(st.integers(1, 1000), min_size=k, max_size=k)), float)
    tail = draw(st.booleans()) and k < vocab
    probs = np.sort(weights / weights.sum() * (0.9 if tail else 1.0))[::-1]
    return quantize(ids, probs, vocab, eps=0.0, bits=bits, keep_tail=tail)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.data())
def test_pack_unpack_round_trip(data):
    vocab = data.draw(st.sampled_from([73, 4096, 65_537, QWEN_VOCAB]))
    bits = data.draw(st.sampled_from([8, 16, 24, 30]))  # one per session
    qs = [data.draw(sparse_qs(vocab, bits)) for _ in range(data.draw(st.integers(1, 5)))]
    drafts = [int(q.ids[np.argmax(q.counts)]) for q in qs]
    back = unpack_q(pack_q(qs), vocab, drafts)
    assert pack_q(back) == pack_q(qs)  # ids ascending (nothing to sort) or in any order
    for q, b in zip(qs, back, strict=True):
        order = np.argsort(q.ids)
        assert b.ids.tolist() == q.ids[order].tolist()
        assert b.counts.tolist() == q.counts[order].tolist()
        assert (b.tail, b.bits, b.vocab) == (q.tail, q.bits, q.vocab)
        for x in drafts:
            assert b.prob(x) == q.prob(x)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.data())
def test_dropping_the_first_position_in_wire_form_keeps_the_rest(data):
    """A block drafted ahead whose first token was the bonus is forwarded as x_2.. with
    q_2.. cut from the packed bytes (escapes included), never re-encoded."""
    vocab = data.draw(st.sampled_from([73, 4096, QWEN_VOCAB]))
    bits = data.draw(st.sampled_from([8, 16, 30]))
    qs = [data.draw(sparse_qs(vocab, bits)) for _ in range(data.draw(st.integers(2, 5)))]
    drafts = [int(q.ids[np.argmax(q.counts)]) for q in qs]
    packed = pack_q(qs)
    proposal = drop_first(Proposal(drafts, None, packed=packed))
    assert proposal.tokens == drafts[1:] and proposal.qs is None
    assert proposal.packed == pack_q(qs[1:])
    in_memory = drop_first(Proposal(drafts, qs))
    assert in_memory.packed is None and len(in_memory.qs) == len(qs) - 1
    assert all(a is b for a, b in zip(in_memory.qs, qs[1:], strict=True))
    broken = Proposal(drafts, None, packed=common_pb2.PackedQ(bits=bits))  # lists no q
    assert drop_first(broken).packed == broken.packed  # for the target to refuse


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.data())
def test_a_steps_qs_at_once_equal_each_q(data):
    """The target's vectorized forms (one lookup for every drafted token, the residual
    from every row's entries at once) give exactly what each SparseQ gives, listed
    token or tail."""
    vocab = data.draw(st.sampled_from([73, 4096, QWEN_VOCAB]))
    bits = data.draw(st.sampled_from([8, 16, 30]))
    qs = [data.draw(sparse_qs(vocab, bits)) for _ in range(data.draw(st.integers(1, 5)))]
    drafts = [
        int(q.ids[data.draw(st.integers(0, len(q.ids) - 1))])
        if data.draw(st.booleans()) or not q.tail
        else data.draw(st.integers(0, vocab - 1).filter(lambda x, q=q: x not in q.ids))
        for q in qs
    ]
    assert drafted_probs(qs, drafts) == [q.prob(x) for q, x in zip(qs, drafts, strict=True)]
    for dtype in (torch.float64, torch.float32):
        expected = torch.stack([q.dense(dtype=dtype) for q in qs])
        # The residual from the sparse entries, never made dense, is the dense one's.
        p = torch.rand(len(qs), vocab, dtype=dtype).pow(8)
        p /= p.sum(-1, keepdim=True)
        assert torch.equal(
            residual_distribution(p, q_entries(qs)), residual_distribution(p, expected)
        )


def test_large_vocabulary_proposal_is_exact_and_compact():
    """A flat random model's q over 151,936 tokens: the draft's SparseQ, through the
    codec, is still the distribution its tokens are drawn from; and it stays small."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(QWEN_VOCAB, generator=g) * 0.5  # a tiny random model: nearly flat
    q = sparse_q(logits, SamplingParams(1.0), max_entries=64, eps=0.0)
    assert q.tail > 0 and max(q.ids) > 65_535 or q.tail > 0
    rng = generator(3)
    draws = [q.sample(rng) for _ in range(2000)]
    (back,) = unpack_q(pack_q([q]), QWEN_VOCAB, draws[:1])
    assert all(back.prob(x) > 0 for x in draws)
    # Exactness: the empirical distribution of the draws, coarsened to the listed
    # tokens vs the tail, matches q.
    listed = set(q.ids.tolist())
    in_list = np.array([x in listed for x in draws])
    p_list = q.counts.sum() / q.scale
    counts = torch.tensor([int(in_list.sum()), int((~in_list).sum())])
    expected = torch.tensor([p_list, 1 - p_list], dtype=torch.float64)
    assert tv(torch.repeat_interleave(torch.arange(2), counts), expected) < tv_threshold(
        expected, len(draws)
    )
    assert pack_q([q]).ByteSize() < 1024  # 64 listed ids > 2^16 with escapes


def test_bad_packings_are_refused_naming_the_field():
    q = quantize(np.array([3, 9]), np.array([0.6, 0.4]), 20, 0.0, 16, keep_tail=False)
    pb = pack_q([q])
    with pytest.raises(InvalidArgument, match=r"^draft_q: needs one distribution"):
        unpack_q(pb, 20, [3, 3])
    with pytest.raises(InvalidArgument, match=r"^draft_q\[0\]: token id 9 outside"):
        unpack_q(pb, 5, [3])
    with pytest.raises(InvalidArgument, match=r"^draft_q\[0\]: drafted token 4 has q = 0"):
        unpack_q(pb, 20, [4])
    pb.tails[0] = 5
    with pytest.raises(InvalidArgument, match=r"^draft_q\[0\]: counts"):
        unpack_q(pb, 20, [3])
    bad_bits = pack_q([q])
    bad_bits.bits = 40
    with pytest.raises(InvalidArgument, match=r"^draft_q\.bits"):
        unpack_q(bad_bits, 20, [3])


def test_a_drafted_token_needs_mass_at_its_own_position():
    """An unlisted drafted token is fine where its position has a tail, refused (naming
    that position) where it has none, whatever the other positions list."""
    tailed = quantize(np.array([3, 9]), np.array([0.6, 0.3]), 20, 0.0, 16, keep_tail=True)
    closed = quantize(np.array([4, 9]), np.array([0.6, 0.4]), 20, 0.0, 16, keep_tail=False)
    assert tailed.tail > 0 and closed.tail == 0
    pb = pack_q([tailed, closed])
    assert [q.prob(x) for q, x in zip(unpack_q(pb, 20, [7, 4]), [7, 4], strict=True)] == [
        tailed.prob(7),
        closed.prob(4),
    ]
    with pytest.raises(InvalidArgument, match=r"^draft_q\[1\]: drafted token 3 has q = 0"):
        unpack_q(pb, 20, [4, 3])  # 3 is listed at position 0 only
    with pytest.raises(InvalidArgument, match=r"^draft_q\[1\]: drafted token 7 has q = 0"):
        unpack_q(pb, 20, [7, 7])


def test_point_mass_for_greedy():
    q = SparseQ.point(70_000, QWEN_VOCAB)
    (back,) = unpack_q(pack_q([q]), QWEN_VOCAB, [70_000])
    assert back.prob(70_000) == 1.0 and back.tail == 0


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.data())
def test_points_take_a_plain_python_path_with_the_general_paths_bytes_and_checks(data):
    """Greedy drafts (every q a point at its drafted token) are packed and unpacked in
    plain Python (``_pack_points``, ``_unpack_points``): the same message as the
    general path, the same SparseQs back, the same q_i(x_i); and a message that is not
    points at the drafted tokens is refused with the general path's own error."""
    vocab = data.draw(st.sampled_from([20, 300, 4096, QWEN_VOCAB]))
    bits = data.draw(st.sampled_from([1, 7, 8, 16, 30]))
    drafts = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8))
    points = [SparseQ(np.array([x]), np.array([1 << bits]), 0, vocab, bits) for x in drafts]
    pb = pack_q(points)
    assert pb == _pack_lists(points, bits)
    back, general = unpack_q(pb, vocab, drafts), _unpack_lists(pb, vocab, drafts, "draft_q", bits)
    for b, g in zip(back, general, strict=True):
        assert (b.ids.tolist(), b.counts.tolist()) == (g.ids.tolist(), g.counts.tolist())
        assert (b.tail, b.vocab, b.bits) == (g.tail, g.vocab, g.bits)
    others = data.draw(st.lists(st.integers(0, vocab - 1), min_size=len(drafts)))[: len(drafts)]
    assert drafted_probs(points, others) == [q.prob(x) for q, x in zip(points, others, strict=True)]

    # One thing wrong: refused as the general path refuses it.
    bad = common_pb2.PackedQ()
    bad.CopyFrom(pb)
    i = data.draw(st.integers(0, len(drafts) - 1))
    flaw = data.draw(st.sampled_from(["token", "count", "escape", "vocab"]))
    if flaw == "vocab" and max(drafts) == 0:
        flaw = "token"
    claimed = list(drafts)
    if flaw == "token":  # the message lists another token than the one drafted
        claimed[i] = (drafts[i] + 1) % vocab
    elif flaw == "count":
        bad.counts = bad.counts[:i] + bytes([(bad.counts[i] + 1) % 255]) + bad.counts[i + 1 :]
    elif flaw == "escape":
        bad.id_escapes.append(vocab - 1)
    else:  # a drafted token outside the vocabulary
        vocab = max(drafts)
    with pytest.raises(InvalidArgument) as general_error:
        _unpack_lists(bad, vocab, claimed, "draft_q", bits)
    with pytest.raises(InvalidArgument) as error:
        unpack_q(bad, vocab, claimed)
    assert str(error.value) == str(general_error.value)
