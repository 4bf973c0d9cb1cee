"""Session store limits; the orchestrator refuses a mismatched pair."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from draft_service.servicer import serve as serve_draft
from orchestrator.engine import Orchestrator
from specdec.config import Config, ModelServiceConfig
from specdec.errors import AlreadyExists, FailedPrecondition, ResourceExhausted
from specdec.sampling import SamplingParams
from specdec.sessions import Session, SessionStore
from target_service.servicer import serve as serve_target

from .tiny import build_model


def test_store_limit_and_ids():
    store = SessionStore("draft", max_sessions=2)
    a, b = Session("a", SamplingParams()), Session("b", SamplingParams())
    store.add(a)
    store.add(b)
    with pytest.raises(ResourceExhausted, match="sessions: the limit of 2"):
        store.add(Session("c", SamplingParams()))
    assert store.remove(a) and not store.remove(a)
    with pytest.raises(AlreadyExists, match="session_id"):
        store.add(Session("b", SamplingParams()))
    store.add(Session("c", SamplingParams()))
    assert len(store) == 2


def test_cached_tokens_are_summed_when_read_not_per_step():
    """specdec_model_cached_tokens is the sum over the live sessions' caches as they
    are when /metrics is read: no step has to keep it current (a sum over every
    session on each step made a round of steps O(sessions^2))."""
    from types import SimpleNamespace

    from specdec import metrics

    def cached() -> float:
        registry = metrics.registry_for("draft")
        return registry.get_sample_value("specdec_model_cached_tokens", {"role": "draft"})

    store = SessionStore("draft", max_sessions=4)
    a = Session("a", SamplingParams(), kv=SimpleNamespace(length=5))
    b = Session("b", SamplingParams(), kv=SimpleNamespace(length=7))
    store.add(a)
    store.add(b)
    assert cached() == 12
    a.kv.length = 9  # a step grew a's cache; nobody told the store
    assert cached() == 16
    store.remove(b)
    assert cached() == 9


def test_orchestrator_refuses_pair_with_different_vocabularies(tmp_path, llama_pair):
    draft_dir, target_dir = llama_pair
    # A draft whose vocabulary is larger than the target's (and the tokenizer's).
    other = build_model("llama", tmp_path / "other", layers=1, width=32, seed=3)
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(other)
    cfg.vocab_size += 5
    LlamaForCausalLM(cfg).save_pretrained(other)

    async def scenario() -> str:
        d, _ = await serve_draft(ModelServiceConfig(model=str(other)))
        t, _ = await serve_target(ModelServiceConfig(model=str(target_dir)))
        config = Config(
            draft=ModelServiceConfig(model=str(other)),
            target=ModelServiceConfig(model=str(target_dir)),
        )
        config.orchestrator = dataclasses.replace(
            config.orchestrator,
            draft_address=f"127.0.0.1:{d.port}",
            target_address=f"127.0.0.1:{t.port}",
            connect_timeout_s=10,
        )
        orch = Orchestrator(config)
        try:
            await orch.connect()
            return ""
        except FailedPrecondition as e:
            return str(e)
        finally:
            await orch.aclose()
            await d.server.stop(0)
            await t.server.stop(0)

    message = asyncio.run(scenario())
    assert "cannot be paired" in message and "vocab_size" in message, message
