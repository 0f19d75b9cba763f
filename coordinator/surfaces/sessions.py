"""`DELETE /coordinator/sessions/{session_id}`: end a conversation kept with `session_id` and free its KV.

Owns: finding the worker that holds the calling tenant's session, asking it to end the session
(through pool/moves.py's `end`: `DELETE /worker/sessions/{id}?tenant=...`), and forgetting the affinity.
A session belongs to its tenant (coordinator/auth.py): another key's id names nothing here, so it
is 404 `unknown_session`, exactly like an id never used.
Must not: admit, schedule or relay anything.
"""

from __future__ import annotations

import re

from fastapi import APIRouter, Request, Response

from coordinator.auth import tenant_of
from coordinator.errors import CoordinatorError
from coordinator.state import CoordinatorState
from protocol import reasons
from protocol.inference import ErrorBody
from protocol.worker import SESSION_ID_PATTERN

PREFIX = "/coordinator/sessions/"
router = APIRouter()
_SESSION_ID = re.compile(SESSION_ID_PATTERN)


@router.delete(PREFIX + "{session_id}", status_code=204, summary="End a kept session and free its KV", responses={
    400: {"model": ErrorBody, "description": "`invalid_request`: not a session id"},
    401: {"model": ErrorBody, "description": "`unauthorized`: client API keys are configured and none was given"},
    404: {"model": ErrorBody, "description": "`unknown_session`: this key has no such session (now)"},
    502: {"model": ErrorBody, "description": "`worker_unavailable`: the worker holding it did not answer; retry"}})
async def end_session(session_id: str, request: Request) -> Response:
    state: CoordinatorState = request.app.state.coordinator
    if not _SESSION_ID.fullmatch(session_id):
        raise CoordinatorError(reasons.INVALID_REQUEST, f"session_id: must match {SESSION_ID_PATTERN}")
    tenant = tenant_of(request.scope.get("state", {}))
    key = (tenant, session_id)
    worker_id = state.sessions.worker_of(key)
    record = state.registry.get(worker_id) if worker_id is not None else None
    if record is None:
        state.sessions.forget(key)
        raise CoordinatorError(reasons.UNKNOWN_SESSION, f"no session {session_id!r}")
    status = await state.mover.end(record, session_id, tenant)
    if status is None:
        raise CoordinatorError(reasons.WORKER_UNAVAILABLE,
                               f"the worker holding session {session_id!r} did not answer; try again")
    if status not in (204, 404):
        raise CoordinatorError(reasons.WORKER_UNAVAILABLE, f"the worker holding session {session_id!r} answered "
                               f"{status}; try again")
    state.sessions.forget(key)
    if status == 404:  # it expired there meanwhile
        raise CoordinatorError(reasons.UNKNOWN_SESSION, f"no session {session_id!r}")
    return Response(status_code=204)
