"""The draft's one-token passes in one compiled call (``specdec.runtime.decode_kernel``):
the same logits and cache as the runner's own passes, within float32 rounding, on
the layouts it takes; refused where it cannot run, and where its start-up check
finds it wrong; a draft's only."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from draft_service.drafter import Drafter
from specdec.config import ModelServiceConfig
from specdec.runtime import decode_kernel
from specdec.runtime.decode_kernel import DecodeKernel
from specdec.runtime.ragged import Feed, RaggedRunner, RopeTable, SessionKV, disagreement
from target_service.verifier import Verifier

BASE = dict(
    vocab_size=61,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
CASES = {
    "llama, grouped kv heads": lambda: LlamaConfig(**BASE),
    "llama, tied, one kv head per head": lambda: LlamaConfig(
        **BASE | dict(num_key_value_heads=4, tie_word_embeddings=True, num_hidden_layers=1)
    ),
    "mistral, no window": lambda: MistralConfig(**BASE, sliding_window=None),
    "qwen2, biased q/k/v": lambda: Qwen2Config(**BASE, use_sliding_window=False),
}


def _runner(config, dtype=torch.float32) -> RaggedRunner:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():  # peaked distributions, as a trained model's
        model.get_output_embeddings().weight.mul_(4.0)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)  # (zero at init: a bias ignored would pass unseen)
    return RaggedRunner(model)


@pytest.mark.parametrize("case", CASES)
def test_the_kernel_gives_the_runners_logits_and_cache(case, monkeypatch):
    """A prompt, then one-token passes past the cache's first capacity (64) and the
    rotary table's (16 here), a rollback and more passes: each pass once through the
    kernel and once through the runner's torch calls, on two sessions fed alike."""
    monkeypatch.setattr(RopeTable, "FIRST", 16)
    runner = _runner(CASES[case]())
    assert runner.use_decode_kernel(), case
    kernel = runner._decode
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, runner.vocab_size, (90,), generator=g).tolist()
    ours, theirs = SessionKV(), SessionKV()
    for kv in (ours, theirs):
        runner._decode = None
        runner.forward([Feed(kv, tokens[:10], 1)])
    got, want = [], []

    def step(t: int) -> None:
        runner._decode = kernel
        got.append(runner.forward([Feed(ours, [t], 1)])[0])
        runner._decode = None
        want.append(runner.forward([Feed(theirs, [t], 1)])[0])

    for t in tokens[10:80]:
        step(t)
    assert ours.length == theirs.length == 80
    ours.truncate(70)
    theirs.truncate(70)
    for t in tokens[80:]:
        step(t)
    got_, want_ = torch.cat(got).double(), torch.cat(want).double()
    assert got_.shape == want_.shape == (80, runner.vocab_size)
    assert disagreement(got_, want_) < 1e-4, case
    for a, b in zip(ours.keys + ours.values, theirs.keys + theirs.values, strict=True):
        assert torch.allclose(a[:, :80], b[:, :80], atol=1e-4, rtol=1e-4), case


def test_a_feed_wanting_only_its_hidden_state_gets_it_without_the_output_layer():
    """The hidden-state wire's feeds (``head=False``): [0, vocab] logits, and the final
    norm's output [1, d] appended, as the runner's lean pass gives them."""
    runner = _runner(CASES["llama, grouped kv heads"]())
    assert runner.use_decode_kernel()
    kernel = runner._decode
    hidden = {}
    for arm, decode in (("kernel", kernel), ("torch", None)):
        kv = SessionKV()
        runner._decode = None
        runner.forward([Feed(kv, [1, 2, 3, 4], 0)])
        runner._decode = decode
        out: list[torch.Tensor] = []
        (logits,) = runner.forward([Feed(kv, [5], 1, out, head=False)])
        assert logits.shape == (0, runner.vocab_size) and kv.length == 5
        hidden[arm] = out[0]
    assert hidden["kernel"].shape == hidden["torch"].shape == (1, 64)
    assert torch.allclose(hidden["kernel"], hidden["torch"], atol=1e-5)


def test_a_pass_that_meets_a_nan_returns_nan_logits():
    """A NaN in the weights comes out as NaN logits (the draft's finite check then
    refuses them), not as numbers: the kernel's fast math keeps NaN and inf."""
    runner = _runner(CASES["llama, grouped kv heads"]())
    assert runner.use_decode_kernel()
    kv = SessionKV()
    runner.forward([Feed(kv, [1, 2, 3], 0)])
    with torch.no_grad():  # (the kernel reads the model's own weights)
        runner.model.model.embed_tokens.weight[7, 0] = float("nan")
    (logits,) = runner.forward([Feed(kv, [7], 1)])
    assert logits.shape == (1, runner.vocab_size) and torch.isnan(logits).all()


@pytest.mark.parametrize(
    "config, dtype",
    [
        (Qwen3Config(**BASE, head_dim=16), torch.float32),  # per-head q/k norms
        (MistralConfig(**BASE, sliding_window=8), torch.float32),  # a window
        (LlamaConfig(**BASE), torch.float64),  # not float32
    ],
    ids=["qwen3", "mistral with a window", "float64"],
)
def test_layouts_the_kernel_does_not_take_keep_the_runners_passes(config, dtype):
    runner = _runner(config, dtype)
    assert not runner.use_decode_kernel() and runner._decode is None


def test_a_wrong_kernel_is_caught_by_its_start_up_check(monkeypatch):
    """The check must fail a kernel that computes the wrong thing: attention scores
    scaled twice over (a wrong scale is off by the order of the logits' spread)."""
    init = DecodeKernel.__init__

    def wrong_scale(self, runner):
        init(self, runner)
        self.scaling *= 2

    monkeypatch.setattr(DecodeKernel, "__init__", wrong_scale)
    runner = _runner(CASES["llama, grouped kv heads"]())
    assert DecodeKernel.of(runner) is None
    assert not runner.use_decode_kernel() and runner._decode is None
    monkeypatch.setattr(decode_kernel, "TOLERANCE", 1e9)  # (the check is what caught it)
    assert DecodeKernel.of(runner) is not None


@pytest.mark.parametrize("on", [True, False])
def test_only_a_draft_service_runs_the_kernel_and_it_follows_the_setting(llama_pair, on):
    draft, target = llama_pair
    svc = Drafter(ModelServiceConfig(model=str(draft), decode_kernel=on))
    assert svc.decode_kernel == on and (svc.runner._decode is not None) == on
    verifier = Verifier(ModelServiceConfig(model=str(target), decode_kernel=True))
    assert not verifier.decode_kernel and verifier.runner._decode is None
