"""Session affinity: which worker holds each conversation's KV cache.

Owns: a bounded map from a session's key, (tenant, `session_id`), to worker id (least recently used
entries are forgotten first). A session belongs to its tenant (coordinator/auth.py): another
tenant's use of the same id names another session, so it can neither continue nor end this one.
Must not: decide where a new session goes (scheduling/) or talk to workers.

With several coordinators, the workers' heartbeats say which worker holds each session
(`held_by`, the registry's index of `protocol.health.WorkerLoad.held`): that answer comes first, so a
turn that reaches another coordinator than the last one, or a session another coordinator moved, goes
to the worker that holds it. This table answers for a session no heartbeat lists (one begun since).

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
from collections.abc import Callable

from coordinator.generation import SessionKey
from protocol.health import session_digest


class SessionTable:
    def __init__(self, capacity: int, held_by: Callable[[str], str | None] = lambda digest: None) -> None:
        """`held_by`: the worker whose heartbeat lists a session digest (the registry's `holder`)."""
        self._capacity = capacity
        self._held_by = held_by
        self._worker_of: OrderedDict[SessionKey, str] = OrderedDict()
        self._claimed: set[SessionKey] = set()

    def __len__(self) -> int:
        return len(self._worker_of)

    def worker_of(self, key: SessionKey) -> str | None:
        held = self._held_by(session_digest(*key))
        if held is not None:
            if self._worker_of.get(key) != held:
                self.remember(key, held)
            return held
        return self._worker_of.get(key)

    def remember(self, key: SessionKey, worker_id: str) -> None:
        self._worker_of[key] = worker_id
        self._worker_of.move_to_end(key)
        while len(self._worker_of) > self._capacity:
            self._worker_of.popitem(last=False)

    def claim(self, key: SessionKey) -> bool:
        """False when another request is placing this id's first turn right now."""
        if key in self._claimed:
            return False
        self._claimed.add(key)
        return True

    def unclaim(self, key: SessionKey) -> None:
        self._claimed.discard(key)

    def forget(self, key: SessionKey) -> None:
        self._worker_of.pop(key, None)
