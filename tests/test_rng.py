"""specdec.rng's plain-Python Philox draws exactly what numpy's Generator(Philox) draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.rng import Philox, generator, seeds, side_generator, uniforms

SEED = st.integers(0, 2**64 - 1)
# Spans that take each of numpy's paths: one value, a power of two, Lemire's 32-bit
# rejection, exactly 2^32, the 64-bit rejection, the whole 64-bit range.
SPANS = st.one_of(
    st.sampled_from([1, 2, 3, 7, 4095, 2**16, 2**31 + 1, 2**32 - 1, 2**32, 2**32 + 1, 2**64]),
    st.integers(1, 2**32),
    st.integers(2**32 + 1, 2**64 - 1),
)
DRAW = st.one_of(
    st.tuples(st.just("random"), st.integers(0, 9)),
    st.tuples(st.just("integers"), SPANS),
    st.tuples(st.just("seeds"), st.integers(1, 3)),
)


def _numpy(seed: int, jumps: int = 0) -> np.random.Generator:
    bits = np.random.Philox(key=seed)
    return np.random.Generator(bits.jumped(jumps) if jumps else bits)


def _draw_both(ours: Philox, theirs: np.random.Generator, kind: str, arg: int):
    if kind == "random":
        return ours.random(arg), theirs.random(arg).tolist()
    if kind == "seeds":  # (the orchestrator's: the whole unsigned 64-bit range)
        return seeds(ours, arg), theirs.integers(0, 2**64, size=arg, dtype=np.uint64).tolist()
    low = -(arg // 3)  # an offset too (the span is what picks the path)
    dtype = np.uint64 if arg > 2**63 else np.int64
    if dtype is np.uint64:
        low = 0
    return ours.integers(low, low + arg), int(theirs.integers(low, low + arg, dtype=dtype))


@settings(max_examples=300, deadline=None)
@given(SEED, st.integers(0, 2), st.lists(DRAW, min_size=1, max_size=30))
def test_every_draw_in_any_order_is_numpys(seed, jumps, draws):
    ours, theirs = Philox(seed, jumps), _numpy(seed, jumps)
    for kind, arg in draws:
        a, b = _draw_both(ours, theirs, kind, arg)
        assert a == b, (kind, arg)


def test_the_services_helpers_are_numpys_streams():
    seed = 5 + 2**63
    assert uniforms(seed, 7).tolist() == _numpy(seed).random(7).tolist()
    assert uniforms(seed, 7).dtype == torch.float64
    assert generator(seed).random(3) == _numpy(seed).random(3).tolist()
    assert side_generator(seed).random(3) == _numpy(seed, 1).random(3).tolist()
    # Every bit of the seed counts, and the side stream is another one.
    streams = [tuple(generator(s).random(4)) for s in (5, 5 + 2**32, 5 + 2**63)]
    assert len(set(streams + [tuple(side_generator(5).random(4))])) == 4


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_a_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(ValueError, match="seed"):
        Philox(seed)


@pytest.mark.parametrize("low, high", [(3, 3), (3, 2), (0, 2**64 + 1)])
def test_an_empty_or_too_wide_span_is_refused(low, high):
    with pytest.raises(ValueError, match="low < high"):
        Philox(1).integers(low, high)


@pytest.mark.parametrize("seed", [0, 5, 2**64 - 1])
def test_a_stream_goes_on_from_where_tell_says(seed):
    """``Philox.at(seed, rng.tell())`` draws what ``rng`` draws next (a paced pipeline
    goes on with the request's stream at the draft: ``Pipeline.stream_position``)."""
    for drawn in range(13):
        rng = Philox(seed)
        rng.random(drawn)
        assert rng.tell() == drawn
        again = Philox.at(seed, drawn)
        assert again.tell() == drawn
        assert again.random(6) == rng.random(6) and again.tell() == rng.tell()
    rng = Philox(seed)
    rng.next32()
    with pytest.raises(ValueError):
        rng.tell()
