"""The worker's one error family. Its status code and reason go to the client unchanged.

Owns: `WorkerError` and the rule that turns it into an HTTP response (`to_response`).
Must not: decide *when* to fail (the edge, admission and session table raise these), nor type a status:
a refusal is raised by its reason, and its status is protocol.statuses' (the coordinator's table too).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from protocol import reasons
from protocol.statuses import STATUS_BY_REASON
from protocol.worker import REQUEST_ID_HEADER, ErrorBody

RETRY_AFTER_SECONDS = "1"


class ConstraintError(ValueError):
    """A request's grammar or schema cannot be used; the message says why (for a 400). Raised by the
    engines (worker.engine.grammar compiles them), answered by admission."""


class WorkerError(Exception):
    """A refusal with a machine-readable reason from protocol.reasons; its HTTP status is the reason's
    (protocol.statuses), a 503 with Retry-After."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = STATUS_BY_REASON.get(reason, 500)
        self.reason = reason
        self.message = message

    @classmethod
    def from_http(cls, status: int, message: str) -> WorkerError:
        """Starlette's own refusal (no route for the path, 404; not its method, 405): its status kept, with
        the reason `invalid_request` (below 500) or `internal`. The one status not its reason's."""
        error = cls(reasons.INVALID_REQUEST if status < 500 else reasons.INTERNAL, message)
        error.status = status
        return error

    def to_response(self, request_id: str) -> JSONResponse:
        headers = {REQUEST_ID_HEADER: request_id}
        if self.status == 503:
            headers["Retry-After"] = RETRY_AFTER_SECONDS
        body = ErrorBody(error=self.message, reason=self.reason, request_id=request_id)
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers)
