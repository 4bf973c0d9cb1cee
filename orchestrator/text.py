"""Turning generated token ids into streamed text, honouring stop strings.

Text and token ids move in lockstep: every chunk's text is exactly the text of
its token ids, so a client that counts tokens and a client that reads text see
the same output. Tokens are held back (with their text) while their text is
an incomplete UTF-8 character or could still become the start of a stop
string; when a stop string appears, the output ends with the last token that
lies wholly before it, and nothing of the stop string is streamed or counted.

Detokenization is incremental, O(1) per token: the tokenizers library's own
``DecodeStream`` (Rust) for fast tokenizers, primed with the end of the prompt
so that the first token's leading space is right; a small re-decoding window
for any other tokenizer. Not for: deciding tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Prompt tokens the decoder is primed with (enough context for spacing rules).
_PRIME = 4


@dataclass
class Emission:
    text: str
    token_ids: list[int]
    stopped: bool = False


class _WindowDecoder:
    """Fallback for tokenizers without a Rust backend: decode a short window."""

    def __init__(self, tokenizer, prompt: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt[-_PRIME:])
        self.done = len(self.ids)  # ids[:done] have produced their text

    def step(self, token: int) -> str | None:
        self.ids.append(token)
        start = max(0, self.done - _PRIME)
        before = self.tokenizer.decode(self.ids[start : self.done], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[start:], skip_special_tokens=True)
        if after.endswith("\ufffd"):
            return None
        self.done = len(self.ids)
        return after[len(before) :]


def _decoder(tokenizer, prompt: Sequence[int]):
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        return _WindowDecoder(tokenizer, prompt)
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(ids=list(prompt[-_PRIME:]), skip_special_tokens=True)
    return _RustDecoder(stream, backend)


class _RustDecoder:
    def __init__(self, stream, backend) -> None:
        self.stream, self.backend = stream, backend

    def step(self, token: int) -> str | None:
        return self.stream.step(self.backend, token)


class TextStream:
    def __init__(self, tokenizer, stops: list[str], prompt: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []  # every token id sent so far
        self._decoder = _decoder(tokenizer, prompt)
        self._held: list[tuple[list[int], str]] = []  # (token ids, their text), not sent yet
        self._incomplete: list[int] = []  # tokens whose text is not complete yet

    def push(self, new_ids: Sequence[int], final: bool = False) -> Emission:
        """Add tokens; returns what may be sent now. ``final`` flushes held text."""
        for token in new_ids:
            self._incomplete.append(token)
            piece = self._decoder.step(token)
            if piece is not None:
                self._held.append((self._incomplete, piece))
                self._incomplete = []
        if final and self._incomplete:
            text = self.tokenizer.decode(self._incomplete, skip_special_tokens=True)
            self._held.append((self._incomplete, text))
            self._incomplete = []
        held = "".join(text for _, text in self._held)
        cut = self._first_stop(held)
        if cut is not None:
            out = self._release(cut, stopped=True)
            self._held, self._incomplete = [], []
            return out
        return self._release(len(held) if final else self._safe_end(held))

    def _release(self, end: int, stopped: bool = False) -> Emission:
        """Send the held groups whose text ends at or before char ``end``."""
        ids: list[int] = []
        texts: list[str] = []
        pos = sent = 0
        for group, text in self._held:
            if pos + len(text) > end:
                break
            pos += len(text)
            ids += group
            texts.append(text)
            sent += 1
        self._held = self._held[sent:]
        self.ids += ids
        return Emission("".join(texts), ids, stopped)

    def _first_stop(self, held: str) -> int | None:
        hits = [i for s in self.stops if (i := held.find(s)) >= 0]
        return min(hits) if hits else None

    def _safe_end(self, held: str) -> int:
        """Where held text may be cut now: before any suffix that could start a stop string."""
        end = len(held)
        for s in self.stops:
            for n in range(min(len(s) - 1, len(held)), 0, -1):
                if held.endswith(s[:n]):
                    end = min(end, len(held) - n)
                    break
        return end
