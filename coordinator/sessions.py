"""Session affinity: which worker holds each conversation's KV cache.

Owns: a bounded map from `session_id` to worker id (least recently used entries are forgotten first).
Must not: decide where a new session goes (scheduler.py) or talk to workers.

An entry outlives its worker on purpose: the next request for that session must hear 404
`unknown_session` (its conversation is gone) rather than silently start afresh on another worker.
infer.py forgets the entry when it gives that answer, so the id can then start a new conversation.

A new id is *claimed* while its first turn is being placed (admission, scheduling, dispatch): a
second request with the same new id meanwhile gets 409 `session_busy`, instead of starting a second
copy of the conversation on another worker that would hold a slot and KV until its TTL. Claims are
bounded by the requests in flight and always given back (`unclaim`), placed or not.
"""

from __future__ import annotations

from collections import OrderedDict


class SessionTable:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._worker_of: OrderedDict[str, str] = OrderedDict()
        self._claimed: set[str] = set()

    def __len__(self) -> int:
        return len(self._worker_of)

    def worker_of(self, session_id: str) -> str | None:
        return self._worker_of.get(session_id)

    def remember(self, session_id: str, worker_id: str) -> None:
        self._worker_of[session_id] = worker_id
        self._worker_of.move_to_end(session_id)
        while len(self._worker_of) > self._capacity:
            self._worker_of.popitem(last=False)

    def claim(self, session_id: str) -> bool:
        """False when another request is placing this id's first turn right now."""
        if session_id in self._claimed:
            return False
        self._claimed.add(session_id)
        return True

    def unclaim(self, session_id: str) -> None:
        self._claimed.discard(session_id)

    def forget(self, session_id: str) -> None:
        self._worker_of.pop(session_id, None)
