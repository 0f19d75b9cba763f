"""The coordinator's one error family, and its view of the one table from `reason` to HTTP status.

Owns: `CoordinatorError`. `STATUS_BY_REASON` is protocol.statuses' table as the coordinator answers it
(`RELAYED_STATUS_BY_REASON`), imported here for the coordinator's rooms. Every refusal the coordinator
sends before the first byte of a response is a `CoordinatorError`; app.py turns it into a JSON
`ErrorBody` in one place. After the first byte, the same reason travels as an SSE `error` event instead.
Must not: import FastAPI or know about requests.
"""

from __future__ import annotations

from protocol.statuses import RELAYED_STATUS_BY_REASON as STATUS_BY_REASON
from protocol.worker import REQUEST_ID_HEADER

__all__ = ["STATUS_BY_REASON", "CoordinatorError", "error_headers"]


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
