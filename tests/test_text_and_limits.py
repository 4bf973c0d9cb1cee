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


# ---- real tokenizers' byte tokens (built in memory: no model hub) ------------------------
def _byte_level_bpe():
    """A GPT-2-style byte-level BPE: a character past ASCII is split into byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["The cat sat on the mat. Hello world!"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _byte_fallback():
    """A Llama-2-style tokenizer: "▁" for spaces, and byte tokens <0xNN> for text its
    vocabulary lacks, decoded together (``ByteFallback``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ("▁", "a", "b", "▁a"):
        vocab[piece] = len(vocab)
    model = models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>")
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def test_a_prompt_ending_inside_a_character_never_leaks_into_the_output():
    """A prompt whose last tokens are part of a character (U+FFFD, which this server
    itself sends when a length limit cuts a character, or ids cut mid-emoji): the
    first output chunk used to repeat the end of the prompt (' on\\ufffd Hello'), and a
    stop string only in the prompt matched."""
    tok = _byte_level_bpe()
    prompt = tok.encode("The cat sat on\ufffd")
    out = TextStream(tok, [], prompt).push(tok.encode(" Hello world"), final=True)
    assert out.text == " Hello world"
    out = TextStream(tok, ["cat"], tok.encode("The cat\ufffd")).push(tok.encode(" Hello"), True)
    assert out.text == " Hello" and not out.stopped


def test_byte_tokens_whose_run_turns_invalid_never_fail_the_request():
    """Byte-fallback tokens decode as one run; a newline token, then a character cut
    short, then a word made the run invalid after part of it was sent, and the
    tokenizers library's stream raised ("Invalid prefix"): the request ended with
    INTERNAL. The text goes on instead (the cut character is U+FFFD)."""
    tok = _byte_fallback()
    newline, cut, word = tok.convert_tokens_to_ids(["<0x0A>", "<0xE2>", "▁a"])
    stream = TextStream(tok, [], [tok.bos_token_id, word])
    texts = [stream.push([t]).text for t in (newline, cut, word)]
    texts.append(stream.push([], final=True).text)
    assert "".join(texts) == "\n\ufffd a"
    assert stream.ids == [newline, cut, word]


def test_tokens_without_text_stream_on_and_cost_no_more_each():
    """A run of tokens that never makes a whole character (mojibake) used to be
    re-decoded from its start at every token, on the event loop every request shares
    (4,000 of them: 5 s), and none of it was sent before the end."""
    tok = _byte_level_bpe()
    junk = tok.encode("\ufffd") * 1000  # (three byte tokens each, decoded alone: none whole)
    stream = TextStream(tok, [], tok.encode("The cat"))
    sent = sum(len(stream.push([t]).token_ids) for t in junk)
    assert sent >= len(junk) - 8  # streamed as it came, but the last few
    assert len(stream.push([], final=True).token_ids) + sent == len(junk)
