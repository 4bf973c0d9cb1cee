"""KV-cache rollback: after truncating and re-extending, logits equal a fresh forward;
and one packed forward over several sessions equals each session alone."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import FailedPrecondition
from specdec.runtime.loading import load_model
from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV


def _fresh(model, tokens: list[int], n: int) -> torch.Tensor:
    """The model's own logits (its default attention, no cache) at the last n positions."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -n:]


def _float64_target(family: str, request) -> tuple:
    """The family's tiny target in float64: (the model itself, a ragged runner of it)."""
    _, target = request.getfixturevalue(f"{family}_pair")
    return load_model(str(target), dtype="float64"), RaggedRunner(
        load_model(str(target), dtype="float64")
    )


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_rollback_then_extend_equals_fresh_forward(family, request):
    reference, runner = _float64_target(family, request)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (30,), generator=g).tolist()
    other = torch.randint(0, runner.vocab_size, (12,), generator=g).tolist()

    kv = SessionKV()
    runner.forward([Feed(kv, tokens[:20], 0)])
    runner.forward([Feed(kv, other, 1)])  # a rejected draft
    assert kv.truncate(20) == len(other) and kv.length == 20
    (extended,) = runner.forward([Feed(kv, tokens[20:], 10)])  # [10, V]
    fresh = _fresh(reference, tokens, 10)
    torch.testing.assert_close(extended, fresh, rtol=0, atol=1e-10)

    # Rolling back several times, to 0, and growing again also agrees.
    kv.truncate(5)
    kv.truncate(0)
    (again,) = runner.forward([Feed(kv, tokens, 10)])
    torch.testing.assert_close(again, fresh, rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_forward_of_many_sessions_equals_each_alone(family, request):
    """Ragged lengths, prefill chunks and decode steps of different sessions in one pass."""
    reference, runner = _float64_target(family, request)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, runner.vocab_size, (n,), generator=g).tolist() for n in (17, 4, 33)]
    kvs = [SessionKV() for _ in seqs]
    cut = [10, 1, 5]
    runner.forward([Feed(kv, s[:c], 0) for kv, s, c in zip(kvs, seqs, cut, strict=True)])
    wants = [3, 2, 6]
    outs = runner.forward(
        [Feed(kv, s[c:], w) for kv, s, c, w in zip(kvs, seqs, cut, wants, strict=True)]
    )
    for s, out, w in zip(seqs, outs, wants, strict=True):
        torch.testing.assert_close(out, _fresh(reference, s, w), rtol=0, atol=1e-10)


def test_rollback_cannot_grow(llama_pair):
    runner = RaggedRunner(load_model(str(llama_pair[1])))
    kv = SessionKV()
    runner.forward([Feed(kv, [1, 2, 3], 1)])
    with pytest.raises(FailedPrecondition, match="cache_len"):
        kv.truncate(4)


def test_a_session_appears_once_per_forward(llama_pair):
    runner = RaggedRunner(load_model(str(llama_pair[1])))
    kv = SessionKV()
    with pytest.raises(ValueError, match="once"):
        runner.forward([Feed(kv, [1], 1), Feed(kv, [2], 1)])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_fork_extends_like_its_cache_rolled_back_and_leaves_it_untouched(family, request):
    """``SessionKV.fork(n)``: a copy of the first n positions. Extending the fork
    equals rolling the cache back to n and extending it, in the same pass as its
    origin, and the origin's own logits do not move."""
    reference, runner = _float64_target(family, request)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, runner.vocab_size, (24,), generator=g).tolist()
    branch = torch.randint(0, runner.vocab_size, (5,), generator=g).tolist()
    kv = SessionKV()
    runner.forward([Feed(kv, tokens[:20], 0)])
    fork = kv.fork(12)
    assert fork.length == 12 and kv.length == 20
    mine, theirs = runner.forward([Feed(kv, tokens[20:], 4), Feed(fork, branch, 5)])
    torch.testing.assert_close(mine, _fresh(reference, tokens, 4), rtol=0, atol=1e-10)
    torch.testing.assert_close(
        theirs, _fresh(reference, tokens[:12] + branch, 5), rtol=0, atol=1e-10
    )
    with pytest.raises(FailedPrecondition, match="cache_len"):
        kv.fork(25)
