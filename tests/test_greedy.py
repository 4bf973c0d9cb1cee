"""Greedy output through the real services equals the target's own generate()."""

from __future__ import annotations

import pytest
import torch

from specdec.model import load_model, load_tokenizer

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
