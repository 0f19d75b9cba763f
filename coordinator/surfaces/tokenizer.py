"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, in vLLM's shapes: a prompt's or a chat's
tokens as the model's own tokenizer and chat template make them (what a generation's prompt would count),
token ids back to text, and the tokenizer's special tokens and template (what lm-evaluation-harness's
remote tokenizer reads before it uses the other two).

Owns: parsing protocol/tokens.py's bodies (a chat's messages as the chat surface reads them) into the
work a worker's tokenizer does, and its answer as the worker gave it; a refusal is the coordinator's own
error body, as on its other routes outside /v1/.
Must not: choose, call or judge workers: the gateway does (`Gateway.tokenize`: coordinator/tokenizing.py
chooses the model's workers and tries them in turn). Nor admit, queue or reserve anything: tokenizing
holds no sequence and no KV.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from coordinator.errors import CoordinatorError
from coordinator.gateway import Gateway
from coordinator.state import CoordinatorState
from coordinator.surfaces.infer import json_body
from coordinator.surfaces.openai import internal_messages
from coordinator.validate import describe, read_body, request_id_of
from protocol import reasons
from protocol.inference import ErrorBody
from protocol.openapi import inlined
from protocol.tokens import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    TokenizerInfoRequest,
)
from protocol.worker import (
    DETOKENIZE_PATH,
    REQUEST_ID_HEADER,
    TOKENIZE_PATH,
    TOKENIZER_INFO_PATH,
    WORKER_ID_HEADER,
    ChatMessage,
    TokenizeWork,
)

router = APIRouter()


async def tokenize(request: Request) -> Response:
    """The tokens of `prompt`, or of `messages` rendered as a chat completion's prompt is."""
    body = await _parsed(request, TokenizeRequest)
    assert isinstance(body, TokenizeRequest)
    if not body.add_generation_prompt:
        raise CoordinatorError(reasons.INVALID_REQUEST, "add_generation_prompt: only true is supported (the prompt "
                               "a chat completion would have)", param="add_generation_prompt")
    add_special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
    try:
        messages = None if body.messages is None else [ChatMessage.model_validate(m)
                                                       for m in internal_messages(body.messages)]
        work = TokenizeWork(model=body.model, prompt=body.prompt, messages=messages, add_special=add_special,
                            token_strs=body.return_token_strs)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc)) from None
    return await _ask(request, TOKENIZE_PATH, body.model, work, TokenizeResponse)


async def detokenize(request: Request) -> Response:
    """The text of `tokens` (400 naming the first id outside the model's vocabulary)."""
    body = await _parsed(request, DetokenizeRequest)
    assert isinstance(body, DetokenizeRequest)
    return await _ask(request, DETOKENIZE_PATH, body.model, body, DetokenizeResponse)


async def tokenizer_info(request: Request) -> Response:
    """The model's tokenizer facts (`?model=`; left out: the pool's default model)."""
    try:
        body = TokenizerInfoRequest(model=request.query_params.get("model"))
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc)) from None
    return await _ask(request, TOKENIZER_INFO_PATH, body.model, body, TokenizerInfo)


async def _parsed(request: Request, model: type[BaseModel]) -> BaseModel:
    state: CoordinatorState = request.app.state.coordinator
    raw = await read_body(request, state.settings.max_body_bytes)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc)) from None


async def _ask(request: Request, path: str, named: str | None, work: BaseModel, answer: type[BaseModel]) -> Response:
    """`work` for the model `named`, through the gateway; the worker's answer, checked, as it came."""
    gateway: Gateway = request.app.state.gateway
    request_id = request_id_of(request)
    tokenized = await gateway.tokenize(path, named, work, answer, request_id)
    return JSONResponse(tokenized.answer, headers={REQUEST_ID_HEADER: request_id,
                                                   WORKER_ID_HEADER: tokenized.worker_id})


def _described(body: type[BaseModel], answer: type[BaseModel], summary: str) -> dict[str, Any]:
    """The route's OpenAPI description: it reads its own body; refusals in the coordinator's error body."""
    refusals: dict[int | str, str] = {
        400: "`invalid_request` (the field named)", 401: "`unauthorized`", 404: "`unknown_model`",
        408: "`request_timeout`: the headers or the body did not arrive in time", 413: "`body_too_large`",
        431: "`headers_too_large`", 500: "`internal`", 502: "`worker_unavailable`: no worker of the model answered",
        503: "`no_workers` or `model_unavailable`, with Retry-After"}
    return {"summary": summary, "response_model": None, "response_class": JSONResponse,
            "responses": {200: {"model": answer}} | {status: {"model": ErrorBody, "description": text}
                                                      for status, text in refusals.items()},
            "openapi_extra": json_body(inlined(body), body.__name__)}


def _info_described() -> dict[str, Any]:
    described = _described(TokenizerInfoRequest, TokenizerInfo, "The tokenizer's special tokens and chat template "
                           "(vLLM's shape)")
    # No body: the model comes as a query parameter.
    described["openapi_extra"] = {"parameters": [{"name": "model", "in": "query", "required": False,
                                                  "schema": {"type": "string", "maxLength": 256}}]}
    return described


PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})  # each needs a key where API_KEYS is set
router.add_api_route("/tokenize", tokenize, methods=["POST"],
                     **_described(TokenizeRequest, TokenizeResponse, "A prompt's or a chat's tokens (vLLM's shape)"))
router.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"],
                     **_info_described())
router.add_api_route("/detokenize", detokenize, methods=["POST"],
                     **_described(DetokenizeRequest, DetokenizeResponse, "Token ids back to text (vLLM's shape)"))
