"""The request's span (serving/tracing.py): begun when it enters, ended with how it ended.

Owns: the span's name and attributes on the way in (request id, surface, tenant, model, and the class
once it is set), its failure when the request never opened, and its closing attributes.
Must not: decide anything about the request; an untraced coordinator copies nothing for it.
"""

from __future__ import annotations

import dataclasses

from coordinator.stages import End, Entry, W
from serving import tracing
from serving.tracing import NO_TRACE, Trace, Tracing


class Span:
    def __init__(self, tracing: Tracing | None) -> None:
        self._tracing = tracing

    def enter(self, entry: Entry[W]) -> _Open | None:
        work = entry.work
        trace = tracing.begin(self._tracing, f"{work.surface} request", entry.headers, {
            "llm_pool.request_id": work.request_id, "llm_pool.surface": work.surface,
            "llm_pool.tenant": work.request.tenant, "llm_pool.model": work.request.model or ""})
        if trace is NO_TRACE:  # an untraced request is not copied for it
            return None
        entry.work = dataclasses.replace(work, trace=trace)
        return _Open(trace)


class _Open:
    __slots__ = ("_trace",)

    def __init__(self, trace: Trace) -> None:
        self._trace = trace

    def failed(self, exc: BaseException) -> None:
        self._trace.raised(exc)
        self._trace.end()

    def ended(self, end: End) -> None:
        self._trace.set({"llm_pool.worker": end.worker_id, "llm_pool.model": end.model, **end.attributes})
        if end.failure is not None:
            self._trace.fail(end.failure)
        self._trace.end()
