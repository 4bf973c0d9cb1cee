"""oneDNN's linear for passes of many tokens (``specdec.runtime.packed_linear``).

* a packed layer computes what ``nn.Linear`` computes, bit for bit below its
  ``min_rows`` and within rounding from there on;
* installing keeps the model's parameters, state dict and tied weights;
* the start-up calibration picks the size packing starts at from its timings,
  and refuses a packed kernel that computes something else (planted);
* the services follow ``packed_linear`` and ``packed_linear_min_rows``.

Exactness through the services with every pass packed is in
``tests/test_batching.py`` (greedy output of 8 concurrent clients equals
``generate()``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from draft_service.drafter import Drafter
from specdec.config import ModelServiceConfig
from specdec.runtime import packed_linear
from specdec.runtime.loading import load_model, load_tokenizer
from specdec.runtime.packed_linear import OFF, PackedLinear, choose_min_rows
from specdec.runtime.ragged import FUSED_ANY, Feed, RaggedRunner, SessionKV
from target_service.verifier import Verifier

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


def _tiny_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_computes_what_the_linear_does(bias):
    torch.manual_seed(1)
    lin = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(lin)
    with torch.inference_mode():
        for rows in (1, 3, 17, 64):
            x = torch.randn(1, rows, 48)  # [batch, tokens, in], as a model passes it
            want = lin(x)
            packed.min_rows = OFF
            assert torch.equal(packed(x), want)  # the stock path: the same kernel
            packed.min_rows = 1
            got = packed(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        packed.min_rows = 4  # the switch is by rows of the pass
        x = torch.randn(3, 48)
        assert torch.equal(packed(x), lin(x))
        x = torch.randn(48, 6).t()  # a strided view, as a transposed activation would be
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)


def test_installing_keeps_parameters_ties_and_state_dict():
    model = _tiny_llama(tied=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = packed_linear.install(model)
    assert len(layers) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; lm_head
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    packed_linear.uninstall(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))  # a plain model again


def test_packing_starts_where_it_is_faster_at_every_larger_size():
    stock = {1: 1.0, 4: 1.0, 16: 1.0, 64: 1.0}
    assert choose_min_rows(stock, {1: 1.2, 4: 0.9, 16: 0.8, 64: 0.6}) == 4
    # faster at 4 but not at 16: only from 64 on
    assert choose_min_rows(stock, {1: 1.2, 4: 0.9, 16: 1.0, 64: 0.6}) == 64
    assert choose_min_rows(stock, {1: 1.2, 4: 1.1, 16: 1.0, 64: 0.99}) is None  # never
    assert choose_min_rows(stock, {1: 0.5, 4: 0.5, 16: 0.5, 64: 0.5}) == 1


def _calibrate(model):
    runner = RaggedRunner(model)
    packed_linear.install(model)
    return packed_linear.calibrate(
        model,
        lambda tokens: runner.forward([Feed(SessionKV(), tokens, len(tokens))])[0],
        32,
        model.config.vocab_size,
    )


def test_calibration_times_both_ways_and_leaves_its_choice_set():
    model = _tiny_llama(tied=False)
    choice, timings = _calibrate(model)
    assert sorted(timings) == [1, 2, 4, 8, 16, 32]
    assert all(a > 0 and b > 0 for a, b in timings.values())
    assert choice is None or choice in timings
    rows = {m.min_rows for m in model.modules() if isinstance(m, PackedLinear)}
    assert rows == {OFF if choice is None else choice}


def test_calibration_refuses_a_packed_kernel_that_computes_something_else(monkeypatch):
    model = _tiny_llama(tied=False)
    monkeypatch.setattr(packed_linear, "choose_min_rows", lambda stock, packed: 1)  # "faster"
    original = PackedLinear.__init__

    def planted(self, linear):
        original(self, linear)
        # BROKEN: the oneDNN copy of the weight is off by 1%
        self._packed = packed_linear.pack(linear.weight.detach() * 1.01)

    monkeypatch.setattr(PackedLinear, "__init__", planted)
    choice, _ = _calibrate(model)
    assert choice is None
    assert {m.min_rows for m in model.modules() if isinstance(m, PackedLinear)} == {OFF}


@pytest.mark.parametrize(
    ("settings", "packed"),
    [
        ({"packed_linear": False}, False),
        ({"packed_linear_min_rows": 2}, True),
    ],
)
def test_services_follow_the_packed_linear_settings(llama_pair, settings, packed):
    draft, target = llama_pair
    tokenizer = load_tokenizer(str(target))
    for cls, path in ((Verifier, target), (Drafter, draft)):
        cfg = ModelServiceConfig(model=str(path), **settings)
        svc = cls(cfg, load_model(str(path)), tokenizer)
        layers = [m for m in svc.model.modules() if isinstance(m, PackedLinear)]
        assert bool(layers) == packed
        assert svc.packed_min_rows == (2 if packed else None)
        assert all(m.min_rows == 2 for m in layers)
        # Fused passes stop where the packed layers start (``RaggedRunner.fused``).
        assert svc.runner.fused and svc.runner.fused_below == (2 if packed else FUSED_ANY)


def test_fused_passes_below_the_packing_size_and_packed_layers_from_it(llama_pair):
    """A pass shorter than ``packed_linear_min_rows`` runs the layers fused (its
    products take the layers' own weights: no packed layer is called but the output
    layer); one of that size or more calls every packed layer. Both give the logits
    of the unfused model, bit for bit, where the packed ones agree with stock."""
    _, target = llama_pair
    svc = Verifier(ModelServiceConfig(model=str(target), packed_linear_min_rows=4),
                   load_model(str(target)), None)  # fmt: skip
    packed = [m for m in svc.model.modules() if isinstance(m, PackedLinear)]
    calls = []
    for m in packed:
        m.register_forward_hook(lambda mod, args, out: calls.append(mod))
    for rows in (1, 3, 4, 9):
        calls.clear()
        svc.runner.forward([Feed(SessionKV(), list(range(5, 5 + rows)), 1)])
        called = {id(m) for m in calls}
        if rows < 4:
            assert called <= {id(svc.model.lm_head)}, rows  # the layers ran fused
        else:
            assert called == {id(m) for m in packed}, rows


def test_a_model_onednn_cannot_pack_is_served_with_plain_layers(llama_pair, monkeypatch):
    """Packing that fails (an old CPU, an odd dtype) is a logged fallback, not a failed
    start: the service comes up with the model's own layers."""
    draft, target = llama_pair

    def refuse(weight):
        raise RuntimeError("planted: oneDNN has no kernel for this")

    monkeypatch.setattr(packed_linear, "pack", refuse)
    svc = Verifier(ModelServiceConfig(model=str(target)), load_model(str(target)), None)
    assert svc.packed_min_rows is None
    assert not any(isinstance(m, PackedLinear) for m in svc.model.modules())
    assert sum(type(m) is nn.Linear for m in svc.model.modules()) > 0


@pytest.mark.parametrize("tied", [False, True])
def test_direct_layer_calls_use_the_packed_layers(tied):
    """A runner that calls the decoder layers directly (``RaggedRunner.lean``) runs the
    layers packing put in place after start-up, the output layer included, and gives
    the logits of the model's own forward on the packed model, bit for bit."""
    model = _tiny_llama(tied)
    runner = RaggedRunner(model)
    assert runner.lean
    packed_linear.install(model)
    runner.fused_below = 1  # (as a service does: fused passes stop where packing starts)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    calls = []
    for m in packed:
        m.min_rows = 1
        m.register_forward_hook(lambda mod, args, out: calls.append(mod))
    tokens = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    out = {}
    for lean in (True, False):
        runner.lean = lean
        calls.clear()
        out[lean] = runner.forward([Feed(SessionKV(), tokens, len(tokens))])[0]
        assert model.lm_head in calls and {id(m) for m in calls} == {id(m) for m in packed}
    assert torch.equal(out[True], out[False])
