"""What one Responses WebSocket remembers of its own responses, so a turn can send only its new input.

Owns: each kept response's conversation (the input items it was made from, the earlier ones included,
then its output items, as JSON-ready dicts the Responses parser takes back as input), looked up by
response id; the bounds on them (items and bytes, all kept responses together); forgetting the oldest
past a bound, and one on request (a continuation that failed).
Must not: outlive its socket or be shared between sockets (it lives in the socket's handler), or parse
requests (responses.py does; the socket prepends a chain to the new input and parses the whole).

Why a whole conversation per response and not a link to the previous one: a chain can then be forgotten
at any point without breaking the ones after it, and a turn reads one entry. The items are shared
between entries (the same dicts), so what is counted (each entry's own size) bounds memory from above.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

Items = tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class _Kept:
    items: Items
    size: int  # bytes as JSON


class Chains:
    """`Chains(max_items=..., max_bytes=...)`; `keep(id, items)`, `get(id)`, `forget(id)`. Oldest first
    out; an entry over a bound on its own is not kept (its continuation then gets not found)."""

    def __init__(self, *, max_items: int, max_bytes: int) -> None:
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._items = 0
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def size(self) -> tuple[int, int]:
        """(items, bytes) kept now."""
        return self._items, self._bytes

    def get(self, response_id: str) -> Items | None:
        kept = self._kept.get(response_id)
        return kept.items if kept is not None else None

    def keep(self, response_id: str, items: Items) -> None:
        self.forget(response_id)
        kept = _Kept(items, len(json.dumps(items, separators=(",", ":"))))
        if len(items) > self._max_items or kept.size > self._max_bytes:
            return
        while self._kept and (self._items + len(items) > self._max_items or self._bytes + kept.size > self._max_bytes):
            self.forget(next(iter(self._kept)))
        self._kept[response_id] = kept
        self._items += len(items)
        self._bytes += kept.size

    def forget(self, response_id: str) -> None:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._items -= len(kept.items)
            self._bytes -= kept.size
