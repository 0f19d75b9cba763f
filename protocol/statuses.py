"""The one table from a `reason` (protocol.reasons) to the HTTP status of a refusal for it.

Owns: `STATUS_BY_REASON`, the status a service answers with when it decides the refusal itself (the
worker's `WorkerError`, the coordinator's `CoordinatorError`), and `RELAYED_STATUS_BY_REASON`, the same
table as the coordinator answers it: two reasons only a worker decides mean something else once they
have crossed the coordinator. A worker's own failure (`engine_failed`, 500) and a request in a protocol
the worker does not speak (`protocol_mismatch`, 400: the coordinator's fault, not its client's) are, to
the coordinator's client, a bad gateway: 502.
Must not: decide when a refusal happens, or know either service; a new reason gets its row here (a
test checks every reason in protocol.reasons has one).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from protocol import reasons

# 503 responses carry Retry-After: capacity (ask again, or ask another worker), not a fault.
STATUS_BY_REASON: Mapping[str, int] = MappingProxyType({
    # the request itself
    reasons.INVALID_REQUEST: 400,
    reasons.EMBEDDINGS_UNSUPPORTED: 400,
    reasons.PROTOCOL_MISMATCH: 400,
    reasons.KV_REFUSED: 400,
    reasons.UNAUTHORIZED: 401,
    reasons.UNKNOWN_MODEL: 404,
    reasons.UNKNOWN_SESSION: 404,
    reasons.UNKNOWN_RESPONSE: 404,
    reasons.SESSION_EXPIRED: 404,
    reasons.NO_PREFIX: 404,
    reasons.REQUEST_TIMEOUT: 408,
    reasons.SESSION_BUSY: 409,
    reasons.SESSION_EXISTS: 409,
    reasons.WORKER_CONFLICT: 409,
    reasons.PROMPT_TOO_LONG: 413,
    reasons.BODY_TOO_LARGE: 413,
    reasons.HEADERS_TOO_LARGE: 431,
    # an API key's limits
    reasons.RATE_LIMITED: 429,
    reasons.BUDGET_EXCEEDED: 429,
    # capacity: ask again later, or another worker
    reasons.NO_WORKERS: 503,
    reasons.MODEL_UNAVAILABLE: 503,
    reasons.SESSIONS_FULL: 503,
    reasons.KV_FULL: 503,
    reasons.QUEUE_FULL: 503,
    reasons.QUEUE_TIMEOUT: 503,
    reasons.LOADING: 503,
    reasons.MODEL_LOAD_FAILED: 503,
    reasons.MODEL_SWAPPING: 503,
    reasons.DRAINING: 503,
    reasons.STREAMS_FULL: 503,
    reasons.EMBEDDINGS_FULL: 503,
    reasons.TRANSFERS_FULL: 503,
    # faults
    reasons.WORKER_UNAVAILABLE: 502,
    reasons.WORKER_FAILED: 502,
    reasons.ENGINE_FAILED: 500,
    reasons.DEADLINE_EXCEEDED: 504,
    reasons.SLOW_CONSUMER: 500,  # a stream's error event only: sent after the status
    reasons.INTERNAL: 500,
    reasons.CLIENT_GONE: 499,  # nginx's "client closed request": only ever logged
})

RELAYED_STATUS_BY_REASON: Mapping[str, int] = MappingProxyType({
    **STATUS_BY_REASON,
    reasons.ENGINE_FAILED: 502,
    reasons.PROTOCOL_MISMATCH: 502,
})
