"""The prompt cache in host memory: the cells of a freed interactive request's sequence, saved when another
request takes that sequence, so that a later prompt of the same tenant starting with those tokens gets
them back instead of prefilling them.

Owns: its entries (a tenant, the tokens the cells hold, llama.cpp's saved bytes of them), the longest
prefix of a tenant's prompt any entry holds, and the bounds: `limit_bytes` in all and MAX_ENTRIES
entries (the least recently used dropped first), an entry at most a quarter of the limit. An entry whose
tokens start another's of the same tenant is dropped for the longer one (it holds all it did).
Must not: call llama.cpp (the engine saves and writes the cells), or give one tenant's cells to another
(`cached_tokens` and the time to first token would tell a tenant whether it guessed another's prompt).

Why: the sequences are the cache's first home (a freed sequence keeps its cells, worker/sessions/table.py),
but a batch job fills every sequence interactive traffic leaves free, so an interactive user's cells were
overwritten within a second of their request's end, and the next turn prefilled everything again
(docs/benchmarks.md, "A batch on idle capacity"). llama-server keeps such a cache in host memory too.

Engine thread only: no lock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from worker.sessions.table import shared_prefix

MAX_ENTRIES = 256  # each lookup compares the prompt with every entry of its tenant


@dataclass(frozen=True)
class Spilled:
    tenant: str
    tokens: tuple[int, ...]
    cells: bytes


class HostCache:
    def __init__(self, limit_bytes: int) -> None:
        """`limit_bytes` 0: off (nothing is kept)."""
        self.limit_bytes = limit_bytes
        self.bytes = 0
        self._entries: collections.OrderedDict[int, Spilled] = collections.OrderedDict()  # oldest use first
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def takes(self, size: int) -> bool:
        """Whether an entry of `size` bytes may be kept (asked before its cells are read)."""
        return 0 < size <= self.limit_bytes // 4

    def put(self, tenant: str, tokens: list[int] | tuple[int, ...], cells: bytes) -> bool:
        """Keeps `cells` (holding `tokens` of `tenant`); False when it is too large, or an entry of that
        tenant already holds all of them."""
        if not tokens or not self.takes(len(cells)):
            return False
        key = tuple(tokens)
        for k, entry in list(self._entries.items()):
            if entry.tenant != tenant:
                continue
            common = shared_prefix(list(entry.tokens), list(key))
            if common == len(key):
                self._entries.move_to_end(k)
                return False
            if common == len(entry.tokens):
                self._drop(k)
        self._entries[self._next] = Spilled(tenant, key, cells)
        self._next += 1
        self.bytes += len(cells)
        while self.bytes > self.limit_bytes or len(self._entries) > MAX_ENTRIES:
            self._drop(next(iter(self._entries)))
        return True

    def best(self, tenant: str, prompt: list[int], at_least: int) -> tuple[Spilled, int] | None:
        """The entry of `tenant` sharing the longest prefix with `prompt`, and that length, when it is
        at least `at_least` tokens (it is then the most recently used)."""
        if at_least > len(prompt) or not prompt:
            return None
        found: tuple[int, int] | None = None
        for k, entry in self._entries.items():
            if entry.tenant != tenant or len(entry.tokens) < at_least or entry.tokens[0] != prompt[0]:
                continue
            n = shared_prefix(list(entry.tokens), prompt)
            if n >= at_least and (found is None or n > found[1]):
                found = (k, n)
        if found is None:
            return None
        self._entries.move_to_end(found[0])
        return self._entries[found[0]], found[1]

    def _drop(self, key: int) -> None:
        self.bytes -= len(self._entries.pop(key).cells)
