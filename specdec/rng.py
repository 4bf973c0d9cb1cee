"""Random numbers from a 64-bit seed, the same on every machine and device.

Every draw in specdec comes from a counter-based generator, Philox4x64-10 (numpy's
``Philox``), keyed by all 64 bits of a seed: seeds 5 and 5 + 2^32 give different
streams, and a CPU and a CUDA replica given the same seed draw the same numbers
(the numbers are made on the host; only the sampling arithmetic runs on the
device). Not for: deciding what to draw (``specdec.sampling``).

The stream is computed here in plain Python (``Philox``), number for number what
``np.random.Generator(np.random.Philox(key=seed))`` draws (``tests/test_rng.py``).
A step needs a handful of numbers from a fresh seed, and right after a forward pass
numpy's generator and its five uniforms cost 140-180 us (the pass has evicted the
caches its code lives in) where these cost 30-40, and 70 as ``uniforms``' tensor
(``python -m benchmarks.cold_calls``); warm, the two cost the same.
"""

from __future__ import annotations

import torch

SEED_BITS = 64

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
# Philox4x64's multipliers and key increments (Salmon et al. 2011, Random123).
_M0, _M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
_W0, _W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B
_ROUNDS = 10
_DOUBLE_UNIT = 1.0 / (1 << 53)


def _block(counter: int, k0: int, k1: int) -> tuple[int, int, int, int]:
    """Philox4x64-10 of a 256-bit counter under the key (k0, k1): four 64-bit words."""
    c0, c1 = counter & _MASK64, (counter >> 64) & _MASK64
    c2, c3 = (counter >> 128) & _MASK64, (counter >> 192) & _MASK64
    for _ in range(_ROUNDS):  # (the key bumped after the last round goes unused)
        p0, p1 = _M0 * c0, _M1 * c2  # 128-bit products
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & _MASK64, (p0 >> 64) ^ c3 ^ k1, p0 & _MASK64
        k0, k1 = (k0 + _W0) & _MASK64, (k1 + _W1) & _MASK64
    return c0, c1, c2, c3


class Philox:
    """The Philox stream of one seed, drawn as numpy's ``Generator`` draws it.

    ``random`` and ``integers`` give the numbers that ``Generator.random`` and
    ``Generator.integers`` (default int64) give from the same state, in any
    interleaving: the counter is bumped before each block of four 64-bit words,
    32-bit draws take the low half of a word and keep the high half for the next
    one, and a bounded integer is Lemire's multiply-and-reject."""

    __slots__ = ("_k0", "_k1", "_counter", "_words", "_half")

    def __init__(self, seed: int, jumps: int = 0) -> None:
        """``seed``: 0 <= seed < 2^64 (numpy's ``key``). ``jumps``: as numpy's
        ``jumped(jumps)``, the stream 2^128 words further on per jump."""
        if not 0 <= seed < 1 << SEED_BITS:
            raise ValueError(f"seed must be in [0, 2^{SEED_BITS}), got {seed}")
        self._k0, self._k1 = seed, 0
        self._counter = jumps << 128  # (a jump adds one to the counter's third word)
        self._words: list[int] = []  # the current block's unread words, the next one last
        self._half: int | None = None  # a 64-bit word's unread high half

    @classmethod
    def at(cls, seed: int, position: int) -> Philox:
        """The stream keyed by ``seed`` after ``position`` 64-bit words were drawn
        from it (``tell``)."""
        rng = cls(seed)
        rng._counter = position // 4
        for _ in range(position % 4):
            rng.next64()
        return rng

    def tell(self) -> int:
        """The 64-bit words drawn so far (a stream without jumps whose 32-bit draws,
        if any, left no half unread): ``Philox.at(seed, tell())`` goes on from here."""
        if self._half is not None or self._counter >> 64:
            raise ValueError("tell: a half-read word or a jumped stream")
        return 4 * self._counter - len(self._words)

    def next64(self) -> int:
        """The next 64-bit word."""
        if self._words:
            return self._words.pop()
        self._counter = (self._counter + 1) & ((1 << 256) - 1)
        w0, w1, w2, w3 = _block(self._counter, self._k0, self._k1)
        self._words = [w3, w2, w1]
        return w0

    def next32(self) -> int:
        """The next 32-bit number: the low half of a fresh word, then its high half."""
        if self._half is not None:
            half, self._half = self._half, None
            return half
        word = self.next64()
        self._half = word >> 32
        return word & _MASK32

    def random(self, n: int) -> list[float]:
        """n floats uniform on [0, 1), each the top 53 bits of a word."""
        return [(self.next64() >> 11) * _DOUBLE_UNIT for _ in range(n)]

    def integers(self, low: int, high: int) -> int:
        """One integer uniform on [low, high), low < high <= low + 2^64."""
        span = high - low  # > 0
        if not 0 < span <= 1 << 64:
            raise ValueError(f"need low < high <= low + 2^64, got [{low}, {high})")
        if span == 1:
            return low
        if span == 1 << 64:
            return low + self.next64()
        if span == 1 << 32:
            return low + self.next32()
        bits, draw = (32, self.next32) if span < 1 << 32 else (64, self.next64)
        mask = (1 << bits) - 1
        m = draw() * span
        if m & mask < span:  # a leftover this small may be biased: reject below
            threshold = (mask - (span - 1)) % span  # 2^bits mod span
            while m & mask < threshold:
                m = draw() * span
        return low + (m >> bits)


def generator(seed: int) -> Philox:
    """The stream keyed by ``seed`` (0 <= seed < 2^64)."""
    return Philox(seed)


def side_generator(seed: int) -> Philox:
    """A second stream for ``seed``, independent of ``generator(seed)``'s (the same
    key, jumped 2^128 words ahead)."""
    return Philox(seed, jumps=1)


def uniforms(seed: int, n: int) -> torch.Tensor:
    """n uniforms in [0, 1) for one call: float64 [n]."""
    return torch.tensor(Philox(seed).random(n), dtype=torch.float64)


def seeds(rng: Philox, n: int = 1) -> list[int]:
    """n fresh 64-bit seeds for downstream calls."""
    return [rng.next64() for _ in range(n)]
