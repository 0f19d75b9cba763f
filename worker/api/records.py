"""Stored Responses records on this worker: `PUT`, `GET` and `DELETE /worker/responses/{id}?tenant=...`.

Owns: the three routes (worker token required, as on every route but health) and their bounds (a body at
most the tenant's byte bound, 413 before it is kept; a tenant's records within worker/sessions/records.py's
bounds); and the handover of a draining worker's records (`POST /worker/responses/handover`: each taken
once, so of the coordinators that see the drain one moves each). The coordinator writes a record as a response ends, before its client sees the end; any
coordinator reads it to continue the chain (`previous_response_id`), to answer `GET /v1/responses/{id}`
and its input items, and deletes it.
Must not: read what a record says (it is the coordinator's JSON), or touch sessions and KV.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response

from protocol import reasons
from protocol.worker import (
    RESPONSE_ID_PATTERN,
    RESPONSES_HANDOVER_PATH,
    RESPONSES_PATH,
    TENANT_PATTERN,
    ErrorBody,
)
from worker.api.routes import authorize
from worker.errors import WorkerError
from worker.sessions.records import Records, TooLarge

PATH = RESPONSES_PATH + "/{response_id}"

router = APIRouter()
_ID = Path(pattern=RESPONSE_ID_PATTERN)
_TENANT = Query("", pattern=TENANT_PATTERN, description="the tenant whose response it is (\"\" without API keys)")
_REFUSALS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "`invalid_request`: a malformed id or tenant"},
    401: {"model": ErrorBody, "description": "`unauthorized`"},
    404: {"model": ErrorBody, "description": "`unknown_response`: this tenant has no such record here"},
}


@router.post(RESPONSES_HANDOVER_PATH, summary="Hand stored responses over (a drain moves them)",
             response_class=Response, responses={
                 200: {"description": "`{\"records\": [{\"tenant\", \"response_id\", \"record\"}]}`",
                       "content": {"application/json": {"schema": {"type": "object"}}}},
                 400: {"model": ErrorBody, "description": "`invalid_request`: max_bytes out of range"},
                 401: {"model": ErrorBody, "description": "`unauthorized`"}})
async def hand_over(request: Request, max_bytes: int = Query(8 << 20, ge=1, le=1 << 30)) -> Response:
    """`{"records": [{"tenant", "response_id", "record"}]}`, oldest first, at most
    `max_bytes` of records (at least one); none left here: an empty list. Each is forgotten here."""
    authorize(request)
    records = records_of(request)
    parts = [b'{"tenant":%s,"response_id":%s,"record":%s}' % (
        json.dumps(tenant).encode(), json.dumps(response_id).encode(), record.body) for (tenant, response_id), record in records.take(max_bytes)]
    return Response(b'{"records":[' + b",".join(parts) + b"]}", media_type="application/json")


def records_of(request: Request) -> Records:
    kept: Records = request.app.state.records
    return kept


@router.put(PATH, status_code=204, summary="Keep a stored response's record", responses={
    **_REFUSALS, 413: {"model": ErrorBody, "description": "`body_too_large`: over the tenant's byte bound"}},
    openapi_extra={"requestBody": {"required": True, "description": "the record: a JSON object, as the coordinator "
                                   "made it", "content": {"application/json": {"schema": {"type": "object"}}}}})
async def put_record(request: Request, response_id: str = _ID, tenant: str = _TENANT) -> Response:
    authorize(request)
    records = records_of(request)
    body = await request.body()  # bounded by the server's WORKER_MAX_BODY_BYTES
    try:
        records.fits(body)
    except TooLarge as exc:
        raise WorkerError(reasons.BODY_TOO_LARGE, str(exc)) from None
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise WorkerError(reasons.INVALID_REQUEST, "a record is a JSON object")
    records.put((tenant, response_id), body)
    records.sweep()
    return Response(status_code=204)


@router.get(PATH, summary="A stored response's record", response_class=Response, responses={
    200: {"description": "the record, as it was kept", "content": {"application/json": {"schema": {"type": "object"}}}},
    **_REFUSALS})
async def get_record(request: Request, response_id: str = _ID, tenant: str = _TENANT) -> Response:
    authorize(request)
    record = records_of(request).get((tenant, response_id))
    if record is None:
        raise WorkerError(reasons.UNKNOWN_RESPONSE, f"no stored response {response_id!r} here")
    return Response(record.body, media_type="application/json")


@router.delete(PATH, status_code=204, summary="Forget a stored response", responses=_REFUSALS)
async def delete_record(request: Request, response_id: str = _ID, tenant: str = _TENANT) -> Response:
    authorize(request)
    if not records_of(request).delete((tenant, response_id)):
        raise WorkerError(reasons.UNKNOWN_RESPONSE, f"no stored response {response_id!r} here")
    return Response(status_code=204)
