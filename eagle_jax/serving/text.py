"""Incremental detokenization with OpenAI's (and vLLM's) stop semantics.

Text is decoded from all tokens so far (a token may complete a multi-byte character or change how the
previous ones read), and only text that can no longer change is released: not a trailing partial
character, and not a suffix that could still grow into a stop string. When a stop string appears the
text is cut right before it (right after it with ``include_stop``) and the stream ends, as OpenAI does.
A stop token (EOS, ``stop_token_ids``) ends the text too and, as in vLLM, is not detokenized unless
``include_stop``.
"""

from __future__ import annotations

from typing import Collection, Sequence


class TextStream:
    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        *,
        stop_ids: Collection[int] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.stop_ids = frozenset(stop_ids)
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []  # the tokens the text is decoded from
        self.sent = 0  # characters of the decoded text already released
        self.stopped = False  # a stop string was found
        self.tokens_at_stop: int | None = None  # tokens generated up to and including the one that completed it

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special_tokens)

    def push(self, tokens: Sequence[int]) -> str:
        """Adds tokens; returns the newly released text ("" if none). After a stop, returns ""."""
        if self.stopped:
            return ""
        tokens = [int(t) for t in tokens]
        for i, t in enumerate(tokens):  # a stop token is the generation's last: nothing after it is text
            if t in self.stop_ids:
                tokens = tokens[: i + 1] if self.include_stop else tokens[:i]
                break
        if not self.stop:
            self.tokens.extend(tokens)
            return self._advance(final=False)
        text = ""
        for t in tokens:  # token by token: the stop must be found at the token that completes it
            self.tokens.append(t)
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
            hits = [(i, -len(s), s) for s in self.stop if (i := full.find(s, start)) >= 0]
            if hits:
                cut, _, hit = min(hits)  # the earliest, and the longest stop string there
                self.stopped = True
                self.tokens_at_stop = len(self.tokens)
                end = cut + len(hit) if self.include_stop else cut
                out = full[self.sent : end] if end > self.sent else ""
                self.sent = max(self.sent, end)
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
