"""A lone session's one-token pass through a small Llama-family draft, in one
compiled call (numba), on the CPU.

A draft pass of the demo pair (one decoder layer, 160 wide) is about 40 torch
operator calls around some 1 M multiply-adds: its 0.6-0.9 ms in the draft
service are the calls, not the arithmetic (``docs/benchmarks.md``, "The step,
segment by segment"). Here the whole pass (the embedding row, each layer's
norm, q/k/v product, rotary embedding, cache write, attention over the cache,
o product, norm and gated MLP, then the final norm and the output layer) is one
loop nest, called once per drafted token.

Only the draft may run it. Its values round differently from the model's own
forward (another order of the same sums), and nothing in the draft needs them
to be bit-equal: a proposal is exact by construction whatever its q, since the
draft samples from exactly the q it sends and the target judges it. A target's
logits must be its own forward's (greedy output equal to ``generate()``), so
the target never runs this.

``DecodeKernel.of`` builds it for a runner whose layers are fused
(``ragged.FusedLayer``: Llama, Mistral and Qwen2, without per-head q/k norms),
with float32 weights on the CPU, SiLU's gate, no sliding window and a rotary
table (``ragged.RopeTable``); then a start-up check runs a prompt and a few
decode steps both ways, with a rollback between them, and keeps the kernel only
if every logit agrees with the runner's own within ``TOLERANCE`` of their
spread, and the cache holds the same keys and values. Anything else: None, and
passes stay the runner's.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from numba import njit

from .ragged import Feed, RaggedRunner, SessionKV, disagreement

log = logging.getLogger(__name__)

# The start-up check: the largest disagreement with the runner's logits it accepts,
# relative to their spread. The same sums in another order differ by about 1e-6 of
# it in float32; a wrong position, scale or head is off by the order of the spread.
TOLERANCE = 1e-3
# LLVM's fast-math flags that let the sums be reordered (vectorized) and the
# products fused; not "nnan" or "ninf": the attention's running maximum starts at
# -inf, and a NaN in a pass must stay a NaN for the draft's finite check.
FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}


@njit(cache=True, nogil=True, fastmath=FAST)
def _linear(w: np.ndarray, b: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out [o] = w [o, i] @ x [i] (+ b [o], where b is not empty)."""
    rows, cols = w.shape
    for r in range(rows):
        acc = np.float32(0.0)
        for c in range(cols):
            acc += w[r, c] * x[c]
        out[r] = acc
    if b.shape[0]:
        for r in range(rows):
            out[r] += b[r]


@njit(cache=True, nogil=True, fastmath=FAST)
def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out = w * x / sqrt(mean(x^2) + eps), as the families' RMSNorm (float32)."""
    n = x.shape[0]
    s = np.float32(0.0)
    for i in range(n):
        s += x[i] * x[i]
    r = np.float32(1.0) / np.sqrt(s / np.float32(n) + np.float32(eps))
    for i in range(n):
        out[i] = w[i] * (x[i] * r)


@njit(cache=True, nogil=True, fastmath=FAST)
def decode(
    token: int,
    past: int,
    embed: np.ndarray,
    ln1: tuple,
    qkv: tuple,
    qkv_b: tuple,
    o_w: tuple,
    o_b: tuple,
    ln2: tuple,
    gate_up: tuple,
    gate_up_b: tuple,
    down: tuple,
    down_b: tuple,
    final_norm: np.ndarray,
    eps: float,
    head: np.ndarray,
    keys: tuple,
    values: tuple,
    cos: np.ndarray,
    sin: np.ndarray,
    heads: int,
    kv_heads: int,
    head_dim: int,
    scaling: float,
    hidden_out: np.ndarray,
    logits_out: np.ndarray,
) -> None:
    """One token at position ``past`` through every layer. Per layer (tuples, one
    entry each): norm weights [d], the fused q/k/v weight [(heads + 2 kv_heads)
    head_dim, d] and bias (empty: none), o [d, heads head_dim], the fused gate/up
    [2 inter, d], down [d, inter]; keys and values [kv_heads, capacity, head_dim],
    written at ``past``. cos, sin: the rotary table's row [head_dim]. Writes the
    final norm's output [d] into ``hidden_out``, and the output layer's [vocab]
    into ``logits_out`` unless it is empty."""
    d = embed.shape[1]
    h = embed[token].copy()  # [d]
    x = np.empty(d, np.float32)
    half = head_dim // 2
    rep = heads // kv_heads
    n = past + 1
    scores = np.empty(n, np.float32)
    attn = np.empty(heads * head_dim, np.float32)
    proj = np.empty(d, np.float32)
    for layer in range(len(qkv)):
        w = qkv[layer]
        _rms_norm(h, ln1[layer], eps, x)
        q = np.empty(w.shape[0], np.float32)  # q's heads, then k's, then v's
        _linear(w, qkv_b[layer], x, q)
        for j in range(heads + kv_heads):  # rotary: x cos + rotate_half(x) sin
            at = j * head_dim
            for i in range(half):
                a, b = q[at + i], q[at + half + i]
                q[at + i] = a * cos[i] - b * sin[i]
                q[at + half + i] = b * cos[half + i] + a * sin[half + i]
        k_cache, v_cache = keys[layer], values[layer]
        for g in range(kv_heads):
            k_at, v_at = (heads + g) * head_dim, (heads + kv_heads + g) * head_dim
            for i in range(head_dim):
                k_cache[g, past, i] = q[k_at + i]
                v_cache[g, past, i] = q[v_at + i]
        for j in range(heads):
            g, at = j // rep, j * head_dim
            top = -np.inf
            for t in range(n):
                s = np.float32(0.0)
                for i in range(head_dim):
                    s += q[at + i] * k_cache[g, t, i]
                s *= np.float32(scaling)
                scores[t] = s
                top = max(top, s)
            total = np.float32(0.0)
            for t in range(n):
                e = np.exp(scores[t] - top)
                scores[t] = e
                total += e
            for i in range(head_dim):
                attn[at + i] = 0.0
            for t in range(n):
                p = scores[t] / total
                for i in range(head_dim):
                    attn[at + i] += p * v_cache[g, t, i]
        _linear(o_w[layer], o_b[layer], attn, proj)
        for i in range(d):
            h[i] += proj[i]
        _rms_norm(h, ln2[layer], eps, x)
        gu = gate_up[layer]
        inter = gu.shape[0] // 2
        both = np.empty(2 * inter, np.float32)
        _linear(gu, gate_up_b[layer], x, both)
        for i in range(inter):  # silu(gate) * up
            g_ = both[i]
            both[i] = g_ / (np.float32(1.0) + np.exp(-g_)) * both[inter + i]
        _linear(down[layer], down_b[layer], both[:inter], proj)
        for i in range(d):
            h[i] += proj[i]
    _rms_norm(h, final_norm, eps, hidden_out)
    if logits_out.shape[0]:
        _linear(head, np.empty(0, np.float32), hidden_out, logits_out)


def _array(t: torch.Tensor | None) -> np.ndarray:
    """A float32 C-contiguous numpy view of ``t`` (empty for None: no bias)."""
    if t is None:
        return np.empty(0, np.float32)
    return t.detach().contiguous().numpy()


class DecodeKernel:
    """``decode`` bound to one runner's model (the module's docstring)."""

    def __init__(self, runner: RaggedRunner) -> None:
        self.runner = runner
        model, layers = runner.model, runner._fused_layers
        first = layers[0]
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.scaling = float(first.scaling)
        self.eps = float(first.input_norm.variance_epsilon)
        self.embed = _array(model.model.embed_tokens.weight)
        self.final_norm = _array(model.model.norm.weight)
        self.head = _array(model.lm_head.weight)
        self.layers = (
            tuple(_array(f.input_norm.weight) for f in layers),
            tuple(_array(f.qkv) for f in layers),
            tuple(_array(f.qkv_bias) for f in layers),
            tuple(_array(f.o_proj) for f in layers),
            tuple(_array(f.o_bias) for f in layers),
            tuple(_array(f.post_norm.weight) for f in layers),
            tuple(_array(f.gate_up) for f in layers),
            tuple(_array(f.gate_up_bias) for f in layers),
            tuple(_array(f.down) for f in layers),
            tuple(_array(f.down_bias) for f in layers),
        )
        self.num_layers = len(layers)
        self.vocab = self.head.shape[0]
        # (what SessionKV._buffers reads from a layer's new keys: heads, dim, dtype)
        self._like = torch.empty(1, self.kv_heads, 1, self.head_dim)

    @classmethod
    def of(cls, runner: RaggedRunner) -> DecodeKernel | None:
        """The kernel for ``runner``'s model, or None where it does not apply or its
        start-up check fails (logged)."""
        why = cls._unsupported(runner)
        if not why:
            try:
                kernel = cls(runner)
                why = kernel._check()
            except Exception as e:  # (a layout this kernel does not know: passes as before)
                why = f"{type(e).__name__}: {e}"
        if why:
            log.info("draft decode kernel off for %s (%s)", runner.model_type, why)
            return None
        log.info("draft decode kernel on for %s", runner.model_type)
        return kernel

    @staticmethod
    def _unsupported(runner: RaggedRunner) -> str:
        """Why the kernel cannot run this runner's model ("" if it can)."""
        layers = runner._fused_layers
        if not runner.lean or not runner.fused or not layers:
            return "its layers are not fused (lean_forward, fused_projections)"
        if runner._rope is None:
            return "no rotary table"
        if runner.device.type != "cpu":
            return f"device {runner.device.type}"
        params = list(runner.model.parameters())
        if any(p.dtype != torch.float32 for p in params):
            return "not float32"
        for f in layers:
            if f.q_norm is not None or f.window is not None:
                return "per-head q/k norms or a sliding window"
            if type(f.act).__name__ not in _SILU:
                return f"activation {type(f.act).__name__}"
            if f.heads % f.kv_heads or f.head_dim % 2:
                return "heads not a multiple of kv_heads, or an odd head_dim"
            norms = (f.input_norm, f.post_norm)
            if any(type(m).__name__ not in _RMS_NORMS for m in norms):
                return "norms other than the families' RMSNorm"
        norm = runner.model.model.norm
        if type(norm).__name__ not in _RMS_NORMS:
            return "final norm other than the families' RMSNorm"
        eps = {float(f.input_norm.variance_epsilon) for f in layers}
        eps |= {float(f.post_norm.variance_epsilon) for f in layers}
        if eps != {float(norm.variance_epsilon)}:
            return "norms with different eps"
        if getattr(runner.model.lm_head, "bias", None) is not None:
            return "an output layer with a bias"
        if getattr(runner.model.config, "final_logit_softcapping", None):
            return "soft-capped logits"
        return ""

    def __call__(self, feed: Feed) -> torch.Tensor:
        """The runner's forward of one feed of one token wanting its logits:
        [1, vocab], or [0, vocab] where the feed wants only the hidden state
        (appended to ``feed.hidden_out`` as [1, d])."""
        kv, past = feed.kv, feed.kv.length
        runner = self.runner
        rope = runner.rope_table(past + 1)
        if rope is None:  # (a regrown table disagreed: the runner's passes now)
            runner._decode = None
            return runner.forward([feed])
        for layer in range(self.num_layers):
            kv._buffers(layer, self._like, past + 1)
        hidden = np.empty(self.embed.shape[1], np.float32)
        logits = np.empty(self.vocab if feed.head else 0, np.float32)
        decode(
            feed.tokens[0],
            past,
            self.embed,
            *self.layers,
            self.final_norm,
            self.eps,
            self.head,
            tuple(k.numpy() for k in kv.keys[: self.num_layers]),
            tuple(v.numpy() for v in kv.values[: self.num_layers]),
            rope.cos[0, past].numpy(),
            rope.sin[0, past].numpy(),
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.scaling,
            hidden,
            logits,
        )
        kv.length = past + 1
        if feed.hidden_out is not None:
            feed.hidden_out.append(torch.from_numpy(hidden)[None])
        if not feed.head:
            return torch.empty(0, self.vocab)
        return torch.from_numpy(logits)[None]

    def _check(self) -> str:
        """The start-up check (the module's docstring): "" if it passes, else why not."""
        n = 20
        vocab = self.runner.vocab_size
        tokens = [(7919 * i + 11) % vocab for i in range(n)]
        ours, theirs = SessionKV(), SessionKV()
        got, want = [], []
        with torch.inference_mode():
            for kv in (ours, theirs):
                self.runner.forward([Feed(kv, tokens[:8], 0)])
                self.runner.forward([Feed(kv, tokens[8:11], 1)])  # a draft, then rejected
                kv.truncate(8)
            for t in tokens[8:]:
                got.append(self(Feed(ours, [t], 1)))
                (w,) = self.runner.forward([Feed(theirs, [t], 1)])
                want.append(w)
        err = disagreement(torch.cat(got).double(), torch.cat(want).double())
        if not err <= TOLERANCE:
            return f"its logits differ from the runner's by {err:.3g} of their spread"
        for a, b in zip(ours.keys + ours.values, theirs.keys + theirs.values, strict=True):
            a, b = a[:, :n].double(), b[:, :n].double()
            scale = float(b.abs().max()) or 1.0
            if not math.isfinite(scale) or float((a - b).abs().max()) / scale > TOLERANCE:
                return "its cache differs from the runner's"
        return ""


# SiLU as torch and transformers (``ACT2FN["silu"]``) name it.
_SILU = frozenset({"SiLU", "SiLUActivation"})
# transformers' RMSNorm classes of the fused families (weight * x / rms, in float32).
_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})
