"""`Embedding`: the one internal embedding request that a public surface produces and the core consumes.

Owns: bundling a validated `protocol.worker.EmbedRequest` with its request id and the exact bytes
posted to workers. The generation counterpart is generation.py.
Must not: parse any public wire format (surfaces do) or admit anything (gateway.py does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from protocol.worker import EmbedRequest
from serving.tracing import NO_TRACE, Trace


@dataclass(frozen=True, slots=True)
class Embedding:
    request: EmbedRequest
    request_id: str
    payload: bytes  # the JSON posted to the worker: only the fields the client set
    surface: str  # for the log line: which public API it came through
    trace: Trace = NO_TRACE  # its spans, when this coordinator traces (the gateway begins it)

    def for_model(self, name: str) -> Embedding:
        """Itself naming the served model `name` (a name the pool took for it: pool/models.py)."""
        request = self.request.model_copy(update={"model": name})
        return dataclasses.replace(self, request=request, payload=request.model_dump_json(exclude_unset=True).encode())

    @classmethod
    def of(cls, request: EmbedRequest, request_id: str, surface: str) -> Embedding:
        return cls(request, request_id, request.model_dump_json(exclude_unset=True).encode(), surface)
