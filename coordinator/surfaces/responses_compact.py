"""`POST /v1/responses/compact` (OpenAI's and Open Responses' compaction): a conversation in, a window
of output items out that a later request sends back as its input, with no `previous_response_id`.

Owns: reading the compact request (`model` required, `input` and/or the stored response
`previous_response_id` names), checking the conversation parses as a Responses request would parse it
(a bad item is refused here, not at the turn that sends the window back), and the answer: one
`compaction` item standing for the whole conversation (`protocol.openai_responses.compaction_of`).
Must not: run a model or keep anything. The pool does not summarize: the window carries the
conversation whole (as base64url JSON, not encrypted), so the turn given it back prefills the same
conversation and answers as it would have; usage is 0 tokens, since no model read anything.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from coordinator.auth import tenant_of
from coordinator.errors import CoordinatorError
from coordinator.state import CoordinatorState
from coordinator.surfaces import responses, responses_stored
from coordinator.surfaces.infer import json_body, refusals
from coordinator.surfaces.openai import error_response
from coordinator.validate import describe, first_field, read_body, request_id_of
from protocol import openai as oa
from protocol import openai_responses as rs
from protocol import reasons

PATH = responses.PATH + "/compact"

router = APIRouter()


async def compact(request: Request) -> Response:
    state: CoordinatorState = request.app.state.coordinator
    request_id = request_id_of(request)
    try:
        body = _read(await read_body(request, state.settings.max_body_bytes))
        items = await _conversation(state, body, tenant_of(request.scope.get("state", {})))
    except CoordinatorError as exc:
        return error_response(request_id, exc)
    none = rs.ResponseUsage(input_tokens=0, output_tokens=0, total_tokens=0,
                            input_tokens_details=rs.InputTokensDetails(cached_tokens=0))
    answer = rs.CompactResponse(id=rs.COMPACTION_ID_PREFIX + request_id, created_at=int(state.clock.time()),
                                output=[rs.compaction_of(items, rs.COMPACTION_ID_PREFIX + request_id)], usage=none)
    return JSONResponse(answer.model_dump())


def _read(raw: bytes) -> rs.CompactRequest:
    try:
        return rs.CompactRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc), param=first_field(exc)) from None


async def _conversation(state: CoordinatorState, body: rs.CompactRequest, tenant: str) -> list[dict[str, Any]]:
    """The items to compact: the stored conversation `previous_response_id` names, then `input`;
    checked as a Responses request's input."""
    given = body.input if body.input is not None else []
    items: list[dict[str, Any]] = [{"role": "user", "content": given}] if isinstance(given, str) else list(given)
    if body.previous_response_id is not None:
        _, record = await responses_stored.stored(state, tenant, body.previous_response_id)
        items = [*record.get("items", []), *items]
    if not items:
        raise CoordinatorError(reasons.INVALID_REQUEST, "input: give the conversation to compact (or "
                               "previous_response_id)", param="input")
    responses.parse(json.dumps({"model": body.model, "input": items}).encode())
    return items


router.add_api_route(
    PATH, compact, methods=["POST"], summary="Compact a conversation into a window to send back as input",
    response_model=None, response_class=Response,
    openapi_extra=json_body(rs.CompactRequest.model_json_schema(), "`CompactRequest`; unknown fields are ignored"),
    responses={200: {"model": rs.CompactResponse}, **refusals(oa.ErrorResponse)})
