"""A target pool whose replicas serve different models (different fingerprints).

A request stays on the model it started on: when its replica becomes
unreachable it rides the outage out, or fails cleanly after ``target_retry_s``;
it never moves to a replica of another model, whose continuation would be a
different distribution. New requests may go to either model, and the log says
the pool holds two. The control: with two replicas of the *same* model the
request does move, with identical output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
import torch

from draft_service.drafter import Drafter
from orchestrator.engine import Chunk, Orchestrator
from orchestrator.ports.local import LocalTarget, local_pools
from orchestrator.replicas import ReplicaPool
from orchestrator.requests import parse
from specdec.config import Config, ModelServiceConfig
from specdec.errors import Unavailable
from specdec.runtime.loading import load_model, load_tokenizer
from specdec.v1 import orchestrator_pb2
from target_service.verifier import Verifier

from .tiny import build_family, build_family_pair

N = 40
PROMPT = "which model"


class Switch:
    """A target port that can be made unreachable, and counts the sessions it opens."""

    def __init__(self, verifier: Verifier) -> None:
        self.port = LocalTarget(verifier)
        self.down = False
        self.opened = 0

    def check(self) -> None:
        if self.down:
            raise Unavailable("target: UNAVAILABLE: connection refused")

    async def info(self, timeout=None):
        self.check()
        return await self.port.info(timeout)

    async def open(self, *args, **kwargs):
        self.check()
        self.opened += 1
        return SwitchSession(self, await self.port.open(*args, **kwargs))

    async def aclose(self) -> None:
        pass


class SwitchSession:
    relay_token = b""  # in-process: no relays

    def __init__(self, switch: Switch, session) -> None:
        self.switch, self.session = switch, session

    @property
    def next_logits(self) -> bool:
        return self.session.next_logits

    def cancel_relay(self, seed: int) -> None:
        pass

    async def verify(self, *args, **kwargs):
        self.switch.check()
        return await self.session.verify(*args, **kwargs)

    async def rollback(self, *args, **kwargs):
        self.switch.check()
        return await self.session.rollback(*args, **kwargs)

    async def close(self) -> None:
        await self.session.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(draft dir, model A dir, model B dir): A and B share a tokenizer, not weights."""
    root = tmp_path_factory.mktemp("pools")
    draft, a = build_family_pair(root, "llama")
    b = build_family("llama", root / "other-target", seed=3)
    return draft, a, b


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _greedy(target_dir, ids: list[int]) -> list[int]:
    model = load_model(str(target_dir))
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False, max_new_tokens=N,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


@contextlib.asynccontextmanager
async def pool_of(draft_dir, first_dir, second_dir):
    """An orchestrator over target replicas "a" (first) and "b" (second), each a Switch."""
    cfg = Config(
        draft=ModelServiceConfig(model=str(draft_dir)),
        target=ModelServiceConfig(model=str(first_dir)),
    )
    cfg.orchestrator.target_retry_s = 1.0
    cfg.orchestrator.draft_timeout_s = 60.0  # a loaded machine's slow draft is not the point
    tokenizer = load_tokenizer(str(first_dir))
    services = [
        Verifier(ModelServiceConfig(model=str(first_dir)), load_model(str(first_dir)), tokenizer),
        Verifier(ModelServiceConfig(model=str(second_dir)), load_model(str(second_dir)), tokenizer),
        Drafter(cfg.draft, load_model(str(draft_dir)), tokenizer),
    ]
    for svc in services:
        svc.start()
    switches = {"a": Switch(services[0]), "b": Switch(services[1])}
    targets = ReplicaPool(
        "target", "a,b", switches.__getitem__, 1.0, 30.0, resolver=lambda spec: ["a", "b"]
    )
    _, drafts = local_pools(services[2], services[0])
    orch = Orchestrator(cfg, tokenizer, targets, drafts)
    await orch.connect()
    try:
        yield orch, switches
    finally:
        await orch.aclose()
        for svc in services:
            await svc.aclose()


class Run:
    """One greedy request as a task: its chunks so far, and how it ended."""

    def __init__(self, orch: Orchestrator, ids: list[int]) -> None:
        req = orchestrator_pb2.GenerateRequest(max_new_tokens=N, temperature=0.0, gamma=4)
        req.token_ids.ids.extend(ids)
        o = orch
        self.spec = parse(req, o.cfg.orchestrator, o.tokenizer, o.target_info, o.draft_info, 4096)
        self.ids: list[int] = []
        self.first = asyncio.Event()
        self.error: Exception | None = None
        self.task = asyncio.ensure_future(self._run(orch))

    async def _run(self, orch: Orchestrator) -> None:
        try:
            async for item in orch.generate(self.spec, 0.0):
                if isinstance(item, Chunk):
                    self.ids += item.token_ids
                    self.first.set()
                    await asyncio.sleep(0.01)  # a slow client: the outage begins mid-request
        except Unavailable as e:
            self.error = e


def test_a_pool_of_two_models_says_so_and_serves_both(models, caplog):
    draft, a, b = models
    ids = load_tokenizer(str(a)).encode(PROMPT)
    want_a, want_b = _greedy(a, ids), _greedy(b, ids)
    assert want_a != want_b

    async def scenario():
        with caplog.at_level(logging.WARNING, logger="orchestrator.replicas"):
            async with pool_of(draft, a, b) as (orch, switches):
                replicas = orch.target_pool.replicas.values()
                assert len({r.info.model_fingerprint for r in replicas}) == 2
                first, second = Run(orch, ids), Run(orch, ids)  # least-loaded: one on each
                await asyncio.gather(first.task, second.task)
                assert sorted([first.ids, second.ids]) == sorted([want_a, want_b])
                assert switches["a"].opened == switches["b"].opened == 1

    asyncio.run(scenario())
    assert "target pool serves 2 different models" in caplog.text


@pytest.mark.parametrize("outage_s", [0.3, None], ids=["rides-out", "fails-cleanly"])
def test_a_request_never_fails_over_to_another_model(models, outage_s):
    draft, a, b = models
    ids = load_tokenizer(str(a)).encode(PROMPT)
    want_a = _greedy(a, ids)

    async def scenario():
        async with pool_of(draft, a, b) as (orch, switches):
            run = Run(orch, ids)
            await run.first.wait()
            switches["a"].down = True
            if outage_s is not None:
                await asyncio.sleep(outage_s)
                switches["a"].down = False
            await run.task
            assert switches["b"].opened == 0  # never moved to the other model
            if outage_s is None:
                assert isinstance(run.error, Unavailable), run.error
                assert 0 < len(run.ids) < N and run.ids == want_a[: len(run.ids)]
                # A new request goes to the model that is up.
                fresh = Run(orch, ids)
                await fresh.task
                assert fresh.error is None and fresh.ids == _greedy(models[2], ids)
            else:
                assert run.error is None and run.ids == want_a
                assert switches["a"].opened >= 2  # re-opened on the same replica

    asyncio.run(scenario())


def test_control_replicas_of_the_same_model_take_over(models):
    """The same outage with two replicas of model A: the request moves (re-prefilled)
    and its output is unchanged. Without this, the test above could pass vacuously."""
    draft, a, _ = models
    ids = load_tokenizer(str(a)).encode(PROMPT)

    async def scenario():
        async with pool_of(draft, a, a) as (orch, switches):
            run = Run(orch, ids)
            await run.first.wait()
            switches["a"].down = True
            await run.task
            assert run.error is None and run.ids == _greedy(a, ids)
            assert switches["b"].opened == 1

    asyncio.run(scenario())
