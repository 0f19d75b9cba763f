"""The model's tokenizer over HTTP: `POST /worker/tokenize`, `POST /worker/detokenize` and `POST
/worker/tokenizer_info` (what the coordinator's `/tokenize`, `/detokenize` and `/tokenizer_info` ask of one
worker of the model).

Owns: the three routes (worker token required, as on every route but health) and their answers.
Must not: tokenize itself (worker/admission.py's `Gate` does, as it tokenizes a generation's prompt:
the same template, off the event loop, among the prompts being tokenized).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from protocol.tokens import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeResponse,
    TokenizerInfo,
    TokenizerInfoRequest,
)
from protocol.worker import (
    DETOKENIZE_PATH,
    REQUEST_ID_HEADER,
    TOKENIZE_PATH,
    TOKENIZER_INFO_PATH,
    ErrorBody,
    TokenizeWork,
)
from worker.api.routes import authorize, request_id_of, runtime_of

router = APIRouter()
_REFUSED: dict[int | str, str] = {
    400: "`invalid_request`: a conversation the template refuses, or a token id outside the vocabulary (named)",
    401: "`unauthorized`",
    404: "`unknown_model`",
    413: "`body_too_large`",
    503: "`draining`",
    "4XX": "any other refusal (`request_timeout`, `headers_too_large`, an unknown method)",
}
_REFUSALS: dict[int | str, dict[str, Any]] = {status: {"model": ErrorBody, "description": text}
                                              for status, text in _REFUSED.items()}


@router.post(TOKENIZE_PATH, response_model=TokenizeResponse, responses=_REFUSALS)
async def tokenize(body: TokenizeWork, request: Request) -> JSONResponse:
    authorize(request)
    request_id = request.state.request_id = request_id_of(request)
    answer = await runtime_of(request).gate.tokenize(body)
    return JSONResponse(answer.model_dump(), headers={REQUEST_ID_HEADER: request_id})


@router.post(TOKENIZER_INFO_PATH, response_model=TokenizerInfo, responses=_REFUSALS)
async def tokenizer_info(body: TokenizerInfoRequest, request: Request) -> JSONResponse:
    authorize(request)
    request_id = request.state.request_id = request_id_of(request)
    answer = runtime_of(request).gate.tokenizer_info(body)
    return JSONResponse(answer.model_dump(), headers={REQUEST_ID_HEADER: request_id})


@router.post(DETOKENIZE_PATH, response_model=DetokenizeResponse, responses=_REFUSALS)
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    authorize(request)
    request_id = request.state.request_id = request_id_of(request)
    text = await runtime_of(request).gate.detokenize(body)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump(), headers={REQUEST_ID_HEADER: request_id})
