"""The worker's one error family. Its status code and reason go to the client unchanged.

Owns: `WorkerError` and the rule that turns it into an HTTP response (`to_response`).
Must not: decide *when* to fail; the edge, admission and session table raise these.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from protocol.worker import REQUEST_ID_HEADER, ErrorBody

RETRY_AFTER_SECONDS = "1"


class ConstraintError(ValueError):
    """A request's grammar or schema cannot be used; the message says why (for a 400). Raised by the
    engines (worker.engine.grammar compiles them), answered by admission."""


class WorkerError(Exception):
    """A refusal with an HTTP status and a machine-readable reason from protocol.reasons."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message

    def to_response(self, request_id: str) -> JSONResponse:
        headers = {REQUEST_ID_HEADER: request_id}
        if self.status == 503:
            headers["Retry-After"] = RETRY_AFTER_SECONDS
        body = ErrorBody(error=self.message, reason=self.reason, request_id=request_id)
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers)
