"""EOS, stop strings and max_new_tokens are honoured exactly (no tokens past them)."""

from __future__ import annotations

import pytest

from orchestrator.text import TextStream
from specdec.runtime.loading import load_tokenizer


@pytest.fixture(scope="module")
def tok(llama_pair):
    return load_tokenizer(str(llama_pair[1]))


def test_stop_string_split_across_tokens(tok):
    stream = TextStream(tok, ["cd"])
    out = stream.push(tok.encode("ab"))
    assert out.text == "ab" and not out.stopped
    out = stream.push(tok.encode("xc"))
    assert out.text == "x"  # "c" is held back: it may start "cd"
    out = stream.push(tok.encode("dzz"))
    assert out.stopped and out.text == ""
    assert stream.ids == tok.encode("abx")  # tokens from the stop string on are dropped


def test_held_text_is_flushed_at_the_end(tok):
    stream = TextStream(tok, ["cd"])
    assert stream.push(tok.encode("abc")).text == "ab"
    assert stream.push([], final=True).text == "c"


def test_max_new_tokens_is_exact(llama_stack):
    for gamma in (0, 1, 4, 8):
        for n in (1, 2, 7):
            ids, _, stats = llama_stack.generate_raw(
                prompt="count", max_new_tokens=n, temperature=1.0, gamma=gamma, seed=n
            )
            assert len(ids) == n == stats.generated_tokens
            assert stats.finish_reason == "length"


def test_stop_sequence_cuts_exactly(llama_stack):
    _, full, _ = llama_stack.generate_raw(prompt="stop here", max_new_tokens=40, temperature=0.0)
    stop = full[10:13]
    ids, text, stats = llama_stack.generate_raw(
        prompt="stop here", max_new_tokens=40, temperature=0.0, stop=[stop]
    )
    assert text == full[: full.index(stop)]
    assert stats.finish_reason == "stop"
    assert len(ids) == stats.generated_tokens < 40


def test_eos_ends_generation_without_emitting_it(gpt2_stack, gpt2_pair):
    eos = load_tokenizer(str(gpt2_pair[1])).eos_token_id
    reasons = []
    for seed in range(40):  # 12 requests, or more until 3 have ended at EOS and 1 at length
        ids, _, stats = gpt2_stack.generate_raw(
            prompt="the end", max_new_tokens=120, temperature=1.0, seed=seed, gamma=4
        )
        assert eos not in ids
        reasons.append(stats.finish_reason)
        if stats.finish_reason == "eos":
            assert len(ids) < 120
        if len(reasons) >= 12 and reasons.count("eos") >= 3 and "length" in reasons:
            break
    assert reasons.count("eos") >= 3 and "length" in reasons, reasons
