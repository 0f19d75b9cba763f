"""Turns generated token bytes into the text pieces a client sees.

Owns: joining tokens that split a multi-byte UTF-8 character, holding back text that may be the
start of a stop string, cutting the output at a stop string, and, when asked (`ids`), which tokens
each piece covers. Pure: no llama.cpp, no I/O.
Must not: decide when generation ends for other reasons (EOG, length): the engine does.

With `ids` a piece says which generated tokens its text covers (`Piece.ids`), so that another worker
can continue the stream after exactly those tokens (protocol.worker.GenerateRequest.generated). Text
then goes out at token boundaries only: a token whose text is held in part (the start of a stop string,
or a UTF-8 character its next token completes) is held whole, or a continuation would repeat its
released part or lose its held one. A piece that ends the stream (a stop string, or the end of
generation) covers every token whose text starts in it: nothing continues a finished stream. Without
`ids`, pieces are as they always were, and no token costs a list entry.
"""

from __future__ import annotations

import bisect
import codecs
from dataclasses import dataclass, field


@dataclass(slots=True)  # not frozen: one is made per token, and a frozen one's __init__ costs 3x
class Piece:
    text: str
    index: int  # position of the last generated token the text includes
    probability: float  # product of the included tokens' probabilities
    choice: int = 0  # which of the request's choices generated it
    # When asked for: the most likely tokens at the first token the text includes, with log-probabilities.
    alternatives: tuple[tuple[str, float], ...] = ()
    ids: list[int] | None = None  # with `ids`: the generated tokens the text covers, in order


@dataclass(slots=True)
class _Held:
    """The tokens pushed since the last piece, with `ids`: each one's id, the offset in the held text where
    its text starts (a token that ends inside a UTF-8 character shares its start with the tokens that
    complete it: only the start of a whole character is a boundary), probability and alternatives."""

    ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    probabilities: list[float] = field(default_factory=list)
    alternatives: list[tuple[tuple[str, float], ...]] = field(default_factory=list)

    def boundary(self, at: int) -> int:
        """The last token boundary at or before `at` (held text beyond the last token is not one)."""
        i = bisect.bisect_right(self.starts, at)
        return self.starts[i - 1] if i else 0

    def take(self, upto: int) -> tuple[list[int], float, tuple[tuple[str, float], ...]]:
        """The tokens whose text starts before offset `upto`: their ids, the product of their probabilities and
        the first one's alternatives; the rest stay, their offsets now from `upto`."""
        n = bisect.bisect_left(self.starts, upto)
        ids, self.ids = self.ids[:n], self.ids[n:]
        probability = 1.0
        for p in self.probabilities[:n]:
            probability *= p
        alternatives = self.alternatives[0] if n else ()
        self.probabilities, self.alternatives = self.probabilities[n:], self.alternatives[n:]
        self.starts = [start - upto for start in self.starts[n:]]
        return ids, probability, alternatives


class TextAssembler:
    def __init__(self, stop: list[str] | tuple[str, ...] = (), *, choice: int = 0, ids: bool = False) -> None:
        self._stop = tuple(stop)
        self._choice = choice
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._probability = 1.0
        self._alternatives: tuple[tuple[str, float], ...] = ()
        self._last_index = -1
        self._held: _Held | None = _Held() if ids else None
        self.stopped = False

    def push(self, data: bytes, index: int, probability: float,
             alternatives: tuple[tuple[str, float], ...] = (), token: int = -1) -> list[Piece]:
        """Adds one token's bytes (and, when asked for, the most likely tokens at it; with `ids`, its id);
        returns the text that is now safe to send (maybe none)."""
        if self.stopped:
            return []
        if self._held is not None:
            return self._push_held(data, index, probability, alternatives, token)
        if not self._alternatives:  # the first token since the last piece went out
            self._alternatives = alternatives
        self._pending += self._decoder.decode(data)
        self._probability *= probability
        self._last_index = index
        if not self._stop:  # nothing to hold back: what is decoded goes out as it is
            text, self._pending = self._pending, ""
            return self._emit(text) if text else []
        return self._release(final=False)

    def _push_held(self, data: bytes, index: int, probability: float,
                   alternatives: tuple[tuple[str, float], ...], token: int) -> list[Piece]:
        held = self._held
        assert held is not None
        inside = bool(self._decoder.getstate()[0])  # the last token ended inside a character: this one goes on
        held.ids.append(token)
        held.starts.append(held.starts[-1] if inside and held.starts else len(self._pending))
        held.probabilities.append(probability)
        held.alternatives.append(alternatives)
        self._pending += self._decoder.decode(data)
        self._last_index = index
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
        cut = self._first_stop(text) if self._stop else None
        if cut is not None:
            self.stopped = True
            out = cut
        elif final:
            out = len(text)
        else:
            out = len(text) - self._held_suffix(text)
            if self._held is not None and (out < len(text) or self._decoder.getstate()[0]):
                out = self._held.boundary(out)  # the text of a token held in part is held whole
        self._pending = "" if cut is not None or final else text[out:]
        if self._held is not None:
            return self._emit_held(text[:out], out)
        return self._emit(text[:out]) if out else []

    def _emit(self, text: str) -> list[Piece]:
        """`text` as the next piece."""
        piece = Piece(text, self._last_index, self._probability, self._choice, self._alternatives)
        self._probability = 1.0
        self._alternatives = ()
        return [piece]

    def _emit_held(self, text: str, out: int) -> list[Piece]:
        """With `ids`: `text` as the next piece, with the tokens whose text starts in it."""
        assert self._held is not None
        ids, probability, alternatives = self._held.take(out)
        if not text:
            return []
        index = self._last_index - len(self._held.ids)  # the tokens still held come after the piece's last
        return [Piece(text, index, probability, self._choice, alternatives, ids)]

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
