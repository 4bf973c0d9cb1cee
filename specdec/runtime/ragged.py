"""One forward pass over many sessions at once, each with its own KV cache.

A session's keys and values live in ``SessionKV``: per layer one buffer
[kv_heads, capacity, head_dim] and one length. Rolling back is moving that
length (gpt-fast's position counter); nothing is copied, so rollback is exact
for every attention kind, sliding windows included (the window is applied
when attending, never by dropping keys).

``RaggedRunner.forward`` packs the new tokens of every session into one row
([1, N], N = sum of the sessions' new tokens), with each token's own position,
and runs the Hugging Face model once. The model writes its keys and values
through ``RaggedBatch.update`` (our stand-in for its cache object) and
attends through ``ragged_attention``, registered as an attention
implementation: each session's queries attend only to that session's keys,
causally. No padding, no copy of any cache, no mask materialized for a
one-token step.

For the families in ``LEAN_FAMILIES`` (Llama, Mistral, Qwen2, Qwen3, Phi-3) the
runner calls the model's own modules (embedding, rotary table, decoder layers,
final norm, output layer) in the order its model forward does, without that
forward's wrapper: its decorators, keyword handling, mask-function calls
(which return nothing for the ragged attention) and output classes. That
wrapper costs about 0.3 ms a pass, most of a one-layer draft's pass
(``docs/benchmarks.md``, "Calling the decoder layers directly"). It is used
only for transformers' own classes of those families (not remote code), and
only where the start-up check finds its logits equal, bit for bit, to those of
the wrapped forward.

Of those, Llama, Mistral, Qwen2 and Qwen3 layers may also run fused (``FusedLayer``,
``fused``): q, k and v in one product, gate and up in another, q and k rotated as
one tensor, everything else as the layer does it. The layer's weights become
views into the fused ones, so nothing is held twice; the same start-up check,
bit for bit, keeps it or not. Lean passes take the rotary embedding's cos and
sin from a table the model's rotary module made (``RopeTable``), checked bit for
bit against the module's own calls.

Which models it serves is decided at start-up, not mid-request: the runner
checks a packed forward (two sessions, a rollback, a decode step) against the
model's own forward on a few tokens and refuses, naming the model type, a
model it cannot serve (attention sinks, ALiBi, recurrent or linear-attention
layers, bidirectional masks, chunked attention, ...). Tested families and
their caveats: ``docs/models.md``.

Not for: sampling (``specdec.sampling``), scheduling which sessions share a
forward (``specdec.runtime.forward_loop``), or sessions' lifetimes.
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from specdec.errors import FailedPrecondition, Unsupported

log = logging.getLogger(__name__)

ATTENTION = "specdec_ragged"
# Model types whose model forward is exactly: embed_tokens, rotary_emb over the
# positions, each of layers[:num_hidden_layers] (hidden states, position embeddings,
# the cache), norm, then lm_head over the kept positions (transformers 5.24). Their
# passes skip that forward's wrapper (``RaggedRunner.lean``).
LEAN_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3"})
# Of those, the families whose decoder layer is exactly: input norm, q/k/v projections
# (Qwen3: q and k each through its per-head norm, ``FUSED_QK_NORM``), the rotary
# embedding (their module's apply_rotary_pos_emb), the attention with this sliding
# window, o projection, residual; post-attention norm, down(act(gate) * up), residual
# (transformers 5.24). A lean pass may run such a layer fused (``RaggedRunner.fused``):
# q, k, v in one product and gate, up in another.
FUSED_WINDOW: dict[str, Callable[[Any], int | None]] = {
    "llama": lambda attn: None,
    "mistral": lambda attn: getattr(attn.config, "sliding_window", None),
    "qwen2": lambda attn: attn.sliding_window,
    "qwen3": lambda attn: attn.sliding_window,
}
FUSED_QK_NORM = frozenset({"qwen3"})
_MIN_CAPACITY = 64
FUSED_ANY = 1 << 62  # ``RaggedRunner.fused_below``: passes of any size run fused
# Attention arguments a model may pass that we understand; anything else
# unknown (e.g. attention sinks) makes the model unsupported, loudly.
_KNOWN_KWARGS = {
    "position_ids",
    "cache",
    "use_cache",
    "output_attentions",
    "is_causal",
    "output_router_logits",  # mixture-of-experts models pass it down; attention ignores it
}
# The start-up self-test: tokens fed (more than the tests' sliding windows), and the
# largest disagreement with the model's own forward it accepts, relative to the spread
# (standard deviation) of the model's logits. A packed forward rounds differently from
# a plain one by far less than this (on the tests' models: 1e-6 of the spread in
# float32, 0.002 in float16, 0.01-0.02 in bfloat16; deep models and GPU kernels such as
# TF32 accumulate more, hence the margin); a wrong mask, position or scale is off by
# the order of the spread itself.
_SELF_TEST_TOKENS = 24
_SELF_TEST_TOLERANCE = {
    torch.float64: 1e-6,
    torch.float32: 1e-2,
    torch.float16: 0.125,
    torch.bfloat16: 0.25,
}


class SessionKV:
    """One session's cache: keys and values per layer, and how many positions are valid."""

    def __init__(self) -> None:
        self.length = 0
        self.keys: list[torch.Tensor | None] = []  # per layer [kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor | None] = []

    def truncate(self, length: int) -> int:
        """Forget positions from ``length`` on; returns how many were dropped."""
        if not 0 <= length <= self.length:
            raise FailedPrecondition(
                f"cache_len: the session holds {self.length} tokens, cannot roll back to {length}"
            )
        removed, self.length = self.length - length, length
        return removed

    def fork(self, length: int) -> SessionKV:
        """A new cache holding a copy of this one's first ``length`` positions (a
        branch that may diverge from here; this cache is not touched)."""
        if not 0 <= length <= self.length:
            raise FailedPrecondition(
                f"cache_len: the session holds {self.length} tokens, cannot fork at {length}"
            )
        kv = SessionKV()
        cap = length + _MIN_CAPACITY  # room for a branch's few steps
        kv.keys = [None if k is None else _resized(k, length, cap) for k in self.keys]
        kv.values = [None if v is None else _resized(v, length, cap) for v in self.values]
        kv.length = length
        return kv

    def bytes_per_token(self) -> int:
        """Bytes one cached position takes, keys and values of every layer."""
        return sum(
            t.shape[0] * t.shape[2] * t.element_size()
            for t in self.keys + self.values
            if t is not None
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def _buffers(
        self, layer: int, like: torch.Tensor, needed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's buffers with room for ``needed`` positions (grown by doubling)."""
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        k, v = self.keys[layer], self.values[layer]
        if k is None or k.shape[1] < needed:
            cap = max(needed, _MIN_CAPACITY, 2 * (k.shape[1] if k is not None else 0))
            if k is None:
                heads, dim = like.shape[1], like.shape[3]
                k, v = like.new_empty(heads, cap, dim), like.new_empty(heads, cap, dim)
            else:
                k, v = _resized(k, self.length, cap), _resized(v, self.length, cap)
            self.keys[layer], self.values[layer] = k, v
        return k, v


def _resized(t: torch.Tensor, keep: int, cap: int) -> torch.Tensor:
    """A new layer buffer [kv_heads, cap, head_dim] holding ``t``'s first ``keep`` positions."""
    new = t.new_empty(t.shape[0], cap, t.shape[2])
    new[:, :keep] = t[:, :keep]
    return new


@dataclass
class Segment:
    """One session's share of a packed forward."""

    kv: SessionKV
    past: int  # tokens already cached
    new: int  # tokens fed in this forward
    start: int  # offset of its first new token in the packed row


class RaggedBatch:
    """The cache object the model sees during one packed forward."""

    is_compileable = False

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        self._masks: dict[tuple[int, int | None], torch.Tensor | None] = {}

    # -- what Hugging Face models call on a cache --------------------------------------
    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, kwargs=None):
        """Store the new keys/values of every segment; returns handles for the attention."""
        # key_states: [1, kv_heads, N, head_dim]
        for s in self.segments:
            k, v = s.kv._buffers(layer_idx, key_states, s.past + s.new)
            k[:, s.past : s.past + s.new] = key_states[0, :, s.start : s.start + s.new]
            v[:, s.past : s.past + s.new] = value_states[0, :, s.start : s.start + s.new]
        return self, self

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Only used by models to infer positions, which we always pass explicitly.
        return 0

    # -- attention -----------------------------------------------------------------------
    def _mask(self, i: int, lo: int, window: int | None, device) -> torch.Tensor | None:
        """Which of keys lo.. each new query of segment i may see: bool [new, total - lo]."""
        s = self.segments[i]
        if s.new == 1:
            return None  # the last query sees every key from lo on
        key = (i, window)
        if key not in self._masks:
            q_pos = torch.arange(s.past, s.past + s.new, device=device)[:, None]  # [new, 1]
            k_pos = torch.arange(lo, s.past + s.new, device=device)[None, :]  # [1, keys]
            allowed = k_pos <= q_pos
            if window:
                allowed &= k_pos > q_pos - window
            self._masks[key] = allowed
        return self._masks[key]

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        scaling: float | None,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """query: [1, heads, N, head_dim] -> [1, N, heads, head_dim]."""
        heads, n_total, dim = query.shape[1], query.shape[2], query.shape[3]
        one = len(self.segments) == 1  # (its output is the whole output)
        out = None if one else query.new_empty(1, n_total, heads, dim)
        for i, s in enumerate(self.segments):
            total = s.past + s.new
            # The first key any of this segment's queries may see.
            lo = max(0, s.past + 1 - window) if window else 0
            k = s.kv.keys[layer][None, :, lo:total]  # [1, kv_heads, keys, head_dim]
            v = s.kv.values[layer][None, :, lo:total]
            q = query[:, :, s.start : s.start + s.new]  # [1, heads, new, head_dim]
            mask = self._mask(i, lo, window, query.device)
            if softcap is None:
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != heads
                )
            else:
                o = _softcapped_attention(q, k, v, mask, scaling, softcap)
            if one:
                return o.transpose(1, 2).contiguous()
            out[0, s.start : s.start + s.new] = o[0].transpose(0, 1)
        return out


def _softcapped_attention(q, k, v, mask, scaling, softcap) -> torch.Tensor:
    """Eager attention with tanh soft-capping of the scores (Gemma 2)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [1, heads, new, keys]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def ragged_attention(
    module,
    query: torch.Tensor,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """The attention implementation models call while a ``RaggedBatch`` is their cache."""
    if not isinstance(key, RaggedBatch):
        raise Unsupported(
            f"{type(module).__name__}: the specdec_ragged attention needs a RaggedBatch cache"
        )
    unknown = {k for k, v in kwargs.items() if v is not None and k not in _KNOWN_KWARGS}
    if unknown:
        raise Unsupported(
            f"{type(module).__name__}: attention arguments {sorted(unknown)} are not supported"
        )
    out = key.attend(module.layer_idx, query, scaling, sliding_window, softcap)
    return out, None


AttentionInterface.register(ATTENTION, ragged_attention)


@dataclass
class Feed:
    """What one session feeds into a forward: tokens after its cache, and how many
    of the last positions' logits it wants back (0: none, e.g. a prefill)."""

    kv: SessionKV
    tokens: list[int]
    logits: int = 1
    # Where to append the output layer's input at the kept positions, [logits, d]
    # (the last hidden states: ``specdec.hidden_q``); None: not wanted.
    hidden_out: list | None = None
    # False: only the hidden states are wanted, so the runner may skip the output
    # layer for this feed (the lean forward does; its logits are then [0, vocab]).
    # The hidden-state wire derives q from them: a draft with a large vocabulary
    # would otherwise run its output layer twice per drafted token.
    head: bool = True


def disagreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference of ``got`` from ``want`` (logits), relative to the spread
    (standard deviation) of ``want``'s finite values; inf where they are not finite
    at the same places (a model may mask tokens out with -inf)."""
    finite = want.isfinite()
    if not torch.equal(got.isfinite(), finite):
        return math.inf
    if not finite.any():
        return 0.0
    spread = float(want[finite].std()) or 1.0
    return float((got - want)[finite].abs().max()) / spread


class RaggedRunner:
    """A causal LM run over packed rows of many sessions' new tokens."""

    def __init__(
        self, model, self_test: bool = True, lean: bool = True, fused: bool = True
    ) -> None:
        """``lean``: skip the model forward's wrapper where that is safe (the
        module's docstring); only after ``self_test``, which checks it. ``fused``:
        in lean passes, run each decoder layer fused where that is safe
        (``FusedLayer``), also checked by ``self_test``; this makes the model's q/k/v
        and gate/up weights views into the fused ones."""
        self.model = model
        config = model.config
        # The layers a lean pass runs (read once: a config attribute goes through
        # transformers' __getattribute__, some microseconds on every pass).
        self.num_layers = getattr(config, "num_hidden_layers", None)
        # Whether passes call the layers directly (else the model's own forward).
        self.lean = lean and self_test and _lean_family(model)
        # Whether lean passes of fewer than ``fused_below`` tokens run the layers fused
        # (a model service sets it where oneDNN's packed layers take over).
        self._fused_layers = fuse_layers(model) if self.lean and fused else None
        self.fused = self._fused_layers is not None
        # cos and sin by position for lean passes (None: the rotary module each pass)
        self._rope = RopeTable.of(model) if self.lean else None
        self.fused_below = FUSED_ANY
        # A lone session's one-token passes in one compiled call (``use_decode_kernel``;
        # a draft's only): None, every pass as below.
        self._decode = None
        self.model_type = f"{getattr(config, 'model_type', '?')} ({type(model).__name__})"
        # The ragged attention is switched on for our forwards only: the same model
        # object keeps working with generate() and its own caches elsewhere.
        self._default = config._attn_implementation
        try:
            model.set_attn_implementation(ATTENTION)  # validates that the model accepts it
            # Every config object the model's modules read (composite models have
            # several): switching is then one dict store per config per forward.
            configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
            configs[id(config)] = config
            self._switch = [
                (c.__dict__, c.__dict__.get("_attn_implementation_internal"))
                for c in configs.values()
            ]
        except Exception as e:
            raise Unsupported(
                f"model type {self.model_type}: does not accept a custom attention "
                f"implementation ({type(e).__name__}: {e})"
            ) from e
        finally:
            config._attn_implementation = self._default
        self._restore = [(d, d.get("_attn_implementation_internal")) for d, _ in self._switch]
        if getattr(config, "attention_chunk_size", None):
            raise Unsupported(
                f"model type {self.model_type}: chunked attention (attention_chunk_size="
                f"{config.attention_chunk_size}) is not supported"
            )
        self.device = next(model.parameters()).device
        self.vocab_size: int = config.vocab_size
        if self_test:
            self.self_test()

    def use_decode_kernel(self) -> bool:
        """Run a lone session's one-token passes in one compiled call where the model
        allows it and its start-up check agrees (``decode_kernel.DecodeKernel``): for
        a draft, whose values need not be bit-equal to its own forward's. Whether it
        is on."""
        from .decode_kernel import DecodeKernel

        # (its start-up check has compiled it, or loaded it from numba's disk cache)
        self._decode = DecodeKernel.of(self)
        return self._decode is not None

    def rope_table(self, end: int) -> RopeTable | None:
        """The rotary table, grown to hold positions below ``end`` (None: the rotary
        module runs each pass, as it does for good once a regrown table disagreed)."""
        rope = self._rope
        if rope is not None and rope.length < end:
            rope = self._rope = rope.grown(end)
        return rope

    def self_test(self) -> None:
        """Refuse a model whose packed forward differs from its own forward.

        Two sessions share one forward, one of them after a rolled-back draft, then
        a one-token decode step; every logit is compared with the model's own
        forward (its default attention, no cache) over the same tokens. Any
        exception or a disagreement over the tolerance raises ``Unsupported``
        naming the model type, so that a family this runtime cannot serve is
        refused when the service starts, never in the middle of a request.

        Then, for a family whose layers can be called directly (``lean``), the same
        passes are run that way, and that way is kept only if every logit is equal,
        bit for bit, to the wrapped forward's: all that is known of the wrapped
        ragged forward (exact rollback, greedy output equal to ``generate()``) then
        holds for it.
        """
        n = _SELF_TEST_TOKENS
        tokens = [(7919 * i + 11) % self.vocab_size for i in range(n)]
        try:
            with torch.inference_mode():
                ids = torch.tensor([tokens], device=self.device)
                want = self.model(input_ids=ids, use_cache=False).logits[0].double()  # [n, V]
        except Exception as e:
            raise Unsupported(
                f"model type {self.model_type}: its own forward fails on {n} tokens "
                f"({type(e).__name__}: {e})"
            ) from e
        lean, self.lean = self.lean, False
        fused, self.fused = self.fused, False
        try:
            packed = self._self_test_passes(tokens)  # [9, V] through the model's forward
        except Exception as e:
            raise Unsupported(
                f"model type {self.model_type}: its attention cannot run in the ragged "
                f"runtime ({type(e).__name__}: {e})"
            ) from e
        got = packed.double()
        want = torch.cat([want[n - 6 :], want[3:5], want[n - 1 :]])  # [9, V]
        err = disagreement(got, want)
        dtype = next(self.model.parameters()).dtype
        tolerance = _SELF_TEST_TOLERANCE.get(dtype, 0.25)
        if not err <= tolerance:
            raise Unsupported(
                f"model type {self.model_type}: the ragged forward differs from the "
                f"model's own by {err:.3g} of the logits' spread (at most {tolerance:g} "
                f"in {str(dtype).removeprefix('torch.')}); its attention is not supported"
            )
        if lean:
            self.lean = True
            why = self._differs(tokens, packed)
            if why:
                self.lean = False
                log.warning("model type %s: calling the layers directly is off (%s)",
                            self.model_type, why)  # fmt: skip
        if fused and self.lean:  # the same passes with the layers fused
            self.fused = True
            why = self._differs(tokens, packed)
            if why:
                self.fused = False
                log.info("model type %s: fused projections are off (%s)", self.model_type, why)

    def _differs(self, tokens: list[int], want: torch.Tensor) -> str:
        """Why the self-test's passes, run the way now set, are not ``want`` bit for
        bit; "" when they are."""
        try:
            if torch.equal(self._self_test_passes(tokens), want):
                return ""
            return "its logits differ from the model forward's"
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    def _self_test_passes(self, tokens: list[int]) -> torch.Tensor:
        """The self-test's passes on fresh sessions: two sessions in one pass, one of
        them after a rolled-back draft, then a decode step; their logits [9, V]."""
        n = len(tokens)
        a, b = SessionKV(), SessionKV()
        self.forward([Feed(a, tokens[: n - 6], 0)])
        self.forward([Feed(a, tokens[:3], 1)])  # a draft, then rejected
        a.truncate(n - 6)
        got_a, got_b = self.forward([Feed(a, tokens[n - 6 :], 6), Feed(b, tokens[:5], 2)])
        a.truncate(n - 1)
        (got_last,) = self.forward([Feed(a, tokens[n - 1 :], 1)])
        return torch.cat([got_a, got_b, got_last])

    @torch.inference_mode()
    def forward(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """One forward over every feed; returns each feed's logits [feed.logits, vocab].

        Logits stay on the model's device, in float32 (float64 for a float64 model).
        A session's length grows only if the whole forward succeeds.
        """
        if len({id(f.kv) for f in feeds}) != len(feeds):
            raise ValueError("a session may appear only once in a forward")
        if self._decode is not None and len(feeds) == 1:
            (f,) = feeds
            if len(f.tokens) == 1 and f.logits == 1:
                return [self._decode(f)]
        tokens: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        segments = []
        for f in feeds:
            start, past, new = len(tokens), f.kv.length, len(f.tokens)
            if not 0 <= f.logits <= new:  # (its rows would be another feed's)
                raise ValueError(f"a feed of {new} tokens cannot want {f.logits} logits")
            tokens += f.tokens
            positions += range(past, past + new)
            keep += range(start + new - f.logits, start + new)
            segments.append(Segment(f.kv, past, new, start))
        dev = self.device
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)  # [1, N]
        pos = torch.tensor([positions], dtype=torch.long, device=dev)  # [1, N]
        for d, ours in self._switch:
            d["_attn_implementation_internal"] = ours
        kept = torch.tensor(keep, dtype=torch.long, device=dev)
        counts = [f.logits for f in feeds]
        # Rows of ``kept`` whose logits are wanted (None: all of them).
        heads = None
        if self.lean and not all(f.head for f in feeds):
            at = [0, *itertools.accumulate(counts)]
            heads = [r for i, f in enumerate(feeds) if f.head for r in range(at[i], at[i + 1])]
        captured: list[torch.Tensor] = []
        hook = None
        if not self.lean and any(f.hidden_out is not None for f in feeds):
            hook = self.model.get_output_embeddings().register_forward_pre_hook(
                lambda _module, args: captured.append(args[0])
            )
        try:
            if self.lean:
                # (one feed: its positions are one run, a slice of the rope table)
                span = (positions[0], positions[-1] + 1) if len(feeds) == 1 and tokens else None
                end = max((s.past + s.new for s in segments), default=0)  # (positions below)
                logits = self._lean_forward(
                    ids, pos, RaggedBatch(segments), kept, heads, captured, span, end
                )
            else:
                logits = self.model(
                    input_ids=ids,
                    position_ids=pos,
                    cache=RaggedBatch(segments),
                    use_cache=True,
                    logits_to_keep=kept,
                ).logits
        finally:
            for d, theirs in self._restore:
                d["_attn_implementation_internal"] = theirs
            if hook is not None:
                hook.remove()
        logits = logits[0]  # [rows with logits, vocab]
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()  # (a copy: it may run out of memory too)
        hidden = None
        if any(f.hidden_out is not None for f in feeds):  # the output layer's input
            hidden = captured[-1][0].split(counts)  # each [logits, d]
        if heads is not None:
            counts = [f.logits if f.head else 0 for f in feeds]
        out = list(logits.split(counts))
        # Nothing below can fail: only now do the sessions grow.
        for s in segments:
            s.kv.length = s.past + s.new
        if hidden is not None:
            for f, h in zip(feeds, hidden, strict=True):
                if f.hidden_out is not None:
                    f.hidden_out.append(h)
        return out

    def _lean_forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        cache: RaggedBatch,
        kept: torch.Tensor,
        heads: list[int] | None = None,
        captured: list[torch.Tensor] | None = None,
        span: tuple[int, int] | None = None,
        end: int = 0,
    ) -> torch.Tensor:
        """The model forward of ``LEAN_FAMILIES`` without its wrapper: the same
        modules, called in the same order on the same values. ids, pos: [1, N];
        returns logits [1, kept, vocab], or [1, len(heads), vocab] for the rows of
        ``kept`` in ``heads``. The output layer's input [1, kept, d] is appended to
        ``captured``. ``span``: (first, end) where ``pos`` is that one run; ``end``:
        above every position. The modules are looked up on every pass:
        ``packed_linear`` replaces some after start-up."""
        model, base = self.model, self.model.model
        hidden = base.embed_tokens(ids)  # [1, N, hidden]
        rope = self.rope_table(end)
        if rope is not None:
            position_embeddings = rope.lookup(pos, span)
        else:
            position_embeddings = base.rotary_emb(hidden, position_ids=pos)
        if self.fused and ids.shape[1] < self.fused_below:
            for fused in self._fused_layers:
                hidden = fused(hidden, position_embeddings, cache)
        else:
            # (islice: slicing a ModuleList builds a new one, module by module, each pass)
            for layer in itertools.islice(base.layers, self.num_layers):
                hidden = layer(
                    hidden,
                    attention_mask=None,  # the ragged attention builds its own
                    position_embeddings=position_embeddings,
                    position_ids=pos,
                    cache=cache,
                    use_cache=True,
                )
        last = base.norm(hidden)[:, kept]  # [1, kept, hidden]
        if captured is not None:
            captured.append(last)
        if heads is not None:
            last = last[:, heads]  # [1, len(heads), hidden]
        return model.lm_head(last)


def _lean_family(model) -> bool:
    """Whether ``model`` is transformers' own class of a family in ``LEAN_FAMILIES`` (not
    remote code that reuses the name) and has the modules a lean pass calls."""
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "rotary_emb", "layers", "norm")
    if getattr(model.config, "model_type", None) not in LEAN_FAMILIES or base is None:
        return False
    ours = f"transformers.models.{model.config.model_type}."
    if not all(type(m).__module__.startswith(ours) for m in (model, base)):
        return False
    return all(hasattr(base, name) for name in needed) and hasattr(model, "lm_head")


class RopeTable:
    """The rotary embedding's cos and sin for positions 0..length-1, made by the
    model's own rotary module in one call, so that a lean pass takes its rows (a
    slice, or a gather for several sessions) instead of running the module's dozen
    operations: about 25 microseconds a pass on the demo pair's CPU, a twentieth of
    a draft pass.

    Only for rotary modules whose frequencies never change (not transformers'
    "dynamic" or "longrope" kinds, which rescale with the sequence), and only where
    the module gives every row the same values called on that position alone: each
    table (the first and every regrowth) is checked, bit for bit, against one-
    position and several-position calls of the module at spread positions; a
    table that disagrees is dropped for good, and passes call the module as before."""

    FIRST = 256  # positions in the first table; each regrowth at least doubles it
    CHECKS = 32  # one-position calls checked per table

    def __init__(self, rotary: Any, like: torch.Tensor, length: int) -> None:
        self.rotary, self.like = rotary, like  # (the module reads like's dtype and device)
        pos = torch.arange(length, device=like.device)[None]  # [1, length]
        self.cos, self.sin = rotary(like, position_ids=pos)  # each [1, length, head_dim]
        self.length = length

    @classmethod
    def of(cls, model: Any) -> RopeTable | None:
        """The table of a lean family's model, or None where its module must run."""
        rotary = model.model.rotary_emb
        kind = getattr(rotary, "rope_type", None)
        if not isinstance(kind, str) or "dynamic" in kind or kind == "longrope":
            return None
        # (a pass's hidden states have the embedding's dtype, what the module casts to)
        like = model.model.embed_tokens.weight.new_zeros(1, 1, 1)
        return cls._checked(rotary, like, cls.FIRST)

    @classmethod
    def _checked(cls, rotary: Any, like: torch.Tensor, length: int) -> RopeTable | None:
        try:
            with torch.inference_mode():
                table = cls(rotary, like, length)
                if table.agrees():
                    return table
            why = "its rows differ from the module's own"
        except Exception as e:  # (a module that takes no such call: run it each pass)
            why = f"{type(e).__name__}: {e}"
        log.info("rotary table off, the module runs each pass (%s)", why)
        return None

    def agrees(self) -> bool:
        """Whether the module, called on a few positions alone and on a run of seven,
        gives exactly this table's rows."""
        n = self.length
        at = sorted({0, n - 1, *range(0, n, max(1, n // self.CHECKS))})
        runs = [[p] for p in at] + [list(range(max(0, n - 7), n)), list(range(3, min(n, 10)))]
        for run in runs:
            pos = torch.tensor([run], device=self.like.device)
            cos, sin = self.rotary(self.like, position_ids=pos)
            if not (torch.equal(cos, self.cos[:, run]) and torch.equal(sin, self.sin[:, run])):
                return False
        return True

    def grown(self, end: int) -> RopeTable | None:
        """A table holding positions below ``end`` (None where the new one disagrees)."""
        return self._checked(self.rotary, self.like, max(end, 2 * self.length))

    def lookup(
        self, pos: torch.Tensor, span: tuple[int, int] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [1, N, head_dim], for positions ``pos`` [1, N] (``span``:
        where they are the run first..end-1, a view of the table)."""
        if span is not None:
            first, end = span
            return self.cos[:, first:end], self.sin[:, first:end]
        return self.cos[:, pos[0]], self.sin[:, pos[0]]


class FusedLayer:
    """One decoder layer of a ``FUSED_WINDOW`` family, run with q, k and v in one
    product and gate and up in another: the same operations on the same values as
    the layer's own forward (its norms and activation are its own modules), minus
    three products and the modules' calls. On the demo pair a one-token draft pass
    and a 5-token verify of the 8-layer target each take about a tenth less time
    (``docs/benchmarks.md``, "Fused projections"). Where the family has no per-head
    q/k norms, q and k are rotated as one tensor (the same products and sums, element
    by element, in half the operator calls).

    The fused weights hold the layer's own: its q/k/v and gate/up weights become
    views into them (``fuse_layers``), so that the model keeps working as before
    (its own forward, ``generate()``, packing) and no weight is held twice."""

    def __init__(self, layer: Any, family: str) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.act = mlp.act_fn
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, attn.head_dim, attn.scaling
        self.window = FUSED_WINDOW[family](attn)
        # (Qwen3: per-head norms of q and k, before the rotary embedding)
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        # (heads of q, and of k and v: the fused product's columns, head by head)
        self.heads, self.kv_heads = (m.out_features // self.head_dim for m in projections[:2])
        self.qkv, self.qkv_bias = _fuse(projections)
        self.o_proj, self.o_bias = attn.o_proj.weight, attn.o_proj.bias
        self.gate_up, self.gate_up_bias = _fuse((mlp.gate_proj, mlp.up_proj))
        self.inter = mlp.gate_proj.out_features
        self.down, self.down_bias = mlp.down_proj.weight, mlp.down_proj.bias

    def __call__(
        self,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: RaggedBatch,
    ) -> torch.Tensor:
        """hidden: [1, N, d] -> [1, N, d], and the layer's keys and values in ``cache``."""
        n, h, kv = hidden.shape[1], self.heads, self.kv_heads
        # (the norms' own forward: fuse_layers saw no hooks on them)
        x = self.input_norm.forward(hidden)
        qkv = F.linear(x, self.qkv, self.qkv_bias).view(1, n, -1, self.head_dim)
        # [1, N, heads + 2 kv_heads, head_dim]: q's heads, k's, v's
        cos, sin = position_embeddings
        if self.q_norm is None:
            # q and k rotated as one tensor: element by element the same products and sums
            qk = _rotated(qkv[:, :, : h + kv].transpose(1, 2), cos, sin)
            q, k = qk[:, :h], qk[:, h:]  # [1, heads or kv_heads, N, head_dim]
        else:
            q, k = self.q_norm(qkv[:, :, :h]), self.k_norm(qkv[:, :, h : h + kv])
            q, k = self.rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = qkv[:, :, h + kv :].transpose(1, 2)  # [1, kv_heads, N, head_dim]
        cache.update(k, v, self.layer_idx)
        o = cache.attend(self.layer_idx, q, self.scaling, self.window, None)  # [1, N, heads, hd]
        hidden = hidden + F.linear(o.reshape(1, n, -1), self.o_proj, self.o_bias)
        x = self.post_norm.forward(hidden)
        gate, up = F.linear(x, self.gate_up, self.gate_up_bias).split(self.inter, dim=-1)
        return hidden + F.linear(self.act(gate) * up, self.down, self.down_bias)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x [1, heads, N, head_dim] by cos, sin [1, N, head_dim],
    as the fused families' apply_rotary_pos_emb computes it: x cos + rotate_half(x) sin."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _fuse(linears: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for these linear layers, stacked by output row; each
    layer's own weight and bias become views into it."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([m.bias.detach() for m in linears])
    at = 0
    for m in linears:
        rows = slice(at, at + m.out_features)
        m.weight = torch.nn.Parameter(weight[rows], requires_grad=m.weight.requires_grad)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[rows], requires_grad=m.bias.requires_grad)
        at += m.out_features
    return weight, bias


def fuse_layers(model) -> list[FusedLayer] | None:
    """Each decoder layer fused, for a model whose every layer is its family's plain
    layer (``FUSED_WINDOW``; plain ``nn.Linear`` projections, all biased or none, no
    hooks); None for any other."""
    family = getattr(model.config, "model_type", None)
    if family not in FUSED_WINDOW or not _lean_family(model):
        return None
    layers = list(model.model.layers[: model.config.num_hidden_layers])

    def plain(layer) -> bool:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        linears = [getattr(attn, n, None) for n in names]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(type(m) is torch.nn.Linear for m in linears):
            return False
        qkv, gate_up = linears[:3], linears[4:6]  # (each fused: all biased, or none)
        if len({m.bias is None for m in qkv}) != 1 or len({m.bias is None for m in gate_up}) != 1:
            return False
        ours = f"transformers.models.{family}."
        modules = list(layer.modules())
        return (
            type(layer).__module__.startswith(ours)
            and type(attn).__module__.startswith(ours)
            and all(hasattr(attn, n) == (family in FUSED_QK_NORM) for n in ("q_norm", "k_norm"))
            and not any(m._forward_hooks or m._forward_pre_hooks for m in modules)
            and not any(hasattr(m, "_hf_hook") for m in modules)
        )

    if not layers or not all(plain(layer) for layer in layers):
        return None
    return [FusedLayer(layer, family) for layer in layers]
