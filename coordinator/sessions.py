"""Session affinity: which worker holds each conversation's KV cache.

Owns: a bounded map from `session_id` to worker id (least recently used entries are forgotten first).
Must not: decide where a new session goes (scheduler.py) or talk to workers.

An entry outlives its worker on purpose: the next request for that session must hear 404
`unknown_session` (its conversation is gone) rather than silently start afresh on another worker.
infer.py forgets the entry when it gives that answer, so the id can then start a new conversation.
"""

from __future__ import annotations

from collections import OrderedDict


class SessionTable:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._worker_of: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._worker_of)

    def worker_of(self, session_id: str) -> str | None:
        return self._worker_of.get(session_id)

    def remember(self, session_id: str, worker_id: str) -> None:
        self._worker_of[session_id] = worker_id
        self._worker_of.move_to_end(session_id)
        while len(self._worker_of) > self._capacity:
            self._worker_of.popitem(last=False)

    def forget(self, session_id: str) -> None:
        self._worker_of.pop(session_id, None)
