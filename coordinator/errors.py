"""The coordinator's one error family and the one table from `reason` to HTTP status.

Owns: `CoordinatorError` and `STATUS_BY_REASON`. Every refusal the coordinator sends before the
first byte of a response is a `CoordinatorError`; app.py turns it into a JSON `ErrorBody` in one
place. After the first byte, the same reason travels as an SSE `error` event instead.
Must not: import FastAPI or know about requests.
"""

from __future__ import annotations

from protocol import reasons
from protocol.worker import REQUEST_ID_HEADER

STATUS_BY_REASON: dict[str, int] = {
    reasons.INVALID_REQUEST: 400,
    reasons.EMBEDDINGS_UNSUPPORTED: 400,
    reasons.UNAUTHORIZED: 401,
    reasons.UNKNOWN_MODEL: 404,
    reasons.UNKNOWN_SESSION: 404,
    reasons.SESSION_EXPIRED: 404,
    reasons.SESSION_BUSY: 409,
    reasons.WORKER_CONFLICT: 409,
    reasons.PROMPT_TOO_LONG: 413,
    reasons.BODY_TOO_LARGE: 413,
    reasons.REQUEST_TIMEOUT: 408,
    reasons.HEADERS_TOO_LARGE: 431,
    reasons.RATE_LIMITED: 429,
    reasons.BUDGET_EXCEEDED: 429,
    reasons.NO_WORKERS: 503,
    reasons.MODEL_UNAVAILABLE: 503,
    reasons.SESSIONS_FULL: 503,
    reasons.KV_FULL: 503,
    reasons.QUEUE_FULL: 503,
    reasons.QUEUE_TIMEOUT: 503,
    reasons.LOADING: 503,
    reasons.MODEL_LOAD_FAILED: 503,
    reasons.MODEL_SWAPPING: 409,
    reasons.DRAINING: 503,
    reasons.STREAMS_FULL: 503,
    reasons.EMBEDDINGS_FULL: 503,
    reasons.WORKER_UNAVAILABLE: 502,
    reasons.WORKER_FAILED: 502,
    reasons.ENGINE_FAILED: 502,
    reasons.DEADLINE_EXCEEDED: 504,
    reasons.PROTOCOL_MISMATCH: 502,
    reasons.INTERNAL: 500,
    reasons.CLIENT_GONE: 499,  # nginx's "client closed request": only ever logged
}


class CoordinatorError(Exception):
    """A refusal with a machine-readable reason; its HTTP status comes from `STATUS_BY_REASON`.

    `status` may be given for a reason the table does not know (a newer worker's 4xx passed
    through), so the client still sees the worker's own status rather than a guess.
    """

    def __init__(self, reason: str, message: str, *, status: int | None = None,
                 retry_after: int | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers or {}  # more headers for its response (a key's x-ratelimit-* on a 429)
        self.reason = reason
        self.message = message
        self.param = param  # the request field at fault, when one is
        self.status = status if status is not None else STATUS_BY_REASON.get(reason, 500)
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"CoordinatorError({self.reason!r}, {self.message!r}, status={self.status})"


def error_headers(exc: CoordinatorError, request_id: str) -> dict[str, str]:
    """The headers every surface's error response carries, whatever its body's shape."""
    headers = {**exc.headers, REQUEST_ID_HEADER: request_id}
    if exc.retry_after is not None:
        headers["retry-after"] = str(exc.retry_after)
    if exc.status == 401:
        headers["www-authenticate"] = "Bearer"
    return headers
