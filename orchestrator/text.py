"""Turning generated token ids into streamed text, honouring stop strings.

Text and token ids move in lockstep: every chunk's text is exactly what its
token ids add to the text before them (a word's leading space included, which
some tokenizers drop when they decode a token alone), so a client that counts
tokens and a client that reads text see the same output. Tokens are held back
(with their text) while their text is an incomplete UTF-8 character or could
still become the start of a stop string; when a stop string appears, the
output ends with the last token that lies wholly before it, and nothing of the
stop string is streamed or counted.

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
# Tokens without text yet (an incomplete character: at most 4 byte tokens; skipped
# special tokens) past which their text is taken as it decodes now: a run that
# never completes (mojibake, a stream of skipped tokens) must not be re-decoded from
# its start at every token (O(k^2) on the event loop) nor held back for ever.
_MAX_PENDING = 8


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
        if after.endswith("\ufffd") and len(self.ids) - self.done <= _MAX_PENDING:
            return None
        self.done = len(self.ids)
        return after[len(before) :]


def _decoder(tokenizer, prompt: Sequence[int]):
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        return _WindowDecoder(tokenizer, prompt)
    return _RustDecoder(backend, prompt)


def _complete(decode, ids: list[int]) -> list[int]:
    """``ids`` less the tokens at its end whose text is an incomplete character."""
    while ids and decode(ids).endswith("\ufffd"):
        ids = ids[:-1]
    return ids


class _RustDecoder:
    """The tokenizers library's ``DecodeStream``, kept on its feet:

    * primed with prompt tokens whose text is whole: a prime that ends inside a
      character (a prompt cut mid-emoji, or ending in U+FFFD) made the stream send
      the prime's text again as the first output;
    * started afresh, after the tokens not yet sent, where it refuses a token (a run
      of byte-fallback tokens whose text turns invalid after part of it was sent:
      "Invalid prefix encountered") or holds more than ``_MAX_PENDING``: those
      tokens' text is then what they decode to after the last few tokens sent."""

    def __init__(self, backend, prompt: Sequence[int]) -> None:
        self.backend = backend
        self.recent = list(prompt[-_PRIME:])  # the last tokens whose text was sent
        self.pending: list[int] = []
        self.stream = self._primed(self.recent)

    def _decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def _primed(self, ids: list[int]):
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=_complete(self._decode, ids), skip_special_tokens=True)

    def step(self, token: int) -> str | None:
        self.pending.append(token)
        try:
            piece = self.stream.step(self.backend, token)
        except Exception:  # (the tokenizers library raises a plain Exception here)
            piece = self._afresh()
        else:
            if piece is None and len(self.pending) > _MAX_PENDING:
                piece = self._afresh()
        if piece is not None:
            self.recent = (self.recent + self.pending)[-_PRIME:]
            self.pending = []
        return piece

    def _afresh(self) -> str:
        """The pending tokens' text, and a stream primed after them."""
        context = _complete(self._decode, self.recent)
        before, after = self._decode(context), self._decode(context + self.pending)
        text = after[len(before) :] if after.startswith(before) else self._decode(self.pending)
        self.stream = self._primed((self.recent + self.pending)[-_PRIME:])
        return text


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
