"""Constrained decoding: a sequence whose request carries a grammar (GBNF, or a JSON schema turned into
one) may only generate what the grammar accepts, with llama.cpp's own grammar sampler.

Owns: compiling a request's grammar (`compile_constraint`: a `ConstraintError` names what is wrong, so
admission answers 400), the per-sequence grammar state (`Grammar`: may this token come next, mask a
row to what may, advance by the chosen token; `LazyGrammar`: the same, only for an answer that starts
as the grammar does), and freeing llama.cpp's sampler with it.
Must not: choose tokens (sampling.py does, asking `allows` and `mask`) or touch the batch.

Cost: only constrained rows pay, and mostly little. The step sampler first picks as if unconstrained
and asks the grammar about that one token (a one-candidate `llama_sampler_apply`); only when the
grammar rejects it is the whole row masked (every token's text checked against the grammar, which
llama.cpp does in C), and the pick made again from what is left. This is what llama.cpp's own
common sampler does; a model that already writes valid JSON rarely pays the full mask.
"""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Callable
from typing import Any

import llama_cpp as ll
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from worker.errors import ConstraintError

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)
# llama-cpp-python's schema converter lets a string's characters be anything but `"` and `\`, so a
# constrained answer could hold a raw newline inside a string, which is not JSON (JSON wants control
# characters escaped). Its `char` rule is replaced by JSON's: no control characters, no DEL.
_LOOSE_CHAR = re.compile(r'^char ::= \[\^"\\\\\] ', re.MULTILINE)
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] '


def gbnf_of(*, grammar: str | None, json_schema: dict[str, Any] | None) -> str | None:
    """The GBNF text a request asks for: its `grammar`, or its `json_schema` converted; None for none
    (never both: `protocol.worker.GenerationFields` refuses that)."""
    if json_schema is not None:
        try:
            gbnf = json_schema_to_gbnf(json.dumps(json_schema))
        except (ValueError, KeyError, TypeError, AssertionError, NotImplementedError, RecursionError) as exc:
            raise ConstraintError(f"json_schema: cannot be turned into a grammar: {exc}") from None
        return _LOOSE_CHAR.sub(lambda _: _JSON_CHAR, gbnf)
    return grammar


class Grammar:
    """One sequence's grammar state in llama.cpp. Used on the engine thread only, after compiling."""

    def __init__(self, vocab: ll.llama_vocab_p, gbnf: str, n_vocab: int) -> None:
        self._sampler = ll.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
        if not self._sampler:
            raise ConstraintError("grammar: llama.cpp cannot parse it (see the GBNF guide of llama.cpp: rules "
                                  "`name ::= ...`, a `root` rule)")
        self.end = int(ll.llama_vocab_eos(vocab))
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self._all = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._all["id"] = np.arange(n_vocab)

    def allows(self, token: int) -> bool:
        self._one["id"], self._one["logit"] = token, 0.0
        self._apply(self._one)
        return bool(np.isfinite(self._one["logit"][0]))

    def mask(self, row: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`row` with -inf at every token the grammar rejects now, written into `out`."""
        self._all["logit"] = row
        self._apply(self._all)
        np.copyto(out[:row.size], self._all["logit"])
        return out[:row.size]

    def accept(self, token: int) -> None:
        ll.llama_sampler_accept(self._sampler, token)

    def close(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler:
            ll.llama_sampler_free(sampler)

    def __del__(self) -> None:  # a job dropped before its run began still frees its sampler
        self.close()

    def _apply(self, data: np.ndarray) -> None:
        array = ll.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)),
                                          size=data.size, selected=-1, sorted=False)
        ll.llama_sampler_apply(self._sampler, ctypes.byref(array))
        if ctypes.cast(array.data, ctypes.c_void_p).value != data.ctypes.data:  # it filters in place
            raise RuntimeError("llama.cpp's grammar sampler moved the candidates")


class LazyGrammar:
    """A grammar that holds an answer only if the answer starts as the grammar does: until the first
    token that is not whitespace it allows everything; that token, when the grammar takes it, wakes the
    grammar for the rest of the answer, and otherwise the answer stays free to its end.

    This is llama.cpp's lazy grammar (a grammar woken by a trigger) with the trigger "the answer's
    first word starts the grammar", decided here by asking the grammar about the token before it is
    accepted: llama.cpp's own trigger patterns feed the grammar the text from the match on, and a
    text the grammar rejects aborts the process. Used for `tool_choice: auto`: an answer that opens
    a JSON object is held to a valid call, prose is left alone."""

    def __init__(self, grammar: Grammar, piece: Callable[[int], bytes]) -> None:
        self._grammar = grammar
        self._piece = piece
        self.end = grammar.end
        self.state = "waiting"  # then "holding" (the grammar has the answer) or "free" (it never will)

    def allows(self, token: int) -> bool:
        return self.state != "holding" or self._grammar.allows(token)

    def mask(self, row: np.ndarray, out: np.ndarray) -> np.ndarray:
        if self.state == "holding":
            return self._grammar.mask(row, out)
        np.copyto(out[:row.size], row)
        return out[:row.size]

    def accept(self, token: int) -> None:
        if self.state == "waiting" and self._piece(token).strip():
            self.state = "holding" if self._grammar.allows(token) else "free"
        if self.state == "holding":
            self._grammar.accept(token)

    def close(self) -> None:
        self._grammar.close()


def compile_constraint(vocab: ll.llama_vocab_p, n_vocab: int, *, grammar: str | None,
                       json_schema: dict[str, Any] | None, lazy: Callable[[int], bytes] | None = None,
                       ) -> Grammar | LazyGrammar | None:
    """The request's constraint; `lazy` (a token's bytes) makes it a `LazyGrammar`."""
    gbnf = gbnf_of(grammar=grammar, json_schema=json_schema)
    if gbnf is None:
        return None
    compiled = Grammar(vocab, gbnf, n_vocab)
    return compiled if lazy is None else LazyGrammar(compiled, lazy)
