"""Shared fixtures: tiny model pairs built from configs, and real local stacks."""

from __future__ import annotations

import os

import pytest

from specdec.local.forkserver import ENV as FORKSERVER

from .stack import local_stack
from .tiny import build_pair

# Services start forked from one process that has done their imports (about 1 s
# instead of 5-7 s per stack; specdec.local.forkserver). Benchmarks the smoke tests
# run inherit it. SPECDEC_LOCAL_FORKSERVER=0 runs every service fresh.
os.environ.setdefault(FORKSERVER, "1")

WIRE_TOP_K = 16


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def gpt2_pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("gpt2"), "gpt2", eos=True)


@pytest.fixture(scope="session")
def llama_stack(tmp_path_factory, llama_pair):
    draft, target = llama_pair
    # q truncated to 16 of the 73 tokens, so the tests exercise a truncated proposal;
    # plain passes on 2 threads, as configs/default.yaml runs them.
    with local_stack(
        tmp_path_factory.mktemp("llama-stack"),
        draft,
        target,
        orchestrator__wire_top_k=WIRE_TOP_K,
        target__plain_torch_threads=2,
    ) as stack:
        yield stack


@pytest.fixture(scope="session")
def gpt2_stack(tmp_path_factory, gpt2_pair):
    draft, target = gpt2_pair
    with local_stack(
        tmp_path_factory.mktemp("gpt2-stack"), draft, target, target__plain_torch_threads=2
    ) as stack:
        yield stack
