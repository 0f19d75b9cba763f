"""`POST /coordinator/infer`: the project's original streaming API, as one surface over the gateway.

Owns: parsing `protocol.inference.InferRequest` into the internal request, its error body
(`ErrorBody`: error, reason, request id), and its stream format, which is the internal events as the
worker wrote them (protocol/inference.py says why that identity is deliberate); and the OpenAPI
description of the generation routes' bodies, streams and refusals (the OpenAI surface's too).
Must not: admit, schedule or relay (gateway.py and the modules behind it do).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from coordinator.admission import priority
from coordinator.auth import client_of, tenant_of
from coordinator.errors import CoordinatorError, error_headers
from coordinator.gateway import Gateway
from coordinator.generation import Generation
from coordinator.relay.response import RelayResponse, passthrough
from coordinator.relay.supervisor import client_left_of
from coordinator.state import CoordinatorState
from coordinator.validate import describe, read_body, request_id_of
from protocol import reasons
from protocol.inference import ErrorBody, InferRequest
from protocol.worker import (
    EVENT_DONE,
    EVENT_ERROR,
    EVENT_TOKEN,
    REQUEST_ID_HEADER,
    WORKER_ID_HEADER,
    GenerateRequest,
)

SURFACE = "infer"
router = APIRouter()

# The OpenAPI description of the generation routes. app.py's FastPaths serves every POST to them
# before FastAPI's router reads a body, so their body and answers are described here by hand, from
# the same pydantic models the handlers parse with. Every surface refuses with these statuses (the
# table of protocol/inference.http.md, 401 from client API keys, the edge's 408 and 431), each in
# its own error body.
REFUSALS: dict[int, str] = {
    400: "`invalid_request`: malformed JSON, a missing or out-of-range field, or no model named while "
         "several are served and none is the default",
    401: "`unauthorized`: client API keys are configured and the request presents none of them",
    404: "`unknown_model`, `unknown_session` (its worker is gone) or `session_expired`",
    408: "`request_timeout`: the headers or the body did not arrive in time",
    409: "`session_busy`: that session is generating now",
    413: "`prompt_too_long` (more than a session may hold) or `body_too_large`",
    431: "`headers_too_large`: too many or too large headers",
    502: "`worker_unavailable`: every eligible worker tried failed before its first event",
    503: "`no_workers`, `model_unavailable`, `sessions_full`, `kv_full`, `queue_full`, `queue_timeout`, "
         "`loading`, `draining` or `streams_full`; try again after `Retry-After` seconds",
}
REQUEST_ID_PARAMETER: dict[str, Any] = {
    "name": REQUEST_ID_HEADER, "in": "header", "required": False,
    "description": "the request's id in logs, error bodies and the `done` event; otherwise a new one is made",
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"}}
_HEADER: dict[str, Any] = {"schema": {"type": "string"}}


def refusals(error_model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The documented refusals of a generation route, in `error_model`'s shape (JSON)."""
    found: dict[int | str, dict[str, Any]] = {}
    for status, description in REFUSALS.items():
        headers = {REQUEST_ID_HEADER: _HEADER}
        if status == 503:
            headers["retry-after"] = {"required": True, "description": "seconds", **_HEADER}
        found[status] = {"model": error_model, "description": description, "headers": headers}
    return found


def json_body(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its own JSON body."""
    return {"requestBody": {"required": True, "description": description,
                            "content": {"application/json": {"schema": schema}}},
            "parameters": [REQUEST_ID_PARAMETER]}


def event_stream(description: str, events: list[str], data: str) -> dict[str, Any]:
    """A `200` answered as Server-Sent Events: `itemSchema` describes one event (as FastAPI does for
    its own SSE routes, and as OpenAPI 3.2 defines it)."""
    item = {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"type": "string", "enum": events},
                           "data": {"type": "string", "description": data}}}
    return {"description": description,
            "headers": {REQUEST_ID_HEADER: _HEADER, WORKER_ID_HEADER: _HEADER},
            "content": {"text/event-stream": {"itemSchema": item}}}


# `response_class=Response` (no media type) keeps FastAPI from also listing `application/json` for 200.
@router.post("/coordinator/infer", response_model=None, response_class=Response,
             summary="Stream one generation as Server-Sent Events",
             openapi_extra=json_body(InferRequest.model_json_schema(),
                                     "`InferRequest`; unknown fields are refused with 400"),
             responses={200: event_stream(
                 "`token` events, then one `done` event, or an `error` event if the stream cannot finish",
                 [EVENT_TOKEN, EVENT_DONE, EVENT_ERROR],
                 "JSON: `TokenEvent`, `DoneEvent` or `ErrorEvent` (protocol/inference.py)"),
                 **refusals(ErrorBody)})
async def infer(request: Request) -> Response:
    state: CoordinatorState = request.app.state.coordinator
    gateway: Gateway = request.app.state.gateway
    started = gateway.now()
    request_id = request_id_of(request)
    try:
        gen = parse(await read_body(request, state.settings.max_body_bytes), request_id,
                    tenant_of(request.scope.get("state", {})), request.headers.get(priority.HEADER))
    except CoordinatorError as exc:
        gateway.refused(request_id, exc, started, surface=SURFACE)
        raise
    opened = await gateway.open(gen, started, client_gone=lambda: client_left_of(request.receive),
                                client=client_of(request.scope.get("state", {})), headers=request.headers)
    return RelayResponse(opened.relay, headers={REQUEST_ID_HEADER: request_id, WORKER_ID_HEADER: opened.worker_id},
                         ping_interval=state.settings.ping_interval, clock=state.clock, on_end=opened.finish,
                         encoder=passthrough)


def parse(raw: bytes, request_id: str, tenant: str = "", priority_header: str | None = None) -> Generation:
    try:
        body = InferRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc)) from None
    # Same field names and ranges (both build on GenerationFields): only what the client set goes on,
    # and the tenant, which no client sets. The priority class is the coordinator's own.
    fields = body.model_dump(exclude_unset=True)
    named = priority.asked(priority_header, fields.pop("priority", None))
    if tenant:
        fields["tenant"] = tenant
    internal = GenerateRequest.model_validate(fields)
    return Generation.of(internal, request_id, SURFACE, named)


def error_response(request_id: str, exc: CoordinatorError) -> JSONResponse:
    """This surface's error body; `app.py` uses it for every route outside `/v1/`."""
    headers = error_headers(exc, request_id)
    body = ErrorBody(error=exc.message, reason=exc.reason, request_id=request_id)
    return JSONResponse(body.model_dump(), status_code=exc.status, headers=headers)
