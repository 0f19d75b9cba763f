"""The request's priority class (admission/priority.py): the class it asked for, or its key's default,
checked against its key's highest; a batch request is sent as such, an interactive one may park one.

Owns: setting the class on the request and its rank for the queue's order (`Entry.rank`).
Must not: order anything (the queue does) or count anything.
"""

from __future__ import annotations

from coordinator.admission import priority
from coordinator.auth import KeyLimits
from coordinator.generation import Generation
from coordinator.stages import Entry
from serving.tracing import NO_TRACE

NO_LIMITS = KeyLimits()  # a request without an API key: every class, interactive by default


class PriorityClass:
    def enter(self, entry: Entry[Generation]) -> None:
        key = entry.client.limits if entry.client is not None else NO_LIMITS
        gen = entry.work
        rank = priority.resolve(gen.priority, key.priority, key.max_priority)
        entry.work, entry.rank = gen.classed(priority.CLASSES[rank]), rank
        if gen.trace is not NO_TRACE:
            gen.trace.set({"llm_pool.priority": priority.CLASSES[rank]})
