"""Incremental detokenization: the text each new token adds, with stop strings cut out."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalText:
    """Feeds token ids, returns the text they add; text that may still grow into a stop string is
    held back.

    Decodes a short window (from a prefix offset) rather than the whole answer at every token, and
    holds back a trailing U+FFFD, which is an incomplete multi-byte character, not text.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids whose text is settled in _text
        self._text = ""  # settled text (stop strings not yet applied)
        self._sent = 0  # characters of _text already returned
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.stopped = False  # a stop string was found: the answer ends before it

    def add(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        before = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self._text += window[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """The rest of the text, at the end of the stream."""
        if self._read < len(self._ids):
            settled = self._decode(self._ids[self._prefix : self._read])
            rest = self._decode(self._ids[self._prefix :])[len(settled) :]
            self._text += rest
            self._read = len(self._ids)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self._text)
        for s in self._stop:
            # Only the unsent text can hold a new stop string: one starting in sent text would
            # have been whole (the hold keeps back len - 1 characters) and found then.
            i = self._text.find(s, self._sent)
            if i >= 0 and i < end:
                end, self.stopped = i, True
        if not self.stopped and not final:
            end = max(self._sent, len(self._text) - self._hold)
        out = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return out
