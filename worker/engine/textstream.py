"""Turns generated token bytes into the text pieces a client sees.

Owns: joining tokens that split a multi-byte UTF-8 character, holding back text that may be the
start of a stop string, and cutting the output at a stop string. Pure: no llama.cpp, no I/O.
Must not: decide when generation ends for other reasons (EOG, length): the engine does.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


@dataclass(slots=True)  # not frozen: one is made per token, and a frozen one's __init__ costs 3x
class Piece:
    text: str
    index: int  # position of the last generated token the text includes
    probability: float  # product of the included tokens' probabilities
    choice: int = 0  # which of the request's choices generated it
    # When asked for: the most likely tokens at the first token the text includes, with log-probabilities.
    alternatives: tuple[tuple[str, float], ...] = ()


class TextAssembler:
    def __init__(self, stop: list[str] | tuple[str, ...] = (), *, choice: int = 0) -> None:
        self._stop = tuple(stop)
        self._choice = choice
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._probability = 1.0
        self._alternatives: tuple[tuple[str, float], ...] = ()
        self._last_index = -1
        self.stopped = False

    def push(self, data: bytes, index: int, probability: float,
             alternatives: tuple[tuple[str, float], ...] = ()) -> list[Piece]:
        """Adds one token's bytes (and, when asked for, the most likely tokens at it); returns the text
        that is now safe to send (maybe none)."""
        if self.stopped:
            return []
        if not self._alternatives:  # the first token since the last piece went out
            self._alternatives = alternatives
        self._pending += self._decoder.decode(data)
        self._probability *= probability
        self._last_index = index
        if not self._stop:  # nothing to hold back: what is decoded goes out as it is
            text, self._pending = self._pending, ""
            return self._emit(text) if text else []
        return self._release(final=False)

    def finish(self) -> list[Piece]:
        """Generation ended for a reason other than a stop string: send whatever is held.

        Bytes of a character the model never finished (generation cut mid-character) are dropped
        rather than sent as U+FFFD: they are counted as tokens but were never text.
        """
        if self.stopped:
            return []
        self._decoder.reset()
        return self._release(final=True)

    def _release(self, *, final: bool) -> list[Piece]:
        text = self._pending
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            text, keep = text[:cut], ""
        elif final:
            keep = ""
        else:
            hold = self._held_suffix(text)
            text, keep = text[: len(text) - hold], text[len(text) - hold:]
        self._pending = keep
        return self._emit(text) if text else []

    def _emit(self, text: str) -> list[Piece]:
        """`text` as the next piece."""
        piece = Piece(text, self._last_index, self._probability, self._choice, self._alternatives)
        self._probability = 1.0
        self._alternatives = ()
        return [piece]

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _held_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that some stop string starts with."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
