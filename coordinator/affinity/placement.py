"""What affinity says about one request before the scheduler ranks workers, and what it learns after.

Owns: turning a request's session, conversation and prompt prefix into the scheduler's inputs (the
worker a session must go to, the only candidate then; the worker a conversation prefers; the prefix
match per worker), and recording where a request went (a new session, a conversation, a prefix), or
forgetting a session whose worker lost it. Every key is the request's tenant's.
Must not: rank workers (scheduling/) or talk to workers (relay/).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.affinity.conversations import ConversationTable, continuation_key, conversation_key
from coordinator.affinity.prefixes import PrefixIndex
from coordinator.affinity.sessions import SessionTable
from coordinator.generation import Generation, SessionKey
from coordinator.pool.registry import ALIVE, Registry, WorkerRecord


@dataclass(slots=True)
class Leaning:
    """Affinity's say about one request: the scheduler's candidates and preferences."""

    candidates: list[WorkerRecord]
    session_worker: str | None = None  # a session's worker: the only candidate
    prefer: str | None = None  # a conversation's previous worker, when it passes the filters
    hashes: list[bytes] = field(default_factory=list)  # the prompt's prefix blocks, when indexed
    match: dict[str, float] = field(default_factory=dict)  # worker id -> share of those blocks sent there


@dataclass(slots=True)
class Affinity:
    sessions: SessionTable
    conversations: ConversationTable
    prefixes: PrefixIndex
    registry: Registry

    def session_worker(self, gen: Generation) -> str | None:
        """The worker its session lives on; None for a new session, or one whose worker it must avoid (a
        first turn continued after its worker failed: the session starts afresh where it goes on)."""
        key = gen.session_key
        worker = self.sessions.worker_of(key) if key is not None else None
        return None if worker is not None and worker in gen.avoid else worker

    def lean(self, gen: Generation, model: str | None, *, by_prefix: bool) -> Leaning:
        body = gen.request
        session_worker = self.session_worker(gen)
        if session_worker is not None:
            record = self.registry.get(session_worker)
            return Leaning([record] if record is not None else [], session_worker=session_worker)
        alive = self.registry.alive(model)
        leaning = Leaning([w for w in alive if w.worker_id not in gen.avoid] if gen.avoid else list(alive),
                          prefer=gen.prefer)
        if body.messages is not None and gen.prefer is None:
            key = continuation_key(body.tenant, model, body.messages)
            leaning.prefer = self.conversations.worker_of(key) if key is not None else None
        if by_prefix:
            leaning.hashes = self.prefixes.hashes(model, body)
            leaning.match = self.prefixes.match(leaning.hashes)
        return leaning

    def prefix_holder(self, leaning: Leaning) -> tuple[WorkerRecord, float] | None:
        """The alive worker that was sent most of this prompt's prefix, and its share, if any was: another
        worker the request goes to may fetch those cells from it instead of prefilling them (issue 19)."""
        if not leaning.match:
            return None
        worker_id, share = max(leaning.match.items(), key=lambda item: item[1])
        record = self.registry.get(worker_id)
        if record is None or record.state != ALIVE or record.draining:
            return None
        return record, share

    def placed(self, gen: Generation, model: str | None, worker_id: str, leaning: Leaning) -> None:
        """The request's worker sent its first event: remember where its session, conversation and
        prefix now live."""
        key = gen.session_key
        if key is not None:
            self.sessions.remember(key, worker_id)
        elif gen.request.messages is not None:
            self.conversations.remember(conversation_key(gen.request.tenant, model, gen.request.messages), worker_id)
        if leaning.hashes:
            self.prefixes.record(leaning.hashes, worker_id)

    def lost(self, key: SessionKey | None) -> None:
        """The session's worker is gone or no longer holds it: said once, the id may start afresh."""
        if key is not None:
            self.sessions.forget(key)
