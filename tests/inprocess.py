"""The orchestrator's engine with draft and target in this process (no gRPC):
``orchestrator.ports.local``. For unit tests that run in milliseconds."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from draft_service.drafter import Drafter
from orchestrator.engine import Chunk, Orchestrator, Stats
from orchestrator.ports.local import local_pools
from orchestrator.requests import parse
from specdec.config import Config, ModelServiceConfig
from specdec.runtime.loading import load_model, load_tokenizer
from specdec.v1 import orchestrator_pb2
from target_service.verifier import Verifier


class InProcess:
    """Draft and target services and an orchestrator sharing one event loop."""

    def __init__(
        self,
        draft_dir: Path | None,
        target_dir: Path,
        draft: dict | None = None,
        target: dict | None = None,
        **orchestrator,
    ) -> None:
        """``draft``, ``target``: settings of the model services; the rest are the
        orchestrator's."""
        self.cfg = Config(
            draft=ModelServiceConfig(
                model=str(draft_dir or target_dir), max_batch_tokens=512, **(draft or {})
            ),
            target=ModelServiceConfig(
                model=str(target_dir), max_batch_tokens=512, **(target or {})
            ),
        )
        self.cfg.orchestrator.draft_timeout_s = 30.0  # a shared CI machine can be slow
        for key, value in orchestrator.items():
            setattr(self.cfg.orchestrator, key, value)
        self.tokenizer = load_tokenizer(str(target_dir))
        self.verifier = Verifier(self.cfg.target, load_model(str(target_dir)), self.tokenizer)
        self.drafter = None
        if draft_dir is not None:
            self.drafter = Drafter(self.cfg.draft, load_model(str(draft_dir)), self.tokenizer)
        self.orch: Orchestrator | None = None

    async def start(self) -> None:
        self.verifier.start()
        if self.drafter is not None:
            self.drafter.start()
        target, draft = local_pools(self.drafter, self.verifier)
        self.orch = Orchestrator(self.cfg, self.tokenizer, target, draft)
        await self.orch.connect()

    async def aclose(self) -> None:
        await self.orch.aclose()
        await self.verifier.aclose()
        if self.drafter is not None:
            await self.drafter.aclose()

    async def generate(self, **fields) -> tuple[list[int], str, Stats]:
        prompt = fields.pop("prompt")
        req = orchestrator_pb2.GenerateRequest(**fields)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        o = self.orch
        spec = parse(req, o.cfg.orchestrator, o.tokenizer, o.target_info, o.draft_info, 1 << 20)
        ids, text, stats = [], "", None
        async for item in o.generate(spec, asyncio.get_running_loop().time()):
            if isinstance(item, Chunk):
                ids += item.token_ids
                text += item.text
            else:
                stats = item
        return ids, text, stats


@contextlib.asynccontextmanager
async def in_process(draft_dir, target_dir, **orchestrator):
    system = InProcess(draft_dir, target_dir, **orchestrator)
    await system.start()
    try:
        yield system
    finally:
        await system.aclose()
