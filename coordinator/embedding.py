"""`Embedding`: the one internal embedding request that a public surface produces and the core consumes.

Owns: bundling a validated `protocol.worker.EmbedRequest` with its request id and the exact bytes
posted to workers. The generation counterpart is generation.py.
Must not: parse any public wire format (surfaces do) or admit anything (gateway.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.worker import EmbedRequest


@dataclass(frozen=True, slots=True)
class Embedding:
    request: EmbedRequest
    request_id: str
    payload: bytes  # the JSON posted to the worker: only the fields the client set
    surface: str  # for the log line: which public API it came through

    @classmethod
    def of(cls, request: EmbedRequest, request_id: str, surface: str) -> Embedding:
        return cls(request, request_id, request.model_dump_json(exclude_unset=True).encode(), surface)
