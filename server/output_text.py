"""The text of one generated sequence, built token by token: incremental detokenization,
stop strings, and the held-back tail that keeps a partial stop string from ever being sent."""
from __future__ import annotations

from typing import Protocol


class _Decoder(Protocol):
    def step(self, token_id: int) -> str: ...


class OutputText:
    """Feed token ids with `push`; it returns the text that may be sent now.

    While streaming, text that could be the start of a stop string is held back until it
    either completes the stop string (then it is cut off, or kept with
    include_stop_str_in_output) or stops matching (then it is released).
    """

    def __init__(self, decoder: _Decoder, stop: list[str], *, min_tokens: int = 0,
                 include_stop: bool = False):
        self._decoder = decoder
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self.text = ""           # generated text so far (cut at a stop string once found)
        self.num_tokens = 0
        self.stop_string: str | None = None  # the stop string that ended the sequence
        self._sent = 0           # characters of `text` already handed out

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return newly sendable text. After a stop string, further tokens are ignored."""
        for tid in token_ids:
            if self.stop_string is not None:
                break
            before = len(self.text)
            self.text += self._decoder.step(tid)
            self.num_tokens += 1
            if self._stop and self.num_tokens > self._min_tokens:
                self._check_stop(before)
        return self._take(final=self.stop_string is not None)

    def flush(self) -> str:
        """The sequence ended: release whatever was held back."""
        return self._take(final=True)

    def _check_stop(self, before: int) -> None:
        # A stop string can only newly appear in a window ending at the new text.
        start = max(0, before - self._max_stop + 1)
        best, found = -1, ""
        for s in self._stop:
            i = self.text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best, found = i, s
        if best != -1:
            self.stop_string = found
            end = best + len(found) if self._include_stop else best
            self.text = self.text[:end]

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not final and self._max_stop:
            end -= self._held_tail()
        if end <= self._sent:
            return ""
        out = self.text[self._sent:end]
        self._sent = end
        return out

    def _held_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self.text
        for k in range(min(self._max_stop - 1, len(text) - self._sent), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
