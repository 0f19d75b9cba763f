"""OpenAI's Responses API: `POST /v1/responses`, text in and text out, streamed or not.

Owns: parsing `protocol.openai_responses.ResponsesRequest` into the internal request (`instructions`
and the input's messages become chat messages, which the worker renders with the model's own
template), the refusals of what this pool does not implement (every field in `UNSUPPORTED` with a
value that would change the answer, `text.format` other than text, items other than messages,
parts other than text), choosing a streamed (`EventEncoder`) or collected (`assemble`) answer, and
the OpenAPI description of the route (the body narrowed to what the parser here accepts).
Must not: admit, schedule or relay (the gateway does, exactly as for chat completions), or shape
errors its own way: refusals are the OpenAI surface's (`openai.error_response`), as on every `/v1/` route.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from coordinator.errors import CoordinatorError
from coordinator.relay.collect import CollectedResponse
from coordinator.relay.response import RelayResponse
from coordinator.state import CoordinatorState
from coordinator.surfaces.infer import event_stream, json_body, refusals
from coordinator.surfaces.openai import open_generation
from coordinator.surfaces.responses_format import Echo, EventEncoder, Shape, assemble
from coordinator.validate import describe, first_field
from protocol import openai as oa
from protocol import openai_responses as rs
from protocol import reasons
from protocol.openapi import inlined
from protocol.worker import MAX_PROMPT_CHARS, REQUEST_ID_HEADER, WORKER_ID_HEADER

PATH = "/v1/responses"
SURFACE = "openai-responses"
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Fields that name state kept between requests; this pool keeps none.
_STATEFUL = frozenset({"previous_response_id", "conversation", "prompt", "background"})

router = APIRouter()


async def create(request: Request) -> Response:
    found = await open_generation(request, SURFACE, parse)
    if isinstance(found, Response):
        return found
    opened, gen, echo = found
    state: CoordinatorState = request.app.state.coordinator
    request_id = gen.request_id
    # Sampling as the worker applies it: the client's value, or the default both sides share.
    echo = dataclasses.replace(echo, temperature=gen.request.temperature, top_p=gen.request.top_p)
    shape = Shape(echo, request_id, int(state.clock.time()), opened.model)
    headers = {REQUEST_ID_HEADER: request_id, WORKER_ID_HEADER: opened.worker_id}
    if echo.stream:
        return RelayResponse(opened.relay, headers=headers, ping_interval=state.settings.ping_interval,
                             clock=state.clock, on_end=opened.finish,
                             encoder=EventEncoder(shape, now=state.clock.time))
    return CollectedResponse(opened.relay, on_end=opened.finish, now=state.clock.monotonic,
                             assemble=lambda events: assemble(shape, events, headers=headers, now=state.clock.time))


def parse(raw: bytes) -> tuple[dict[str, Any], Echo]:
    """The internal request's fields (only what the client set, and `probabilities: false`: no
    logprobs are offered here, so the worker skips each token's softmax) and what the answer repeats."""
    try:
        body = rs.ResponsesRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc), param=first_field(exc)) from None
    _refuse_unsupported(body)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += [_message(item, index) for index, item in enumerate(body.input)]
    fields: dict[str, Any] = {"messages": messages, "max_tokens": body.max_output_tokens or oa.MAX_COMPLETION_TOKENS,
                              "probabilities": False}
    for name in ("model", "temperature", "top_p", "seed", "session_id", "top_k", "ignore_eos"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    tool_choice: rs.ToolChoice = "none" if (body.model_extra or {}).get("tool_choice") == "none" else "auto"
    echo = Echo(stream=body.stream, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
                parallel_tool_calls=body.parallel_tool_calls is not False, tool_choice=tool_choice,
                user=body.user, metadata=body.metadata or {})
    return fields, echo


def _refuse_unsupported(body: rs.ResponsesRequest) -> None:
    for name, value in (body.model_extra or {}).items():
        harmless = rs.UNSUPPORTED.get(name)
        if harmless is None or harmless(value):
            continue
        if name in _STATEFUL:
            raise _invalid(f"{name}: this pool stores no responses, conversations or prompts; send the whole "
                           "conversation as `input`", name)
        raise _invalid(f"{name}: not supported by this pool yet; an answer made without it would not be what "
                       "the request asks for, so leave it out", name)
    if body.text is not None and body.text.format not in (None, rs.TEXT_FORMAT):
        raise _invalid('text.format: only {"type": "text"} is supported (no JSON mode or schema yet)', "text.format")


def _message(item: rs.InputItem, index: int) -> dict[str, str]:
    where = f"input.{index}"
    if item.type != rs.INPUT_ITEM_TYPE:
        raise _invalid(f"{where}.type: only message items are supported, not {item.type!r} (no tool calls, "
                       "no references to stored items)", f"{where}.type")
    role = ROLES.get(item.role or "")
    if role is None:
        raise _invalid(f"{where}.role: {item.role!r} is not supported (use one of {', '.join(ROLES)})",
                       f"{where}.role")
    if item.content is None:
        raise _invalid(f"{where}.content: a message needs its content", f"{where}.content")
    texts = []
    for part in item.content:
        if part.type not in rs.INPUT_PART_TYPES or part.text is None:
            raise _invalid(f"{where}.content: only text parts are supported ({', '.join(rs.INPUT_PART_TYPES)}), "
                           f"not {part.type!r}", f"{where}.content")
        texts.append(part.text)
    return {"role": role, "content": "".join(texts)}



def _invalid(message: str, param: str) -> CoordinatorError:
    return CoordinatorError(reasons.INVALID_REQUEST, message, param=param)


def _body() -> dict[str, Any]:
    """`ResponsesRequest` as `parse` takes it: `input` a string or message items with text parts, and
    the refused fields only with their harmless values."""
    schema = inlined(rs.ResponsesRequest)
    properties = schema["properties"]
    text = {"type": "string", "maxLength": MAX_PROMPT_CHARS}
    items = properties["input"]
    item = items["items"]
    part = item["properties"]["content"]["anyOf"][0]["items"]
    part["properties"]["type"]["enum"] = list(rs.INPUT_PART_TYPES)
    part["properties"]["text"] = text
    part["required"] = ["type", "text"]
    item["properties"]["type"]["enum"] = [rs.INPUT_ITEM_TYPE]
    item["properties"]["role"] = {"type": "string", "enum": list(ROLES)}
    item["properties"]["content"] = {"anyOf": [text, item["properties"]["content"]["anyOf"][0]]}
    item["required"] = ["role", "content"]
    properties["input"] = {"anyOf": [text, items], "description": items.pop("description", "")}
    properties["text"] = {"anyOf": [{"type": "object", "properties": {"format": {
        "type": "object", "required": ["type"], "properties": {"type": {"type": "string", "enum": ["text"]}}}}},
        {"type": "null"}]}
    properties.update(
        tool_choice={"type": "string", "enum": list(rs.TOOL_CHOICES), "description": "no tools"},
        tools={"type": "array", "maxItems": 0, "items": {}, "description": "not supported"},
        truncation={"type": "string", "enum": ["disabled"], "description": "only `disabled`"})
    return schema


# Registered so the OpenAPI schema lists it and other methods get 405; app.py's fast path serves every
# POST to it before the router is reached.
router.add_api_route(
    PATH, create, methods=["POST"], summary="Create a model response (OpenAI's Responses API)",
    response_model=None, response_class=Response,
    openapi_extra=json_body(_body(), "`ResponsesRequest`; unknown fields are ignored"),
    responses={200: {**event_stream("`ResponseObject` JSON, or with `stream: true` Server-Sent Events",
                                    list(rs.STREAM_EVENTS), "JSON: the event, its `type` the event's name"),
                     "model": rs.ResponseObject},
               **refusals(oa.ErrorResponse)})
