"""Session affinity: which worker holds each conversation's KV cache.

Owns: a bounded map from `session_id` to worker id (least recently used entries are forgotten first)
and its per-worker index, so a removed worker's sessions are forgotten together.
Must not: decide where a new session goes (scheduler.py) or talk to workers.
"""

from __future__ import annotations

from collections import OrderedDict


class SessionTable:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._worker_of: OrderedDict[str, str] = OrderedDict()
        self._by_worker: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._worker_of)

    def worker_of(self, session_id: str) -> str | None:
        return self._worker_of.get(session_id)

    def remember(self, session_id: str, worker_id: str) -> None:
        old = self._worker_of.get(session_id)
        if old is not None and old != worker_id:
            self._unindex(session_id, old)
        self._worker_of[session_id] = worker_id
        self._worker_of.move_to_end(session_id)
        self._by_worker.setdefault(worker_id, set()).add(session_id)
        while len(self._worker_of) > self._capacity:
            evicted, owner = self._worker_of.popitem(last=False)
            self._unindex(evicted, owner)

    def forget(self, session_id: str) -> None:
        owner = self._worker_of.pop(session_id, None)
        if owner is not None:
            self._unindex(session_id, owner)

    def forget_worker(self, worker_id: str) -> None:
        for session_id in self._by_worker.pop(worker_id, set()):
            self._worker_of.pop(session_id, None)

    def _unindex(self, session_id: str, worker_id: str) -> None:
        owned = self._by_worker.get(worker_id)
        if owned is not None:
            owned.discard(session_id)
            if not owned:
                del self._by_worker[worker_id]
