"""The order prompts waiting in an engine are prefilled in: the tenants' weights applied at the worker.

Owns: that order. The tenant with the fewest sequences decoding here for its weight (`tenant_weight`,
its key's fair-share weight, which the coordinator sends) goes first, then the shortest remaining prompt
(a prompt whose prefix was cached has a few tokens left and gets its first token in this step), then the
oldest. Pure: no llama.cpp.
Must not: decide how many prompt tokens a step takes (pacing.py and the engine do).

Why at the worker too: the coordinators order their queues by the tenants' counters, but a flood's new
prompts reach a worker together and, all about as long as a light tenant's, would be prefilled first come
first served, a chunk a step: the light tenant's first token then waits for the flood's prefills. Without
keys every request is tenant "" at weight 1, and the order is what it was: shortest, then oldest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar


class _Request(Protocol):
    @property
    def tenant(self) -> str: ...
    @property
    def tenant_weight(self) -> float: ...


class _Job(Protocol):
    @property
    def request(self) -> _Request: ...


class Waiting(Protocol):
    """A sequence as the line sees it (the engine's running sequences)."""

    @property
    def job(self) -> _Job: ...
    @property
    def todo(self) -> Sequence[int]: ...
    @property
    def started_at(self) -> float: ...


S = TypeVar("S", bound=Waiting)


def prefill_order(sequences: Iterable[S]) -> list[S]:
    """The sequences with prompt tokens left, in the order they are prefilled."""
    sequences = list(sequences)
    decoding = Counter(s.job.request.tenant for s in sequences if not s.todo)
    if len(decoding) <= 1 and len({s.job.request.tenant for s in sequences}) <= 1:
        return sorted((s for s in sequences if s.todo), key=lambda s: (len(s.todo), s.started_at))
    return sorted((s for s in sequences if s.todo),
                  key=lambda s: (decoding[s.job.request.tenant] / s.job.request.tenant_weight, len(s.todo),
                                 s.started_at))
