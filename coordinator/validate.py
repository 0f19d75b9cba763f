"""The edge of `/coordinator/infer`: raw bytes and headers in, one `ValidRequest` out.

Owns: body size bound, JSON parsing into `InferRequest`, error messages that name the field, the
request id (the client's `X-Request-ID` when well-formed, else a new one), and the payload sent on
to workers. Everything behind this module trusts `ValidRequest`.
Must not: check capacity or choose workers.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.requests import Request

from coordinator.demand import Demand
from coordinator.errors import CoordinatorError
from protocol import reasons
from protocol.inference import InferRequest

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass(frozen=True, slots=True)
class ValidRequest:
    body: InferRequest
    request_id: str
    payload: bytes  # the JSON posted to the worker: only the fields the client set
    demand: Demand


def request_id_of(request: Request) -> str:
    """The request's id, fixed on first use so every later error body repeats it."""
    cached = getattr(request.state, "request_id", None)
    if cached is None:
        given = request.headers.get("x-request-id", "")
        cached = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        request.state.request_id = cached
    return cached


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise CoordinatorError(reasons.PROMPT_TOO_LONG, f"request body over {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise CoordinatorError(reasons.PROMPT_TOO_LONG, f"request body over {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_infer(raw: bytes, request_id: str) -> ValidRequest:
    try:
        body = InferRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc)) from None
    demand = Demand(len(body.prompt.encode()), body.max_tokens)
    payload = body.model_dump_json(exclude_unset=True).encode()
    return ValidRequest(body, request_id, payload, demand)


def describe(exc: ValidationError, limit: int = 5) -> str:
    """'field: problem' for the first few problems, e.g. 'max_tokens: Input should be >= 1'."""
    parts = []
    for err in exc.errors()[:limit]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        if err["type"] == "json_invalid":
            where = "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
