"""The hidden-state wire (``specdec.hidden_q``): q sent as the draft's last hidden
state, derived into the same q bit for bit on both sides.

* Unit: the draft's q (``hidden_position``) and the target's (``unpack_q`` with the
  head) are equal in every id and count; each is a distribution honouring top-k and
  top-p; the weight table uses no exp; a position costs head dimension + 5 bytes;
  malformed codes are refused naming the field; the tally-based derivation equals a
  plain per-token reference (sort, cumulative sums) under ties, top-k and top-p.
* The runner: a feed that wants only hidden states skips the output layer.
* In process: greedy output is the target's own; sampled requests use the wire.
* Through the gRPC services: sampled output has the target's distribution, and a
  target that derives q differently from the draft (planted) fails the same test.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.hidden_q import (
    _GRID,
    _TABLE,
    BITS,
    QuantHead,
    derive_q,
    encode_hidden,
    hidden_position,
)
from specdec.runtime.loading import load_model
from specdec.runtime.ragged import Feed, RaggedRunner, SessionKV
from specdec.sampling import SamplingParams, acceptance_rate, probs_from_logits
from specdec.wire import pack_q, unpack_q

from .inprocess import in_process
from .stack import local_stack, planted_env
from .stats import tv, tv_threshold
from .test_statistical import PROMPT, N, sample

VOCAB, DIM = 300, 24
PARAMS = [
    SamplingParams(1.0),
    SamplingParams(0.6),
    SamplingParams(1.3, top_k=7),
    SamplingParams(0.9, top_p=0.8),
    SamplingParams(1.0, top_k=40, top_p=0.5),
]


def _head(seed: int = 0) -> QuantHead:
    g = torch.Generator().manual_seed(seed)
    return QuantHead.from_weight(torch.randn(VOCAB, DIM, generator=g) * 0.3)


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_both_sides_derive_the_same_q_bit_for_bit(params):
    head, rng = _head(), np.random.default_rng(5)
    hs = torch.randn(6, DIM, generator=torch.Generator().manual_seed(1)) * 4
    drafted = [hidden_position(head, h, params, rng) for h in hs]
    sent = pack_q([q for _, q in drafted])
    got = unpack_q(sent, VOCAB, [x for x, _ in drafted], head=head, params=params)
    for (_, want), have in zip(drafted, got, strict=True):
        assert np.array_equal(want.ids, have.ids) and np.array_equal(want.counts, have.counts)
        assert have.tail == 0 and have.bits == BITS and int(have.counts.sum()) == 1 << BITS
    if params.top_k:
        assert all(len(q.ids) <= params.top_k for q in got)


def test_derived_q_follows_the_logits_closely_and_honours_top_p():
    head = _head()
    h = torch.randn(DIM, generator=torch.Generator().manual_seed(2)) * 4
    code, scale = encode_hidden(h)
    codes = head.matrix.T.double().numpy()  # [vocab, d]
    logits = torch.from_numpy(codes @ (code * scale) * head.scales)
    q = derive_q(head, code[None], np.array([scale]), SamplingParams(1.0))[0].dense()
    want = torch.softmax(logits, -1)
    assert float((q - want).abs().sum()) < 0.05  # the 1/16-nat grid moves each weight <= 3%
    nucleus = derive_q(head, code[None], np.array([scale]), SamplingParams(1.0, top_p=0.5))[0]
    kept = np.sort(want.numpy())[::-1].cumsum()
    assert (
        len(nucleus.ids) == int(np.searchsorted(kept, 0.5 - 0.03)) + 1
        or abs(len(nucleus.ids) - (int(np.searchsorted(kept, 0.5)) + 1)) <= 1
    )


def _reference_q(head: QuantHead, code: np.ndarray, scale: float, params: SamplingParams):
    """The derivation written per token, the obvious way: (ids, counts)."""
    z = (code.astype(np.float64) @ head.matrix.double().numpy()) * head.scales * scale
    t = float(np.float32(params.temperature))
    z = z / t if t != 1.0 else z
    steps = np.minimum(np.rint((z.max() - z) * _GRID), len(_TABLE) - 1).astype(np.int64)
    w = _TABLE[steps]  # [vocab] int64
    vocab = w.shape[0]
    if 0 < params.top_k < vocab or params.top_p < 1.0:
        order = np.lexsort((np.arange(vocab), -w))  # most likely first, ties by id
        keep = params.top_k if 0 < params.top_k < vocab else vocab
        if params.top_p < 1.0:
            mass = np.cumsum(w[order[:keep]])
            reach = np.flatnonzero(mass.astype(np.float64) >= float(mass[-1]) * params.top_p)
            keep = min(keep, int(reach[0]) + 1)
        cut = np.zeros(vocab, dtype=np.int64)
        cut[order[:keep]] = w[order[:keep]]
        w = cut
    counts = np.floor(w.astype(np.float64) * (float(1 << BITS) / float(w.sum()))).astype(np.int64)
    counts[int(np.argmax(w))] += (1 << BITS) - int(counts.sum())
    return np.flatnonzero(counts), counts[counts > 0]


@pytest.mark.parametrize(
    "params",
    [
        *PARAMS,
        SamplingParams(0.05, top_k=7),  # most tokens at the table's last step, weight 0
        SamplingParams(0.05, top_p=0.3),
        SamplingParams(1.0, top_p=0.01),
        SamplingParams(1.0, top_p=0.999999),
        SamplingParams(2.0, top_k=VOCAB - 1, top_p=0.97),
        SamplingParams(0.5, top_k=2, top_p=0.6),
        SamplingParams(100.0, top_k=10),  # nearly flat: long runs of tied steps
        SamplingParams(100.0, top_p=0.5),
    ],
    ids=str,
)
def test_the_derivation_equals_a_plain_per_token_reference(params):
    weight = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(4)) * 0.3
    weight[::3] = weight[1]  # a third of the vocabulary tied with token 1
    head, rng = QuantHead.from_weight(weight), np.random.default_rng(9)
    codes = rng.integers(-127, 128, size=(12, DIM)).astype(np.int8)
    codes[0] = 0  # every token tied
    scales = np.array([float(np.float32(s)) for s in rng.uniform(0.001, 0.5, 12)])
    for code, scale, q in zip(codes, scales, derive_q(head, codes, scales, params), strict=True):
        ids, counts = _reference_q(head, code, scale, params)
        assert np.array_equal(q.ids, ids) and np.array_equal(q.counts, counts)


def test_a_feed_that_wants_only_hidden_states_skips_the_output_layer(llama_pair):
    model = load_model(str(llama_pair[0]))
    runner = RaggedRunner(model)
    assert runner.lean
    rows = []
    model.lm_head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[1]))
    kvs = [SessionKV(), SessionKV()]
    runner.forward([Feed(kvs[0], [5, 6, 7], 0), Feed(kvs[1], [8, 9], 0)])
    ahead = [SessionKV(), SessionKV()]
    runner.forward([Feed(ahead[0], [5, 6, 7], 0), Feed(ahead[1], [8, 9], 0)])
    both, only = [], []
    want = runner.forward([Feed(kvs[0], [3], 1, both), Feed(kvs[1], [4], 1)])
    rows.clear()
    got = runner.forward([Feed(ahead[0], [3], 1, only, head=False), Feed(ahead[1], [4], 1)])
    assert rows == [1]  # the output layer ran for the other feed's row only
    assert got[0].shape == (0, model.config.vocab_size) and torch.equal(only[0], both[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    assert kvs[0].length == ahead[0].length == 4


def test_the_head_and_its_q_are_the_same_in_every_build_and_on_every_machine():
    """Golden values, from a weight and codes built without a random generator: a
    draft and a target of different builds or machines agree only if these do. A
    change to the quantization or the derivation must change the fingerprint (and
    this test), or the two sides would derive different q under equal fingerprints."""
    import hashlib

    vocab, d = 20_000, 48  # more rows than a quantization block
    steps = (np.arange(vocab * d, dtype=np.int64) * 7919) % 201 - 100
    head = QuantHead.from_weight(torch.from_numpy((steps / 37.0).reshape(vocab, d)))
    assert head.fingerprint == "74c8aa70896c8c2252cbb5d6d23196e3d2f3b2a1ac0260aad1385c9038c7943c"
    codes = ((np.arange(4 * d) * 31) % 255 - 127).astype(np.int8).reshape(4, d)
    scales = np.array([float(np.float32(x)) for x in (0.01, 0.02, 0.005, 0.03)])
    # The product runs where the model does; a target's CPU head is packed for oneDNN.
    heads = {"cpu": head, "cpu, packed": head.packed()}
    if torch.cuda.is_available():
        heads["cuda"] = head.to("cuda")
    for device, placed in heads.items():
        digest = hashlib.sha256()
        for params in (SamplingParams(1.0), SamplingParams(0.7, top_k=50, top_p=0.9)):
            for q in derive_q(placed, codes, scales, params):
                digest.update(q.ids.astype("<i8").tobytes() + q.counts.astype("<i8").tobytes())
        want = "ec25f866f437e0bb9cff35d5be1eb457526add732db57ac9469e62255fe2876d"
        assert digest.hexdigest() == want, device


def test_the_weight_table_is_built_without_exp():
    assert _TABLE[0] == 1 << 40 and _TABLE[-1] == 0 and (np.diff(_TABLE) <= 0).all()
    for j in (1, 16, 80, 160):
        assert _TABLE[j] / 2**40 == pytest.approx(math.exp(-j / 16), rel=1e-6)


def test_a_position_costs_the_head_dimension_plus_a_few_bytes():
    head, rng = _head(), np.random.default_rng(0)
    hs = torch.randn(4, DIM, generator=torch.Generator().manual_seed(3))
    qs = [hidden_position(head, h, SamplingParams(1.0), rng)[1] for h in hs]
    assert len(pack_q(qs).SerializeToString()) <= 4 * (DIM + 5) + 8


def _sent(gamma: int = 2):
    head, rng = _head(), np.random.default_rng(1)
    hs = torch.randn(gamma, DIM, generator=torch.Generator().manual_seed(4))
    drafted = [hidden_position(head, h, SamplingParams(1.0), rng) for h in hs]
    return head, pack_q([q for _, q in drafted]), [x for x, _ in drafted]


@pytest.mark.parametrize(
    "spoil, field",
    [
        (lambda pb, head: pb.hidden_scales.pop(), "draft_q.hidden_scales"),
        (lambda pb, head: pb.hidden_scales.__setitem__(0, -1.0), "draft_q.hidden_scales[0]"),
        (lambda pb, head: setattr(pb, "hidden_codes", pb.hidden_codes[1:]), "draft_q.hidden_codes"),
        (lambda pb, head: setattr(pb, "hidden_codes", b"\x80" * len(pb.hidden_codes)),
         "draft_q.hidden_codes"),
    ],
    ids=["scales", "negative scale", "codes", "code -128"],
)  # fmt: skip
def test_malformed_codes_are_refused_naming_the_field(spoil, field):
    head, pb, drafts = _sent()
    spoil(pb, head)
    with pytest.raises(InvalidArgument) as e:
        unpack_q(pb, VOCAB, drafts, head=head, params=SamplingParams(1.0))
    assert e.value.field == field


def test_a_target_without_the_head_refuses_codes_and_says_what_to_set():
    _, pb, drafts = _sent()
    with pytest.raises(InvalidArgument, match="draft_head"):
        unpack_q(pb, VOCAB, drafts, head=None, params=SamplingParams(1.0))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        unpack_q(pb, VOCAB, drafts, head=_head_of(VOCAB + 1), params=SamplingParams(1.0))


def _head_of(vocab: int) -> QuantHead:
    return QuantHead.from_weight(torch.randn(vocab, DIM))


def _services(pair):
    draft, _ = pair
    return {"draft": {"hidden_q": True}, "target": {"draft_head": str(draft)}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_in_process_greedy_is_the_targets_own_and_sampling_uses_the_wire(llama_pair, temperature):
    draft, target = llama_pair
    fields = dict(prompt=[3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=16, gamma=3, seed=7)

    kinds = []

    async def scenario(**services):
        async with in_process(draft, target, **services) as system:
            assert system.orch.hidden_wire() == bool(services)
            verify = system.verifier.verify

            async def seen(session, cache_len, pending, drafts, qs, *args):
                kinds.extend(type(q).__name__ for q in qs)
                return await verify(session, cache_len, pending, drafts, qs, *args)

            system.verifier.verify = seen
            return await system.generate(temperature=temperature, **fields)

    got, _, stats = asyncio.run(scenario(**_services(llama_pair)))
    hidden, kinds[:] = set(kinds), []
    listed, _, _ = asyncio.run(scenario())
    assert len(got) == 16 and stats.drafted > 0 and stats.fallback_steps == 0
    assert hidden == ({"SparseQ"} if temperature == 0.0 else {"HiddenQ"}) and set(kinds) == {
        "SparseQ"
    }
    if temperature == 0.0:
        ids = torch.tensor([fields["prompt"]])
        want = load_model(str(target)).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16
        )
        assert got == listed == want[0, ids.shape[1] :].tolist()


def _exact(pair, params: SamplingParams):
    """(p1, p2 marginal, P(n)) as in test_statistical, with the q the draft derives
    from its hidden states."""
    draft_dir, target_dir = pair
    target, draft = load_model(str(target_dir)), load_model(str(draft_dir))
    head = QuantHead.of_model(draft)
    vocab = target.config.vocab_size
    seqs = torch.tensor([PROMPT + [x] for x in range(vocab)])  # [V, L+1]
    with torch.no_grad():
        tl = target(seqs).logits.float()  # [V, L+1, V]
        hidden = draft(seqs, output_hidden_states=True).hidden_states[-1]  # [V, L+1, d]
    p1 = probs_from_logits(tl[0, -2], params).double()
    p2 = probs_from_logits(tl[:, -1], params).double()

    def q_of(h):
        code, scale = encode_hidden(h)
        return derive_q(head, code[None], np.array([scale]), params)[0].dense()

    q1 = q_of(hidden[0, -2])
    q2 = torch.stack([q_of(hidden[x, -1]) for x in range(vocab)])
    alpha1 = float(acceptance_rate(p1, q1))
    p_n2 = float((torch.minimum(p1, q1) * acceptance_rate(p2, q2)).sum())
    return p1, p1 @ p2, torch.tensor([1 - alpha1, alpha1 - p_n2, p_n2], dtype=torch.float64)


def _check(stack, pair, params):
    p1, p2, n_dist = _exact(pair, params)
    x1, x2, n = sample(stack, params)
    results = {
        "position 1": (tv(x1, p1), tv_threshold(p1, N)),
        "position 2": (tv(x2, p2), tv_threshold(p2, N)),
        "accepted n": (tv(n, n_dist), tv_threshold(n_dist, N)),
    }
    print({k: f"tv {d:.4f} (threshold {t:.4f})" for k, (d, t) in results.items()})
    return results


def _hidden_stack(tmp_path, pair, env=None):
    draft, target = pair
    return local_stack(
        tmp_path / "stack", draft, target, env=env, draft__hidden_q=True,
        target__draft_head=str(draft),
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "params", [SamplingParams(1.0), SamplingParams(0.8, top_k=12, top_p=0.9)], ids=str
)
def test_sampled_tokens_follow_target_distribution_over_the_hidden_wire(
    tmp_path, llama_pair, params
):
    with _hidden_stack(tmp_path, llama_pair) as stack:
        results = _check(stack, llama_pair, params)
    for name, (dist, threshold) in results.items():
        assert dist < threshold, f"{name}: TV {dist:.4f} >= threshold {threshold:.4f}"


# The target derives q from the codes at twice their scale: a q the draft did not
# sample from (the draft's own derivation is untouched).
MISMATCHED_SITE = """
import specdec.wire as w
_derive = w.derive_q
w.derive_q = lambda head, codes, scales, params: _derive(head, codes, scales * 2, params)
"""


@pytest.mark.slow
def test_a_target_deriving_another_q_fails_the_same_test(tmp_path, llama_pair):
    env = planted_env(tmp_path, MISMATCHED_SITE)
    with _hidden_stack(tmp_path, llama_pair, env) as broken:
        results = _check(broken, llama_pair, SamplingParams(1.0))
    failed = [k for k, (d, t) in results.items() if d >= t]
    assert failed, f"the mismatched derivation passed: {results}"


def test_an_output_layer_that_is_not_a_plain_linear_map_is_refused_naming_the_key(llama_pair):
    from specdec.config import ModelServiceConfig
    from specdec.errors import Unsupported
    from specdec.model_service import ModelService

    draft, _ = llama_pair
    model = load_model(str(draft))
    assert QuantHead.of_model(model) is not None
    model.config.final_logit_softcapping = 30.0  # a soft-capped head (Gemma 2's)
    assert QuantHead.of_model(model) is None
    with pytest.raises(Unsupported, match=r"draft\.hidden_q"):
        ModelService("draft", ModelServiceConfig(model=str(draft), hidden_q=True), model=model)


def test_a_draft_head_that_cannot_be_loaded_is_refused_naming_the_key(tmp_path, llama_pair):
    from specdec.config import ModelServiceConfig
    from specdec.errors import Unsupported
    from specdec.model_service import ModelService

    _, target = llama_pair
    cfg = ModelServiceConfig(model=str(target), draft_head=str(tmp_path / "nowhere"))
    with pytest.raises(Unsupported, match=r"target\.draft_head: cannot load"):
        ModelService("target", cfg, model=load_model(str(target)))


def _saved_variant(tmp_path, llama_pair, gpt2_pair, kind: str) -> str:
    """A draft checkpoint of the given kind, saved as a user would have it."""
    if kind == "untied llama":
        return str(llama_pair[0])
    if kind == "gpt2":
        return str(gpt2_pair[0])
    model = load_model(str(llama_pair[0]))
    out = tmp_path / kind.replace(" ", "-")
    if kind == "tied":
        model.config.tie_word_embeddings = True
        tied = type(model)(model.config)
        tied.load_state_dict(model.state_dict(), strict=False)
        tied.save_pretrained(out)
    elif kind == "sharded":
        model.save_pretrained(out, max_shard_size="40KB")
        assert (out / "model.safetensors.index.json").is_file()
    else:  # "bfloat16"
        model.to(torch.bfloat16).save_pretrained(out)
    return str(out)


def test_a_checkpoint_the_head_cannot_be_read_from_alone_loads_whole(tmp_path, llama_pair):
    from specdec.runtime.loading import load_output_layer

    draft = tmp_path / "draft"
    load_model(str(llama_pair[0])).save_pretrained(draft)
    assert load_output_layer(str(draft)) is not None
    (draft / "config.json").write_text("{not json")  # from_config cannot build it
    assert load_output_layer(str(draft)) is None  # the service then loads the whole model
    assert load_output_layer(str(tmp_path / "nowhere")) is None


@pytest.mark.parametrize("kind", ["untied llama", "gpt2", "tied", "sharded", "bfloat16"])
def test_the_target_reads_the_draft_output_layer_alone(
    tmp_path, monkeypatch, llama_pair, gpt2_pair, kind
):
    """The target's copy of the draft head comes from that one tensor of the draft's
    checkpoint (its layers never loaded), with the fingerprint of the whole model's."""
    from specdec import model_service
    from specdec.config import ModelServiceConfig

    draft = _saved_variant(tmp_path, llama_pair, gpt2_pair, kind)
    want = QuantHead.of_model(load_model(draft)).fingerprint
    _, target = llama_pair
    loaded = []
    monkeypatch.setattr(model_service, "load_model", lambda path, **kw: loaded.append(path))
    cfg = ModelServiceConfig(model=str(target), draft_head=draft)
    service = model_service.ModelService("target", cfg, model=load_model(str(target)))
    assert service.head is not None and service.head.fingerprint == want and loaded == []


def test_at_151936_tokens_the_draws_follow_the_q_the_target_derives():
    """Qwen2.5's vocabulary: the draft's draws from its derived q, through the codec,
    follow the q the target derives (coarsened into ten bands of ids), and a position
    costs the head's width + a few bytes however large the vocabulary."""
    from specdec.rng import generator

    vocab = 151_936
    g = torch.Generator().manual_seed(0)
    head = QuantHead.from_weight(torch.randn(vocab, 32, generator=g) * 0.4)
    h = torch.randn(32, generator=g) * 2
    rng = generator(3)
    sent = hidden_position(head, h, SamplingParams(1.0), rng)
    draws = [sent[1].sample(rng) for _ in range(3000)]  # more draws from the draft's q
    pb = pack_q([sent[1]])
    assert pb.ByteSize() <= 32 + 10
    (back,) = unpack_q(pb, vocab, [sent[0]], head=head, params=SamplingParams(1.0))
    assert np.array_equal(back.ids, sent[1].ids) and np.array_equal(back.counts, sent[1].counts)
    assert all(back.prob(x) > 0 for x in draws)
    bands = torch.from_numpy(np.asarray(draws) * 10 // vocab)
    expected = torch.zeros(10, dtype=torch.float64).index_add_(
        0, torch.from_numpy(back.ids * 10 // vocab), torch.from_numpy(back.counts / back.scale)
    )
    assert tv(bands, expected) < tv_threshold(expected, len(draws))
