"""What every surface's edge shares: the request id, the bounded body read, and validation messages.

Owns: the body size bound, error messages that name the field, and the request id (the client's
`X-Request-ID` when well-formed, else a new one).
Must not: know any surface's request type (coordinator/surfaces/ parse their own).
"""

from __future__ import annotations

import re
import uuid

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request

from coordinator.errors import CoordinatorError
from protocol import reasons
from protocol.worker import REQUEST_ID_HEADER

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_of(request: Request) -> str:
    """The request's id, fixed on first use so every later error body repeats it."""
    cached = getattr(request.state, "request_id", None)
    if cached is None:
        given = request.headers.get(REQUEST_ID_HEADER, "")
        cached = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        request.state.request_id = cached
    return cached


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise CoordinatorError(reasons.BODY_TOO_LARGE, f"request body over {max_bytes} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise CoordinatorError(reasons.BODY_TOO_LARGE, f"request body over {max_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # An ordinary event (the client gave up mid-body): a log line and a count, not a traceback.
        raise CoordinatorError(reasons.CLIENT_GONE, "the client went away while sending its request") from None
    return b"".join(chunks)


def first_field(exc: ValidationError) -> str | None:
    """The dotted path of the first field at fault (OpenAI's `param`), None for the body itself."""
    for err in exc.errors()[:1]:
        if err["type"] != "json_invalid" and err["loc"]:
            return ".".join(str(p) for p in err["loc"])
    return None


def describe(exc: ValidationError, limit: int = 5) -> str:
    """'field: problem' for the first few problems, e.g. 'max_tokens: Input should be >= 1'."""
    parts = []
    for err in exc.errors()[:limit]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        if err["type"] == "json_invalid":
            where = "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
