"""bfloat16 and float16 end to end, and where they may differ from the model's own
``generate()`` in the same dtype.

In half precision a packed forward over a KV cache rounds differently from
``generate()``'s forward, by about one ulp of the logits. Greedy output can then
differ, but only where the two best logits are that close: at the first token
where our output and ``generate()``'s part, the model's own top-2 logit margin
must be at most ``MARGIN_ULPS`` ulps of the top logit in that dtype
(``near_tie_bound``). A different model (the planted bug) parts from it at
margins far above the bound.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from draft_service.drafter import Drafter
from orchestrator.engine import Chunk, Orchestrator
from orchestrator.ports.local import local_pools
from orchestrator.requests import parse
from specdec.config import Config, ModelServiceConfig
from specdec.runtime.loading import load_model, load_tokenizer
from specdec.v1 import orchestrator_pb2
from target_service.verifier import Verifier

from .tiny import build_family_pair

MARGIN_ULPS = 8  # a near tie: the two best logits within this many ulps of the top one
SIGNIFICANT_BITS = {"bfloat16": 8, "float16": 11}
N = 32
PROMPTS = 12


def near_tie_bound(top: float, dtype: str) -> float:
    """MARGIN_ULPS units in the last place of ``dtype`` at ``top``."""
    exponent = math.floor(math.log2(max(abs(top), 1e-30)))
    return MARGIN_ULPS * 2.0 ** (exponent - SIGNIFICANT_BITS[dtype] + 1)


def _generate(model, ids: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False, max_new_tokens=N,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def _parting(model, dtype: str, ids: list[int], got: list[int], want: list[int]):
    """None if equal; else (top-2 margin, bound, whether ours is the runner-up) at the
    first token where they part, from the model's own forward over the shared prefix."""
    j = next((i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y), None)
    if j is None:
        return None
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + want[:j]])).logits[0, -1].float()  # [V]
    top2 = logits.topk(2)
    margin = float(top2.values[0] - top2.values[1])
    return margin, near_tie_bound(float(top2.values[0]), dtype), got[j] in top2.indices.tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_parts_from_generate_only_at_near_ties(tmp_path, dtype):
    draft_dir, target_dir = build_family_pair(tmp_path, "llama")
    tokenizer = load_tokenizer(str(target_dir))
    half = dict(dtype=dtype)
    target = load_model(str(target_dir), **half)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 40, (12,), generator=g).tolist() for _ in range(PROMPTS)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    async def scenario():
        cfg = Config(
            draft=ModelServiceConfig(model=str(draft_dir), **half),
            target=ModelServiceConfig(model=str(target_dir), **half),
        )
        verifier = Verifier(cfg.target, load_model(str(target_dir), **half), tokenizer)
        drafter = Drafter(cfg.draft, load_model(str(draft_dir), **half), tokenizer)
        verifier.start()
        drafter.start()
        # Half precision is slow on a CPU: never let a slow draft turn into a fallback.
        cfg.orchestrator.draft_timeout_s = 60.0
        orch = Orchestrator(cfg, tokenizer, *local_pools(drafter, verifier))
        await orch.connect()
        assert orch.target_info.dtype == dtype

        async def run(ids, **fields):
            req = orchestrator_pb2.GenerateRequest(max_new_tokens=N, gamma=4, **fields)
            req.token_ids.ids.extend(ids)
            spec = parse(req, orch.cfg.orchestrator, tokenizer, orch.target_info, None, 4096)
            out, stats = [], None
            async for item in orch.generate(spec, 0.0):
                if isinstance(item, Chunk):
                    out += item.token_ids
                else:
                    stats = item
            assert stats.generated == N and stats.fallback_steps == 0
            return out

        try:
            greedy = [await run(ids, temperature=0.0) for ids in prompts]
            sampled = await run(prompts[0], temperature=1.0, seed=3)  # the sampling path too
            assert all(0 <= t < verifier.vocab_size for t in sampled)
            return greedy
        finally:
            await orch.aclose()
            await verifier.aclose()
            await drafter.aclose()

    try:
        greedy = asyncio.run(scenario())
        partings = [
            _parting(target, dtype, ids, got, _generate(target, ids))
            for ids, got in zip(prompts, greedy, strict=True)
        ]
        # The planted bug: another model's greedy output (the draft's, same dtype).
        other = load_model(str(draft_dir), **half)
        wrong = [
            _parting(target, dtype, ids, _generate(other, ids), _generate(target, ids))
            for ids in prompts
        ]
    finally:
        torch.set_num_threads(threads)

    parted = [p for p in partings if p is not None]
    print(f"{dtype}: {len(parted)} of {PROMPTS} prompts part from generate(): {parted}")
    assert len(parted) <= PROMPTS // 2  # mostly identical
    for margin, bound, runner_up in parted:
        assert margin <= bound and runner_up, (margin, bound)
    assert any(p is not None and p[0] > p[1] for p in wrong), wrong
