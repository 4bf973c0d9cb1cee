"""Models with several end-of-sequence ids (Llama-3: [128001, 128008, 128009] in
both configs; Qwen2.5: one id in config.json, two in generation_config.json):
generation stops at the first of any of them exactly where the model's own
``generate()`` stops, and Info reports every one of them."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from specdec.runtime.loading import eos_token_ids, load_model, load_tokenizer
from specdec.wire import info_from_pb, info_to_pb

from .inprocess import in_process
from .tiny import build_family_pair

PROMPT = "stop at any of them"
LONG = 60


def _generate(target_dir, ids: list[int], n: int) -> list[int]:
    model = load_model(str(target_dir))
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False, max_new_tokens=n,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def _pick_eos(out: list[int]) -> tuple[int, int, int]:
    """(first, later, never): ``first`` ends the output early and has not appeared
    before; ``later`` appears only after it; ``never`` does not appear at all. A
    generator that watched only ``later`` or ``never`` would run past ``first``."""
    for i in range(6, len(out)):
        first = out[i]
        if first in out[:i]:
            continue
        later = [t for t in out[i + 1 :] if t not in out[: i + 1]]
        never = [t for t in range(max(out) + 2) if t not in out]
        if later and never:
            return first, later[0], never[0]
    raise AssertionError(f"no usable EOS ids in {out}")


def _with_eos(src, dst, config_eos, generation_eos):
    shutil.copytree(src, dst)
    for name, value in (("config.json", config_eos), ("generation_config.json", generation_eos)):
        data = json.loads((dst / name).read_text())
        data["eos_token_id"] = value
        (dst / name).write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize("layout", ["llama3", "qwen25"])
def test_generation_stops_at_the_first_of_any_eos_id_like_generate(tmp_path, layout):
    draft, target = build_family_pair(tmp_path / "models", "llama")
    ids = load_tokenizer(str(target)).encode(PROMPT)
    free = _generate(target, ids, LONG)
    first, later, never = _pick_eos(free)
    if layout == "llama3":  # every id in both files, the one hit first listed last
        config_eos = generation_eos = [later, never, first]
    else:  # config.json names one id; generation_config.json adds the one hit first
        config_eos, generation_eos = later, [later, first]
    want_ids = sorted({first, later} | ({never} if layout == "llama3" else set()))
    draft = _with_eos(draft, tmp_path / "draft", config_eos, generation_eos)
    target = _with_eos(target, tmp_path / "target", config_eos, generation_eos)

    want = _generate(target, ids, LONG)  # the model's own generate() with its EOS list
    assert want[-1] == first and len(want) < LONG and want[:-1] == free[: len(want) - 1]
    assert sorted(eos_token_ids(load_model(str(target)))) == want_ids

    async def scenario():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            async with in_process(draft, target, draft_timeout_s=60) as system:
                for info in (system.verifier.info, system.drafter.info):
                    assert sorted(info.eos_token_ids) == want_ids
                    assert info_from_pb(info_to_pb(info)).eos_token_ids == info.eos_token_ids
                assert sorted(system.orch.target_info.eos_token_ids) == want_ids
                for gamma in (0, 1, 4, 7):
                    got, text, stats = await system.generate(
                        prompt=ids, max_new_tokens=LONG, temperature=0.0, gamma=gamma
                    )
                    # generate() keeps the EOS token it stopped at; the API does not send it.
                    assert got == want[:-1], gamma
                    assert stats.finish_reason == "eos" and stats.generated == len(got)
                    assert text == system.tokenizer.decode(got)
        finally:
            torch.set_num_threads(threads)

    asyncio.run(scenario())
