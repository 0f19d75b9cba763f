"""OpenAI's embeddings surface: `POST /v1/embeddings`.

Owns: parsing OpenAI's body (`protocol.openai_embeddings`) into the internal `Embedding`, bounded by
the settings (`EMBEDDING_MAX_INPUTS` inputs, `EMBEDDING_MAX_BYTES` of text together: more is a 400
naming the limit); the refusals by name; encoding the answer in input order as `float` lists or
as `base64` (little-endian float32, which the worker sends and which OpenAI's client decodes), with
usage; and the OpenAPI description of the route. Errors take OpenAI's shape (surfaces/openai.py).
Must not: admit, schedule or dispatch (gateway.py does, as for every surface).

Token-id inputs (a list of integers, or a list of such lists) are refused with 400 `param: "input"`:
a client sends ids of its own tokenizer (OpenAI's tiktoken, for LangChain's default client), which
would be read as ids of this model's vocabulary, another one; the vectors would be of other text.
`dimensions` is served only at the model's own size: vectors pooled from a generation model are not
trained to keep their meaning when cut short, so a shorter size is refused rather than made up.
"""

from __future__ import annotations

import array
import base64
import sys
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from coordinator.auth import client_of, tenant_of
from coordinator.embedding import Embedding
from coordinator.errors import CoordinatorError
from coordinator.gateway import Gateway
from coordinator.relay.supervisor import client_left_of
from coordinator.settings import Settings
from coordinator.state import CoordinatorState
from coordinator.surfaces.infer import json_body
from coordinator.surfaces.openai import error_response
from coordinator.validate import describe, first_field, read_body, request_id_of
from protocol import openai as oa
from protocol import reasons
from protocol.openai_embeddings import EmbeddingList, EmbeddingRequest
from protocol.openapi import inlined
from protocol.worker import (
    MAX_EMBED_INPUTS,
    MAX_PROMPT_CHARS,
    REQUEST_ID_HEADER,
    WORKER_ID_HEADER,
    EmbedRequest,
    EmbedResponse,
)

PATH = "/v1/embeddings"
SURFACE = "openai-embeddings"
router = APIRouter()


async def create(request: Request) -> Response:
    state: CoordinatorState = request.app.state.coordinator
    gateway: Gateway = request.app.state.gateway
    started = gateway.now()
    request_id = request_id_of(request)
    try:
        body, encoding = parse(await read_body(request, state.settings.max_body_bytes), state.settings)
        tenant = tenant_of(request.scope.get("state", {}))
        if tenant:
            body["tenant"] = tenant
        work = Embedding.of(EmbedRequest.model_validate(body), request_id, SURFACE)
    except CoordinatorError as exc:
        gateway.refused(request_id, exc, started, surface=SURFACE)
        return _error(request_id, exc)
    try:
        answer = await gateway.embed(work, started, client_gone=lambda: client_left_of(request.receive),
                                     client=client_of(request.scope.get("state", {})), headers=request.headers)
    except CoordinatorError as exc:
        return _error(request_id, exc)
    response = answer.response
    return JSONResponse(encode(response, encoding), headers={REQUEST_ID_HEADER: request_id,
                                                             WORKER_ID_HEADER: response.worker_id})


def parse(raw: bytes, settings: Settings) -> tuple[dict[str, Any], str]:
    """The internal request's fields (only those the client set) and the encoding asked for."""
    try:
        body = EmbeddingRequest.model_validate_json(raw)
    except ValidationError as exc:
        field = first_field(exc) or ""
        if field.startswith("input"):  # a union's path names its branches: name the field only
            raise _invalid(f"input: a string or a list of 1 to {settings.embedding_max_inputs} strings", "input")
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc), param=first_field(exc)) from None
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise _invalid("input: give at least one text", "input")
    if not all(isinstance(text, str) for text in texts):
        raise _invalid("input: token ids are not accepted (they would be read as this model's vocabulary, "
                       "which is not your tokenizer's); send the text", "input")
    strings: list[str] = texts  # type: ignore[assignment]
    for i, text in enumerate(strings):
        if not text:
            raise _invalid(f"input.{i}: must not be empty", "input")
    if len(strings) > settings.embedding_max_inputs:
        raise _invalid(f"input: {len(strings)} inputs, more than this pool embeds in one request "
                       f"(EMBEDDING_MAX_INPUTS={settings.embedding_max_inputs})", "input")
    size = sum(len(text.encode()) for text in strings)
    if size > settings.embedding_max_bytes:
        raise _invalid(f"input: {size} bytes of text, more than this pool embeds in one request "
                       f"(EMBEDDING_MAX_BYTES={settings.embedding_max_bytes})", "input")
    fields: dict[str, Any] = {"inputs": strings}
    if body.model is not None:
        fields["model"] = body.model
    if body.dimensions is not None:
        fields["dimensions"] = body.dimensions
    return fields, body.encoding_format


def encode(response: EmbedResponse, encoding: str) -> dict[str, Any]:
    """OpenAI's `list` of `embedding` objects, in input order, with the inputs' tokens as usage."""
    vectors: list[Any] = response.embeddings if encoding == "base64" else [_floats(v) for v in response.embeddings]
    tokens = sum(response.prompt_tokens)
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "model": response.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _floats(encoded: str) -> list[float]:
    values = array.array("f", base64.b64decode(encoded))
    if sys.byteorder == "big":
        values.byteswap()  # the wire is little-endian
    return values.tolist()


def _invalid(message: str, param: str) -> CoordinatorError:
    return CoordinatorError(reasons.INVALID_REQUEST, message, param=param)


def _error(request_id: str, exc: CoordinatorError) -> JSONResponse:
    """OpenAI's error shape (an input too long is its 400 `context_length_exceeded`), naming the field."""
    if exc.param is None:
        param = {reasons.PROMPT_TOO_LONG: "input", reasons.EMBEDDINGS_UNSUPPORTED: "model"}.get(exc.reason)
        if param is not None:
            exc = CoordinatorError(exc.reason, exc.message, status=exc.status, retry_after=exc.retry_after,
                                   param=param)
    return error_response(request_id, exc)


# -- the OpenAPI description -------------------------------------------------------------------------

_REFUSALS: dict[int, str] = {
    400: "`invalid_request` (`param` names the field: an empty or token-id `input`, more inputs or bytes "
         "than the pool's limits, a `dimensions` other than the model's), `context_length_exceeded` (an "
         "input longer than the model embeds; never cut), or `embeddings_unsupported` (no worker of the "
         "model serves embeddings)",
    401: "`unauthorized`: client API keys are configured and the request presents none of them",
    404: "`unknown_model`",
    408: "`request_timeout`: the headers or the body did not arrive in time",
    413: "`body_too_large`",
    431: "`headers_too_large`",
    500: "`internal`",
    502: "`worker_unavailable` or `worker_failed`: every eligible worker tried failed",
    503: "`no_workers`, `model_unavailable`, `embeddings_full`, `queue_full`, `queue_timeout` or `draining`; "
         "try again after `Retry-After` seconds",
    504: "`deadline_exceeded`: not embedded within EMBEDDING_TIMEOUT",
}


def _body() -> dict[str, Any]:
    """The body as `parse` takes it: text only (one string, or a list of them)."""
    schema = inlined(EmbeddingRequest)
    text = {"type": "string", "minLength": 1, "maxLength": MAX_PROMPT_CHARS}
    schema["properties"]["input"] = {"anyOf": [text, {"type": "array", "items": text, "minItems": 1,
                                                      "maxItems": MAX_EMBED_INPUTS}],
                                     "description": "at most EMBEDDING_MAX_INPUTS texts (256 by default) and "
                                                    "EMBEDDING_MAX_BYTES together (more: 400); token-id forms: 400"}
    return schema


def _responses() -> dict[int | str, dict[str, Any]]:
    header = {"schema": {"type": "string"}}
    found: dict[int | str, dict[str, Any]] = {200: {
        "model": EmbeddingList, "description": "one embedding per input, in input order",
        "headers": {REQUEST_ID_HEADER: header, WORKER_ID_HEADER: header}}}
    for status, description in _REFUSALS.items():
        headers: dict[str, dict[str, Any]] = {REQUEST_ID_HEADER: header}
        if status == 503:
            headers["retry-after"] = {"required": True, **header}
        found[status] = {"model": oa.ErrorResponse, "description": description, "headers": headers}
    return found


router.add_api_route(PATH, create, methods=["POST"], summary="Embeddings (OpenAI's API)", response_model=None,
                     response_class=JSONResponse, responses=_responses(),
                     openapi_extra=json_body(_body(), "`EmbeddingRequest`; unknown fields are ignored"))
