"""`POST /coordinator/infer`: the project's original streaming API, as one surface over the gateway.

Owns: parsing `protocol.inference.InferRequest` into the internal request, its error body
(`ErrorBody`: error, reason, request id), and its stream format, which is the internal events as the
worker wrote them (protocol/inference.py says why that identity is deliberate).
Must not: admit, schedule or relay (gateway.py and the modules behind it do).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from coordinator.errors import CoordinatorError, error_headers
from coordinator.gateway import Gateway
from coordinator.generation import Generation
from coordinator.response import RelayResponse, client_left_of, passthrough
from coordinator.state import CoordinatorState
from coordinator.validate import describe, read_body, request_id_of
from protocol import reasons
from protocol.inference import ErrorBody, InferRequest
from protocol.worker import REQUEST_ID_HEADER, WORKER_ID_HEADER, GenerateRequest

SURFACE = "infer"
router = APIRouter()


@router.post("/coordinator/infer", response_model=None)
async def infer(request: Request) -> Response:
    state: CoordinatorState = request.app.state.coordinator
    gateway: Gateway = request.app.state.gateway
    started = gateway.now()
    request_id = request_id_of(request)
    try:
        gen = parse(await read_body(request, state.settings.max_body_bytes), request_id)
    except CoordinatorError as exc:
        gateway.refused(request_id, exc, started, surface=SURFACE)
        raise
    opened = await gateway.open(gen, started, client_gone=lambda: client_left_of(request.receive))
    return RelayResponse(opened.relay, headers={REQUEST_ID_HEADER: request_id, WORKER_ID_HEADER: opened.worker_id},
                         ping_interval=state.settings.ping_interval, clock=state.clock, on_end=opened.finish,
                         encoder=passthrough)


def parse(raw: bytes, request_id: str) -> Generation:
    try:
        body = InferRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc)) from None
    # Same field names and ranges (both build on GenerationFields): only what the client set goes on.
    internal = GenerateRequest.model_validate(body.model_dump(exclude_unset=True))
    return Generation.of(internal, request_id, SURFACE)


def error_response(request_id: str, exc: CoordinatorError) -> JSONResponse:
    """This surface's error body; `app.py` uses it for every route outside `/v1/`."""
    headers = error_headers(exc, request_id)
    body = ErrorBody(error=exc.message, reason=exc.reason, request_id=request_id)
    return JSONResponse(body.model_dump(), status_code=exc.status, headers=headers)
