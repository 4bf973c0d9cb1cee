"""KV-cache rollback: after truncating and re-extending, logits equal a fresh forward."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import FailedPrecondition
from specdec.model import ModelRunner, load_model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_rollback_then_extend_equals_fresh_forward(family, request):
    _, target = request.getfixturevalue(f"{family}_pair")
    runner = ModelRunner(load_model(str(target), dtype="float64"), "cpu")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (30,), generator=g).tolist()
    other = torch.randint(0, runner.vocab_size, (12,), generator=g).tolist()

    session = runner.new_session("s")
    runner.forward(session, tokens[:20])
    runner.forward(session, other)  # a rejected draft
    assert session.truncate(20) == len(other) and session.length == 20
    assert session.cache.get_seq_length() == 20
    extended = runner.forward(session, tokens[20:], logits_to_keep=10)  # [10, V]

    fresh_session = runner.new_session("f")
    fresh = runner.forward(fresh_session, tokens, logits_to_keep=10)
    torch.testing.assert_close(extended, fresh, rtol=0, atol=1e-10)

    # Rolling back several times, to 0, and growing again also agrees.
    session.truncate(5)
    session.truncate(0)
    again = runner.forward(session, tokens, logits_to_keep=10)
    torch.testing.assert_close(again, fresh, rtol=0, atol=1e-10)


def test_rollback_cannot_grow(llama_pair):
    runner = ModelRunner(load_model(str(llama_pair[1])), "cpu")
    session = runner.new_session("s")
    runner.forward(session, [1, 2, 3])
    with pytest.raises(FailedPrecondition, match="cache_len"):
        session.truncate(4)
