"""Incremental detokenization with OpenAI's stop-string semantics.

Text is decoded from all tokens so far (a token may complete a multi-byte character or change how the
previous ones read), and only text that can no longer change is released: not a trailing partial
character, and not a suffix that could still grow into a stop string. When a stop string appears the
text is cut right before it and the stream ends, as OpenAI does (the stop string is not returned).
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.sent = 0  # characters of the decoded text already released
        self.stopped = False  # a stop string was found
        self.tokens_at_stop: int | None = None  # tokens generated up to and including the one that completed it

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def push(self, tokens: Sequence[int]) -> str:
        """Adds tokens; returns the newly released text ("" if none). After a stop, returns ""."""
        if self.stopped:
            return ""
        if not self.stop:
            self.tokens.extend(int(t) for t in tokens)
            return self._advance(final=False)
        text = ""
        for t in tokens:  # token by token: the stop must be found at the token that completes it
            self.tokens.append(int(t))
            text += self._advance(final=False)
            if self.stopped:
                break
        return text

    def finish(self) -> str:
        """The generation ended: releases whatever was held back."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, final: bool) -> str:
        full = self._decode()
        if self.stop:
            start = max(0, self.sent - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                self.stopped = True
                self.tokens_at_stop = len(self.tokens)
                out = full[self.sent : cut] if cut > self.sent else ""
                self.sent = max(self.sent, cut)
                return out
        end = len(full)
        if not final:
            if full.endswith("\ufffd"):  # an incomplete multi-byte character
                end = len(full.rstrip("\ufffd"))
            end = min(end, len(full) - _held_prefix(full, self.stop))
        if end <= self.sent:
            return ""
        out = full[self.sent : end]
        self.sent = end
        return out


def _held_prefix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
