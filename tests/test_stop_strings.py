"""Stop strings with tokens of several characters: text and token ids agree chunk by
chunk, and nothing of a cut stop string is streamed or counted, even when the stop
string starts in the middle of a token (the output then ends with the last token
that lies wholly before it)."""

from __future__ import annotations

import asyncio
from itertools import accumulate

import grpc
import pytest
import torch

from orchestrator.engine import Chunk
from orchestrator.requests import parse
from specdec.runtime.loading import load_tokenizer
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from .inprocess import in_process
from .tiny import PIECES, build_family_pair

N = 40
PROMPT = [14, 12, 22, 0]  # "the", " ", "abc", "a"


@pytest.fixture(scope="module")
def piece_pair(tmp_path_factory):
    return build_family_pair(tmp_path_factory.mktemp("pieces"), "llama", pieces=True)


async def _run(system, **fields) -> tuple[list[Chunk], object]:
    """One request through the engine; returns its chunks and its stats."""
    o = system.orch
    req = orchestrator_pb2.GenerateRequest(**fields)
    req.token_ids.ids.extend(PROMPT)
    spec = parse(req, o.cfg.orchestrator, o.tokenizer, o.target_info, o.draft_info, 1 << 20)
    chunks, stats = [], None
    async for item in o.generate(spec, asyncio.get_running_loop().time()):
        if isinstance(item, Chunk):
            chunks.append(item)
        else:
            stats = item
    return chunks, stats


def _piece(token: int) -> str:
    return PIECES[token] if token < len(PIECES) else ""  # EOS, not an end here: no text


def _mid_token_stop(ids: list[int]) -> str:
    """A stop string that starts after the first character of a multi-character token
    and runs into the next token."""
    k = next(k for k in range(2, len(ids) - 2) if len(_piece(ids[k])) > 1)
    return _piece(ids[k])[1:] + _piece(ids[k + 1]) + _piece(ids[k + 2])


def _check_chunks(tokenizer, chunks: list[Chunk]) -> tuple[list[int], str]:
    """Every chunk's text is exactly its token ids' text (special tokens have none);
    returns all ids and text."""
    for c in chunks:
        assert tokenizer.decode(c.token_ids, skip_special_tokens=True) == c.text, c
    ids = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    return ids, text


def test_a_stop_string_starting_mid_token_cuts_before_that_token(piece_pair):
    draft, target = piece_pair
    tokenizer = load_tokenizer(str(target))
    mid_token_cuts = 0

    async def scenario():
        nonlocal mid_token_cuts
        async with in_process(draft, target, draft_timeout_s=60) as system:
            for seed in range(8):
                fields = dict(max_new_tokens=N, temperature=0.0 if seed == 0 else 1.0, seed=seed)
                fields["gamma"] = 4
                chunks, stats = await _run(system, **fields)
                free, full = _check_chunks(tokenizer, chunks)
                assert stats.finish_reason == "length" and stats.generated == len(free) == N

                stop = _mid_token_stop(free)
                at = full.find(stop)  # the first occurrence (maybe before the planted one)
                ends = [0, *accumulate(len(_piece(t)) for t in free)]  # text end per prefix
                keep = max(j for j, end in enumerate(ends) if end <= at)
                while keep and _piece(free[keep - 1]) == "":
                    keep -= 1  # a token without text travels with the token after it
                mid_token_cuts += at not in ends

                chunks, stats = await _run(system, stop=[stop, "never seen"], **fields)
                ids, text = _check_chunks(tokenizer, chunks)
                assert ids == free[:keep], (seed, stop)
                assert text == full[: ends[keep]] and stop not in text
                assert stats.finish_reason == "stop"
                assert stats.generated == len(ids)  # nothing cut is counted

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        asyncio.run(scenario())
    finally:
        torch.set_num_threads(threads)
    assert mid_token_cuts >= 4  # most planted stops begin inside a token


def test_stop_strings_through_grpc_count_only_what_is_sent(llama_stack):
    """Over the wire: each chunk's text is its ids' text, and generated_tokens counts
    exactly the ids sent before the stop string."""
    tokenizer = load_tokenizer(llama_stack.config["target"]["model"])
    request = dict(text="stop strings", max_new_tokens=30, temperature=1.0, seed=11, gamma=4)

    def stream(**extra):
        chunks, stats = [], None
        with grpc.insecure_channel(llama_stack.orchestrator_address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            req = orchestrator_pb2.GenerateRequest(**request, **extra)
            for msg in stub.Generate(req, timeout=60):
                if msg.HasField("chunk"):
                    chunks.append(Chunk(msg.chunk.text, list(msg.chunk.token_ids)))
                else:
                    stats = msg.stats
        return chunks, stats

    chunks, _ = stream()
    _, full = _check_chunks(tokenizer, chunks)
    stop = full[10:13]
    chunks, stats = stream(stop=[stop])
    ids, text = _check_chunks(tokenizer, chunks)
    assert text == full[: full.find(stop)] and stats.finish_reason == "stop"
    assert stats.generated_tokens == len(ids)
