"""Session store limits and TTL; the orchestrator refuses a mismatched pair."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from draft_service.server import serve as serve_draft
from orchestrator.engine import Orchestrator
from specdec.config import Config, ModelServiceConfig
from specdec.errors import FailedPrecondition, NotFound, ResourceExhausted
from specdec.model import KVSession
from specdec.sessions import SessionStore
from target_service.server import serve as serve_target

from .tiny import build_model


def _session(sid: str, last_used: float) -> KVSession:
    return KVSession(sid, cache=None, last_used=last_used)


def test_store_limit_and_ttl():
    store = SessionStore("draft", max_sessions=2, ttl_s=10.0)
    now = time.monotonic()
    store.add(_session("a", last_used=now))
    store.add(_session("b", last_used=now + 1e6))
    with pytest.raises(ResourceExhausted, match="sessions: the limit of 2"):
        store.add(_session("c", last_used=now + 1e6))
    assert store.expire(now=now + 100.0) == 1  # "a" was idle for 100 s > 10 s
    with pytest.raises(NotFound, match="session_id"):
        store.get("a")
    store.add(_session("c", last_used=now + 1e6))
    assert len(store) == 2


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
