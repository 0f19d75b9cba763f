"""Constrained decoding: a sequence whose request carries a grammar (GBNF, or a JSON schema) may only
generate what the grammar accepts, with llguidance's matcher (the engine llama.cpp itself can use).

Owns: compiling a request's grammar (`GrammarCompiler.compile`: a `ConstraintError` names what is
wrong or which limit it passes, so admission answers 400 before the request takes a sequence), the
per-sequence grammar state (`Grammar`: may this token come next, mask a row to what may, advance by the
chosen token; `LazyGrammar`: the same, only for an answer that starts as the grammar does), and the
cache of compiled grammars.
Must not: choose tokens (sampling.py does, asking `allows` and `mask`) or touch the batch.

Why llguidance and not llama.cpp's grammar sampler: llama.cpp's checks every candidate's text against
every open alternative of the grammar, inside the shared engine step. With a JSON schema of an array
of a 20,000-value enum, eight such requests made four chats beside them 194x slower; on llguidance,
which walks the vocabulary's token trie with a lexer automaton, 2.11x, what any eight more sequences
cost (`bench.hostile_mix --kinds grammar,batch_of_eight`; docs/benchmarks.md, "Grammars on
llguidance"). xgrammar, the other library made for this, needs torch, transformers and triton:
several GB for one feature.

Cost: the mask of a sequence's next token is computed once, when the sampler first asks about it,
into a bitmask of one bit a token; `allows` reads a bit, `mask` expands the bits over a row. Compiling
a grammar (llguidance's lexer and parser tables) runs on admission's thread, off the event loop and
the engine, once per distinct grammar: the compiled matcher is kept (CACHE_ENTRIES, by a digest of
the grammar text) and each request gets a copy of it.

The budget, checked before a request takes a sequence: the grammar's text at most `max_bytes`
(MAX_GRAMMAR_BYTES by default), llguidance's own limits on the grammar's size and its lexer's states
(LIMITS), and a compile that took at most `compile_timeout` seconds (measured once it ends; llguidance's
limits are what bound it). Each step's mask is bounded by
llguidance's lexer fuel (LIMITS again): a grammar that runs out mid-answer can allow nothing more, and
its answer ends there.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import llguidance
import numpy as np

from worker.errors import ConstraintError

MAX_GRAMMAR_BYTES = 1 << 20  # a grammar's text (GBNF, or the JSON schema as JSON), at most
INTEGER_BOUND = 10**16 - 1  # an integer the schema leaves unbounded: 16 digits at most, or a model may not stop
CACHE_ENTRIES = 64  # compiled grammars kept, most recently used
COMPILE_TIMEOUT = 5.0  # seconds one grammar's compile may take
LIMITS = llguidance.LLParserLimits(max_grammar_size=2_000_000, max_lexer_states=250_000,
                                   step_lexer_fuel=5_000_000)


# llama-cpp-python's schema converter lets a string's characters be anything but `"` and `\`, so a
# constrained answer could hold a raw newline inside a string, which is not JSON (JSON wants control
# characters escaped). Its `char` rule is replaced by JSON's: no control characters, no DEL.
_LOOSE_CHAR = re.compile(r'^char ::= \[\^"\\\\\] ', re.MULTILINE)
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] '


def gbnf_of(*, grammar: str | None, json_schema: dict[str, Any] | None) -> str | None:
    """GBNF text for a request's `grammar` or `json_schema` (llama-cpp-python's converter): what the tool
    formats build their call grammars from (worker/backends/tool_format.py); None for none."""
    if json_schema is not None:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        try:
            gbnf = json_schema_to_gbnf(json.dumps(json_schema))
        except (ValueError, KeyError, TypeError, AssertionError, NotImplementedError, RecursionError) as exc:
            raise ConstraintError(f"json_schema: cannot be turned into a grammar: {exc}") from None
        return _LOOSE_CHAR.sub(lambda _: _JSON_CHAR, gbnf)
    return grammar


def as_before(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as llama.cpp's converter read it, which this worker used until llguidance: an object's
    properties are the only ones allowed unless `additionalProperties` says otherwise (as OpenAI's
    structured outputs require), an integer has at most 16 digits, and one space at most where JSON
    allows whitespace: a model left free to pad whitespace or digits may never stop (a small one did,
    writing a population to the length limit). A copy; `x-guidance` options the schema gives win."""
    copy = json.loads(json.dumps(schema))
    _closed(copy)
    copy["x-guidance"] = {"whitespace_pattern": " ?", **copy.get("x-guidance", {})}
    return copy


def _closed(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _closed(item)
        return
    if not isinstance(node, dict):
        return
    if "properties" in node and "additionalProperties" not in node:
        node["additionalProperties"] = False
    if node.get("type") == "integer":  # at most 16 digits, as llama.cpp's converter wrote them
        if "maximum" not in node and "exclusiveMaximum" not in node:
            node["maximum"] = INTEGER_BOUND
        if "minimum" not in node and "exclusiveMinimum" not in node:
            node["minimum"] = -INTEGER_BOUND
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            if isinstance(value, dict):  # a map of names to schemas, not a schema
                _closed(list(value.values()))
        elif key not in ("enum", "const", "default", "examples", "x-guidance"):
            _closed(value)


class Grammar:
    """One sequence's grammar state. Used by one thread at a time (admission's, then the engine's)."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int, end: int) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self._fresh = False  # the bits are those of the next token
        self.end = end

    def _mask(self) -> np.ndarray:
        if not self._fresh:
            self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            if self._matcher.is_error():
                self._bits[:] = 0  # out of budget, or a token it did not take: nothing more may come
            self._fresh = True
        return self._bits

    def allows(self, token: int) -> bool:
        return 0 <= token < self._n_vocab and bool((int(self._mask()[token >> 5]) >> (token & 31)) & 1)

    def mask(self, row: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`row` with -inf at every token the grammar rejects now, written into `out`."""
        allowed = np.unpackbits(self._mask().view(np.uint8), bitorder="little")[:row.size].view(bool)
        masked = out[:row.size]
        np.copyto(masked, row)
        masked[~allowed] = -np.inf
        return masked

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)  # a rejected token puts it in its error state: nothing more
        self._fresh = False

    def close(self) -> None:
        """Nothing to free by hand: the matcher is Rust's, dropped with this object."""


class LazyGrammar:
    """A grammar that holds an answer only if the answer starts as the grammar does: until the first
    token that is not whitespace it allows everything; that token, when the grammar takes it, wakes the
    grammar for the rest of the answer, and otherwise the answer stays free to its end.

    This is llama.cpp's lazy grammar (a grammar woken by a trigger) with the trigger "the answer's
    first word starts the grammar", decided here by asking the grammar about the token before it is
    accepted. Used for `tool_choice: auto`: an answer that opens a JSON object (or the model's call
    tag) is held to a valid call, prose is left alone."""

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


class GrammarCompiler:
    """One model's grammars: its vocabulary as llguidance's tokenizer (made at the first grammar, about
    0.2 s) and the compiled grammars, each compiled once. Thread-safe: admission compiles on several
    threads."""

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer], n_vocab: int, end: int, *,
                 max_bytes: int = MAX_GRAMMAR_BYTES, compile_timeout: float = COMPILE_TIMEOUT,
                 entries: int = CACHE_ENTRIES) -> None:
        self._make_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._n_vocab = n_vocab
        self._end = end
        self._max_bytes = max_bytes
        self._compile_timeout = compile_timeout
        self._entries = entries
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self.compiles = 0  # grammars compiled (not found in the cache)

    def compile(self, *, grammar: str | None, json_schema: dict[str, Any] | None,
                lazy: Callable[[int], bytes] | None = None) -> Grammar | LazyGrammar | None:
        """The request's constraint (None for none); `lazy` (a token's bytes) makes it a `LazyGrammar`."""
        if grammar is None and json_schema is None:
            return None
        field = "json_schema" if json_schema is not None else "grammar"
        text = json.dumps(json_schema, sort_keys=True) if json_schema is not None else grammar or ""
        if len(text.encode()) > self._max_bytes:
            raise ConstraintError(f"{field}: {len(text.encode()):,} bytes; a grammar may have at most "
                                  f"{self._max_bytes:,} (the worker's grammar budget)")
        key = hashlib.sha256(f"{field}\0{text}".encode()).hexdigest()
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
            tokenizer = self._tokenizer = self._tokenizer or self._make_tokenizer()
        if template is None:
            template = self._build(field, grammar, json_schema, tokenizer)
            with self._lock:
                self._compiled[key] = template
                while len(self._compiled) > self._entries:
                    self._compiled.popitem(last=False)
        compiled = Grammar(template.deep_copy(), self._n_vocab, self._end)
        return compiled if lazy is None else LazyGrammar(compiled, lazy)

    def _build(self, field: str, grammar: str | None, json_schema: dict[str, Any] | None,
               tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        try:
            if json_schema is not None:
                source = llguidance.LLMatcher.grammar_from_json_schema(as_before(json_schema))
            else:
                from llguidance.gbnf_to_lark import gbnf_to_lark

                source = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(grammar or ""))
        except Exception as exc:  # noqa: BLE001 - the converters raise many kinds for a bad input
            raise ConstraintError(f"{field}: cannot be turned into a grammar: {exc}") from None
        started = time.monotonic()
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=LIMITS)
        seconds = time.monotonic() - started
        self.compiles += 1
        if matcher.is_error():
            raise ConstraintError(f"{field}: {matcher.get_error()}")
        if seconds > self._compile_timeout:
            raise ConstraintError(f"{field}: compiling it took {seconds:.1f} s; a grammar may take at most "
                                  f"{self._compile_timeout:g} s (the worker's grammar budget)")
        return matcher
