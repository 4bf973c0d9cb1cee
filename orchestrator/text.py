"""Turning generated token ids into streamed text, honouring stop strings.

Text that could still become a stop string, or an incomplete UTF-8 sequence,
is held back until it is safe to send. Not for: deciding tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Emission:
    text: str
    token_ids: list[int]
    stopped: bool = False


class TextStream:
    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.sent_chars = 0
        self.sent_ids = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int], final: bool = False) -> Emission:
        """Add tokens; returns what may be sent now. ``final`` flushes held text."""
        self.ids.extend(new_ids)
        text = self._decode(self.ids)
        cut = self._first_stop(text)
        if cut is not None:
            # Only tokens wholly before the stop string are part of the output.
            keep = self._tokens_before(cut)
            self.ids = self.ids[:keep]
            out = Emission(text[self.sent_chars : cut], self.ids[self.sent_ids :], stopped=True)
            self.sent_chars, self.sent_ids = cut, len(self.ids)
            return out
        end = len(text) if final else self._safe_end(text)
        out = Emission(text[self.sent_chars : end], self.ids[self.sent_ids :])
        self.sent_chars, self.sent_ids = max(self.sent_chars, end), len(self.ids)
        return out

    def _first_stop(self, text: str) -> int | None:
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, self.sent_chars - longest)
        hits = [i for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _safe_end(self, text: str) -> int:
        end = len(text)
        while end > self.sent_chars and text[end - 1] == "\ufffd":
            end -= 1  # an incomplete multi-byte character
        for s in self.stops:
            for n in range(min(len(s) - 1, end - self.sent_chars), 0, -1):
                if text[end - n : end] == s[:n]:
                    end -= n
                    break
        return end

    def _tokens_before(self, cut: int) -> int:
        for m in range(len(self.ids) + 1):
            if len(self._decode(self.ids[:m])) > cut:
                return m - 1
        return len(self.ids)
