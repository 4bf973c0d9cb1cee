"""Greedy output through the real services equals the target's own generate()."""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.loading import load_model, load_tokenizer

PROMPTS = ["the cat sat on", "Hello, world!", "a", "we shall see what we shall see."]


def reference(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = load_model(str(model_dir))
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
    )
    new = out[0, len(prompt_ids) :].tolist()
    eos = model.config.eos_token_id
    return new[: new.index(eos)] if eos is not None and eos in new else new


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_equals_target_generate(family, request):
    stack = request.getfixturevalue(f"{family}_stack")
    _, target = request.getfixturevalue(f"{family}_pair")
    tok = load_tokenizer(str(target))
    max_new = 40
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        want = reference(target, ids, max_new)
        for gamma in (1, 3, 5, 8):
            got, _, stats = stack.generate_raw(
                prompt=ids, max_new_tokens=max_new, temperature=0.0, gamma=gamma
            )
            assert got == want, (family, prompt, gamma)
            assert stats.gamma == gamma
            assert stats.drafted_tokens > 0
        plain, _, stats = stack.generate_raw(
            prompt=ids, max_new_tokens=max_new, temperature=0.0, gamma=0
        )
        assert plain == want and stats.drafted_tokens == 0


def test_greedy_dense_wire_and_explicit_rollback_agree(llama_stack, llama_pair):
    ids = load_tokenizer(str(llama_pair[1])).encode("dense mode")
    sparse, _, s1 = llama_stack.generate_raw(prompt=ids, max_new_tokens=24, temperature=0.0)
    dense, _, s2 = llama_stack.generate_raw(
        prompt=ids, max_new_tokens=24, temperature=0.0, dense=True
    )
    assert sparse == dense
    assert s2.wire_bytes_per_token > s1.wire_bytes_per_token


def test_target_as_its_own_draft_accepts_everything(tmp_path, llama_pair):
    """With draft = target every draft must be accepted (greedy, and dense at
    temperature 1 where q = p exactly). Exactness tests cannot see a draft fed
    the wrong context (the target corrects it); this one can."""
    from .stack import local_stack

    _, target = llama_pair
    ids = load_tokenizer(str(target)).encode("same model twice")
    with local_stack(tmp_path, target, target) as stack:
        for gamma in (1, 3, 6):
            for temperature, dense in ((0.0, False), (1.0, True)):
                _, _, stats = stack.generate_raw(
                    prompt=ids,
                    max_new_tokens=30,
                    temperature=temperature,
                    gamma=gamma,
                    dense=dense,
                    seed=gamma,
                )
                assert stats.acceptance_rate == 1.0, (gamma, temperature, stats)
