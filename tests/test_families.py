"""Every tested model family, token for token against its own ``generate()``.

Tiny random models of nine families (``tests.tiny.FAMILIES``): greedy output
through the engine equals the target's own ``generate(do_sample=False)`` at
gamma 1, 4 and 7; rolling a session back and extending it equals a fresh
forward (float64), for sliding-window and hybrid families too, with sequences
much longer than the window. A runtime that ignored the window or Gemma-2's
soft-capping fails these comparisons and is refused by the start-up
self-test; a family the runtime cannot serve (ALiBi, attention sinks) is
refused when the service starts, naming the model type.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdec import cli
from specdec.config import ModelServiceConfig
from specdec.errors import Unsupported
from specdec.runtime.loading import load_model, load_tokenizer
from specdec.runtime.ragged import (
    FUSED_WINDOW,
    LEAN_FAMILIES,
    Feed,
    RaggedBatch,
    RaggedRunner,
    RopeTable,
    SessionKV,
)
from target_service.verifier import Verifier

from .inprocess import in_process
from .stack import write_config
from .tiny import FAMILIES, WINDOW, build_family, build_family_pair, family_config

PROMPT = "the families, all."  # 18 tokens; with the output, many windows long
NEW_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and several engineers share the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def family_pair(tmp_path_factory):
    """family -> (draft dir, target dir), each built on first use."""
    root = tmp_path_factory.mktemp("families")
    built: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = build_family_pair(root, kind)
        return built[kind]

    return get


def _generate(target_dir, ids: list[int], n: int) -> list[int]:
    """The target's own greedy continuation (its own attention and cache)."""
    model = load_model(str(target_dir))
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False, max_new_tokens=n,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_equals_the_models_own_generate(family_pair, kind):
    draft, target = family_pair(kind)
    ids = load_tokenizer(str(target)).encode(PROMPT)
    assert len(ids) + NEW_TOKENS > 3 * WINDOW
    want = _generate(target, ids, NEW_TOKENS)

    async def scenario():
        drafted = accepted = 0
        async with in_process(draft, target, draft_timeout_s=60) as system:
            for gamma in (1, 4, 7):
                got, _, stats = await system.generate(
                    prompt=ids, max_new_tokens=NEW_TOKENS, temperature=0.0, gamma=gamma
                )
                assert got == want, (kind, gamma)
                assert stats.generated == NEW_TOKENS and stats.finish_reason == "length"
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        # Drafts were both accepted and rejected: both cache paths ran.
        assert 0 < accepted < drafted, kind

    asyncio.run(scenario())


def _fresh(model, tokens: list[int], n: int) -> torch.Tensor:
    """The model's own logits (its default attention, no cache) at the last n positions."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -n:]


def _rollback_error(runner: RaggedRunner, reference) -> float:
    """Largest logit difference from fresh forwards after rollbacks and a packed forward."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (40,), generator=g).tolist()
    other = torch.randint(0, runner.vocab_size, (12,), generator=g).tolist()
    short = tokens[:6]
    a, b = SessionKV(), SessionKV()
    runner.forward([Feed(a, tokens[:25], 0)])
    runner.forward([Feed(a, other, 1)])  # a rejected draft, longer than the window
    a.truncate(25)
    # Session a extends after its rollback while session b prefills, in one packed forward.
    extended, packed = runner.forward([Feed(a, tokens[25:], 15), Feed(b, short, 3)])  # [15, V]
    a.truncate(31)
    (decoded,) = runner.forward([Feed(a, tokens[31:32], 1)])  # one decode step
    pairs = [
        (extended, _fresh(reference, tokens, 15)),
        (packed, _fresh(reference, short, 3)),
        (decoded, _fresh(reference, tokens[:32], 1)),
    ]
    return max(float((got - want).abs().max()) for got, want in pairs)


# How exact a float64 forward is. Gemma 2's RMSNorm computes in float32 whatever the
# model's dtype (``x.float()``), and float32 sums round differently for different
# shapes on some CPUs: on an AVX-512 one the model's own forwards over 9 and over 40
# tokens differ by 1.3e-6 at the same position. So for it the comparison is as exact
# as float32 allows, still far below what a wrong window or soft-cap gives (> 1e-3).
EXACT = {"gemma2": 1e-5}


@pytest.mark.parametrize("kind", FAMILIES)
def test_rollback_then_extend_equals_a_fresh_forward(family_pair, kind):
    _, target = family_pair(kind)
    reference = load_model(str(target), dtype="float64")
    runner = RaggedRunner(load_model(str(target), dtype="float64"))
    assert _rollback_error(runner, reference) <= EXACT.get(kind, 1e-10)


@pytest.mark.parametrize("kind", FAMILIES)
def test_layers_are_called_directly_for_the_lean_families_only(family_pair, kind):
    """A family of LEAN_FAMILIES skips its model forward's wrapper; the others run
    through the wrapper, and so does remote code that reuses a family's name (here: a
    subclass defined outside transformers). The comparisons above ran through
    whichever way the runner took."""
    _, target = family_pair(kind)
    model = load_model(str(target))
    assert RaggedRunner(model).lean == (kind in LEAN_FAMILIES), kind
    assert not RaggedRunner(model, lean=False).lean
    if kind in LEAN_FAMILIES:
        model.__class__ = type("RemoteCausalLM", (type(model),), {})
        assert not RaggedRunner(model).lean


def test_a_direct_call_that_changes_a_logit_is_turned_off(family_pair, monkeypatch, caplog):
    """The planted bug: the direct call's logits off by one part in a million (as a
    skipped scaling or a different kernel would make them). The start-up check must
    find it and fall back to the wrapped forward, which still serves the model."""
    _, target = family_pair("llama")
    lean_forward = RaggedRunner._lean_forward

    def off(self, *args):
        return lean_forward(self, *args) * (1 + 1e-6)

    monkeypatch.setattr(RaggedRunner, "_lean_forward", off)
    runner = RaggedRunner(load_model(str(target)))
    assert not runner.lean
    assert "calling the layers directly is off" in caplog.text
    (logits,) = runner.forward([Feed(SessionKV(), [1, 2, 3], 1)])
    assert logits.shape == (1, runner.vocab_size)


BROKEN = [
    ("mistral", "window"),
    ("qwen2", "window"),
    ("qwen3", "window"),
    ("phi3", "window"),
    ("gemma2", "window"),
    ("gemma2", "softcap"),
]


@pytest.mark.parametrize("kind,ignored", BROKEN, ids=[f"{k}-{i}" for k, i in BROKEN])
def test_a_runtime_that_ignores_the_window_or_softcap_is_caught(
    family_pair, kind, ignored, monkeypatch
):
    """The planted bug: attend as if the model had no sliding window (or no soft-cap).
    The exact comparison above must fail and the start-up self-test must refuse it."""
    _, target = family_pair(kind)
    reference = load_model(str(target), dtype="float64")
    runner = RaggedRunner(load_model(str(target), dtype="float64"))
    attend = RaggedBatch.attend

    def broken(self, layer, query, scaling, window, softcap):
        if ignored == "window":
            window = None
        else:
            softcap = None
        return attend(self, layer, query, scaling, window, softcap)

    monkeypatch.setattr(RaggedBatch, "attend", broken)
    assert _rollback_error(runner, reference) > 1e-3
    with pytest.raises(Unsupported, match=f"model type {kind} .*differs from the model's own"):
        RaggedRunner(load_model(str(target), dtype="float64"))


def test_an_unsupported_family_is_refused_at_start_up(tmp_path, capsys):
    """Bloom (ALiBi) cannot run in the ragged runtime: the target service refuses to
    start, naming the model type, instead of failing its first request."""
    bloom = build_family("bloom", tmp_path / "bloom", layers=1, width=32)
    with pytest.raises(Unsupported, match="model type bloom"):
        Verifier(ModelServiceConfig(model=str(bloom)))

    # torch_threads 0: leave this test process's thread count alone.
    path, _ = write_config(tmp_path, bloom, bloom, target__torch_threads=0)
    assert cli.main(["serve", "target", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "model type bloom (BloomForCausalLM)" in err, err


def test_attention_sinks_are_refused_at_start_up():
    """gpt-oss adds a learned sink logit to every attention row: refused by name."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(
        vocab_size=73, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, layer_types=["full_attention"],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(Unsupported, match="model type gpt_oss .*s_aux"):
        RaggedRunner(model)


@pytest.mark.parametrize("lean", [True, False])
def test_services_follow_the_lean_forward_setting(family_pair, lean):
    _, target = family_pair("llama")
    svc = Verifier(ModelServiceConfig(model=str(target), lean_forward=lean))
    assert svc.runner.lean == lean


# ---- fused projections (``RaggedRunner.fused``) ---------------------------------------


@pytest.mark.parametrize("kind", FAMILIES)
def test_layers_run_fused_for_the_fused_families_only(family_pair, kind):
    """Llama, Mistral, Qwen2 and Qwen3 run their lean passes fused (q/k/v and gate/up in one
    product each), the model's own weights made views into the fused ones (nothing
    held twice); every other family, ``fused=False`` and remote code do not."""
    _, target = family_pair(kind)
    model = load_model(str(target))
    runner = RaggedRunner(model)
    assert runner.fused == (kind in FUSED_WINDOW), kind
    assert not RaggedRunner(load_model(str(target)), fused=False).fused
    if kind in FUSED_WINDOW:
        for fused, layer in zip(runner._fused_layers, model.model.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            for m in (attn.q_proj, attn.k_proj, attn.v_proj):
                assert m.weight.untyped_storage().data_ptr() == fused.qkv.data_ptr()
            for m in (mlp.gate_proj, mlp.up_proj):
                assert m.weight.untyped_storage().data_ptr() == fused.gate_up.data_ptr()
        remote = load_model(str(target))
        remote.__class__ = type("RemoteCausalLM", (type(remote),), {})
        assert not RaggedRunner(remote).fused


@pytest.mark.parametrize("kind", sorted(FUSED_WINDOW))
def test_fused_passes_equal_the_layers_own_calls_and_leave_the_model_as_it_was(family_pair, kind):
    """Bit for bit, on the rollback passes above (two sessions in one pass, windows
    longer than the model's): fused against the layers' own calls, in float32. And
    the model's own forward after fusing equals that of a model never fused."""
    _, target = family_pair(kind)
    model = load_model(str(target))
    runner = RaggedRunner(model)
    assert runner.fused
    outs = {}
    for fused in (True, False):
        runner.fused = fused
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, runner.vocab_size, (40,), generator=g).tolist()
        a, b = SessionKV(), SessionKV()
        first = runner.forward([Feed(a, tokens[:25], 4)])[0]
        a.truncate(20)
        both = runner.forward([Feed(a, tokens[20:], 20), Feed(b, tokens[:7], 7)])
        (step,) = runner.forward([Feed(b, tokens[7:8], 1)])
        outs[fused] = torch.cat([first, *both, step])
    assert torch.equal(outs[True], outs[False]), kind
    ids = torch.tensor([tokens[:30]])
    with torch.inference_mode():
        want = load_model(str(target))(input_ids=ids, use_cache=False).logits
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, want)


def test_a_fused_layer_that_changes_a_logit_is_turned_off(family_pair, monkeypatch, caplog):
    """The planted bug: fused layers off by one part in a million. The start-up check
    turns fusing off (logged) and keeps the direct calls of the unfused layers."""
    from specdec.runtime.ragged import FusedLayer

    _, target = family_pair("llama")
    call = FusedLayer.__call__

    def off(self, *args):
        return call(self, *args) * (1 + 1e-6)

    monkeypatch.setattr(FusedLayer, "__call__", off)
    with caplog.at_level("INFO"):
        runner = RaggedRunner(load_model(str(target)))
    assert runner.lean and not runner.fused
    assert "fused projections are off" in caplog.text


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen3"])
def test_a_fused_layer_that_ignores_the_window_is_turned_off(family_pair, kind, monkeypatch):
    """The planted bug: the fused layers attend as if the family had no sliding window
    (``FUSED_WINDOW`` wrong). The self-test's 24 tokens outrun the tests' windows, so
    its logits differ and fusing is off; the unfused direct calls still serve."""
    _, target = family_pair(kind)
    monkeypatch.setitem(FUSED_WINDOW, kind, lambda attn: None)
    runner = RaggedRunner(load_model(str(target)))
    assert runner.lean and not runner.fused


def test_a_fused_layer_that_skips_qwen3s_head_norms_is_turned_off(family_pair, monkeypatch):
    """The planted bug: Qwen3's per-head q/k norms left out of the fused layers."""
    from specdec.runtime.ragged import FusedLayer

    _, target = family_pair("qwen3")
    init = FusedLayer.__init__

    def without_norms(self, layer, family):
        init(self, layer, family)
        self.q_norm = None

    monkeypatch.setattr(FusedLayer, "__init__", without_norms)
    runner = RaggedRunner(load_model(str(target)))
    assert runner.lean and not runner.fused


@pytest.mark.parametrize("fused", [True, False])
def test_services_follow_the_fused_projections_setting(family_pair, fused):
    _, target = family_pair("llama")
    svc = Verifier(ModelServiceConfig(model=str(target), fused_projections=fused))
    assert svc.runner.fused == fused


def _passes(runner: RaggedRunner, n: int = 70) -> torch.Tensor:
    """Two sessions past the first rope table (``RopeTable.FIRST`` set to 16): one long,
    rolled back and extended beside a second one's prefill (a gather of the table's
    rows), then one-session passes (a slice of it); their logits."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, runner.vocab_size, (n,), generator=g).tolist()
    a, b = SessionKV(), SessionKV()
    first = runner.forward([Feed(a, tokens[:10], 2)])[0]
    grown = runner.forward([Feed(a, tokens[10:40], 3)])[0]  # past the first table
    a.truncate(36)
    both = runner.forward([Feed(a, tokens[36:], 5), Feed(b, tokens[:20], 2)])
    (step,) = runner.forward([Feed(a, tokens[:1], 1)])
    (verify,) = runner.forward([Feed(b, tokens[20:25], 5)])
    return torch.cat([first, grown, *both, step, verify])


@pytest.mark.parametrize("kind", sorted(LEAN_FAMILIES & set(FAMILIES)))
def test_lean_passes_take_the_rotary_embedding_from_a_checked_table(family_pair, kind, monkeypatch):
    """Lean passes look cos and sin up in a table the rotary module made (a slice for one
    session, a gather for several), grown as sessions outrun it; bit for bit the
    same logits as calling the module on every pass, fused or not."""
    monkeypatch.setattr(RopeTable, "FIRST", 16)
    _, target = family_pair(kind)
    runner = RaggedRunner(load_model(str(target)))
    assert runner.lean and runner._rope is not None  # (grown past 16 by the self-test)
    for fused in (True, False) if runner.fused else (False,):
        runner.fused, runner._rope = fused, RopeTable.of(runner.model)
        table = _passes(runner)
        assert runner._rope is not None and runner._rope.length >= 70 - 5  # it grew
        runner._rope = None  # the module on every pass
        assert torch.equal(table, _passes(runner)), (kind, fused)


def test_a_table_made_at_the_wrong_positions_is_not_used(family_pair, monkeypatch, caplog):
    """The planted bug: the table built one position off. Its check against the module
    finds it, and passes call the module (still lean, still fused)."""
    _, target = family_pair("llama")
    init = RopeTable.__init__

    def shifted(self, rotary, like, length):
        init(self, rotary, like, length + 1)
        self.cos, self.sin, self.length = self.cos[:, 1:], self.sin[:, 1:], length

    monkeypatch.setattr(RopeTable, "__init__", shifted)
    with caplog.at_level("INFO"):
        runner = RaggedRunner(load_model(str(target)))
    assert runner._rope is None and runner.lean and runner.fused
    assert "rotary table off" in caplog.text


def test_a_lookup_one_position_off_is_caught_at_start_up(family_pair, monkeypatch):
    """The planted bug: a right table read one row off. The start-up check (lean passes
    bit for bit against the wrapped forward) turns the direct calls off."""
    _, target = family_pair("llama")
    lookup = RopeTable.lookup

    def off(self, pos, span):
        return lookup(self, pos + 1, None if span is None else (span[0] + 1, span[1] + 1))

    monkeypatch.setattr(RopeTable, "lookup", off)
    runner = RaggedRunner(load_model(str(target)))
    assert not runner.lean


def test_a_rotary_embedding_that_rescales_with_length_gets_no_table():
    """transformers' dynamic kinds (and longrope) change their frequencies with the
    sequence's length: no table; lean passes call the module."""
    from transformers import AutoModelForCausalLM

    config = family_config("llama", 1, 32, None)
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = AutoModelForCausalLM.from_config(config).eval()
    assert RopeTable.of(model) is None
    runner = RaggedRunner(model)
    assert runner.lean and runner._rope is None
