"""OpenAI's Responses API: `POST /v1/responses`, text and function calls, streamed or not.

Owns: parsing `protocol.openai_responses.ResponsesRequest` into the internal request (`instructions`
and the input's messages become chat messages, which the worker renders with the model's own
template; function tools go to the worker with the request, earlier calls and their outputs as an
assistant's calls and `tool` turns, which the worker writes in its model's tool format, as on the
chat route; `text.format` `json_object` or `json_schema`
holds the answer to a schema), the refusals of what this pool does not implement (every field in
`UNSUPPORTED` with a value that would change the answer, hosted tools, items other than messages and
function calls, parts other than text, a `function_call_output` answering no call of the conversation;
a `compaction` window from responses_compact.py is its items by the time the body is parsed), choosing a streamed (`EventEncoder`) or collected (`assemble`) answer, and
the OpenAPI description of the route (the body narrowed to what the parser here accepts). `reasoning` is
accepted and repeated (the models served have no thinking switch to set); hosted tools and Codex's
`namespace` groups are accepted and listed back, but not offered to the model, which could not run them;
earlier `reasoning` items in the input are left out of the conversation.
Must not: admit, schedule or relay (the gateway does, exactly as for chat completions), or shape
errors its own way: refusals are the OpenAI surface's (`openai.error_response`), as on every `/v1/` route.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from coordinator.auth import tenant_of
from coordinator.errors import CoordinatorError
from coordinator.gateway import Gateway
from coordinator.generation import Generation
from coordinator.relay.collect import CollectedResponse
from coordinator.relay.response import RelayResponse
from coordinator.relay.supervisor import client_left_of
from coordinator.stages.ending import Opened
from coordinator.state import CoordinatorState
from coordinator.surfaces import responses_stored as stored
from coordinator.surfaces.infer import event_stream, json_body, refusals
from coordinator.surfaces.openai import Asker, error_response, keep_alive_seconds, open_parsed
from coordinator.surfaces.responses_format import Echo, EventEncoder, Shape, assemble
from coordinator.surfaces.tools import Tools, called, choose, offer
from coordinator.validate import describe, first_field, read_body, request_id_of
from protocol import openai as oa
from protocol import openai_responses as rs
from protocol import reasons
from protocol.openapi import inlined
from protocol.sse import SseEvent
from protocol.worker import MAX_MESSAGES, MAX_PROMPT_CHARS, REQUEST_ID_HEADER, WORKER_ID_HEADER

PATH = "/v1/responses"
SURFACE = "openai-responses"
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Fields that name state kept between requests that this pool does not keep (stored responses it keeps:
# responses_stored.py takes `previous_response_id` out before the body is parsed).
_STATEFUL = frozenset({"previous_response_id", "conversation", "prompt", "background"})

router = APIRouter()


async def create(request: Request) -> Response:
    state: CoordinatorState = request.app.state.coordinator
    gateway: Gateway = request.app.state.gateway
    started = gateway.now()
    request_id = request_id_of(request)
    asker = Asker(request_id, SURFACE, request.headers, request.scope.get("state", {}))
    tenant = tenant_of(asker.scope_state)
    try:
        raw = await read_body(request, state.settings.max_body_bytes)
        turn = await stored.prepare(state, raw, tenant)
        opened, gen, echo = await _open(gateway, raw, turn, asker, started, request)
    except CoordinatorError as exc:
        gateway.refused(request_id, exc, started, surface=SURFACE)
        return error_response(request_id, exc)
    # Sampling as the worker applies it: the client's value, or the default both sides share.
    echo = dataclasses.replace(echo, temperature=gen.request.temperature, top_p=gen.request.top_p)
    if turn is not None:
        echo = dataclasses.replace(echo, store=turn.store, previous_response_id=turn.previous)
    shape = Shape(echo, request_id, int(state.clock.time()), opened.model)
    headers = {REQUEST_ID_HEADER: request_id, WORKER_ID_HEADER: opened.worker_id}
    answer: Response
    ended: list[rs.ResponseObject | None] = [None]
    if echo.stream:
        encoder = EventEncoder(shape, now=state.clock.time)
        answer = RelayResponse(opened.relay, headers=headers, ping_interval=state.settings.ping_interval,
                               clock=state.clock, on_end=opened.finish, encoder=encoder)
        ended_of: Callable[[], rs.ResponseObject | None] = lambda: encoder.ended
    else:
        def assembled(events: list[SseEvent]) -> Response:
            response = assemble(shape, events, headers=headers, now=state.clock.time)
            if response.status_code == 200:
                ended[0] = rs.ResponseObject.model_validate_json(bytes(response.body))
            return response

        answer = CollectedResponse(opened.relay, on_end=opened.finish, now=state.clock.monotonic, assemble=assembled)
        ended_of = lambda: ended[0]
    if turn is None or not turn.store:
        return answer
    kept = turn

    async def settle() -> None:
        stored.finished(kept, ended_of(), state.settings.responses_record_bytes)
        await stored.keep(state, kept, opened.last_worker, tenant, shape.response_id)

    return stored.Settling(answer, ready=lambda: ended_of() is not None, settle=settle)


async def _open(gateway: Gateway, raw: bytes, turn: stored.Turn | None, asker: Asker, started: float,
                request: Request) -> tuple[Opened, Generation, Echo]:
    body = json.dumps(turn.body).encode() if turn is not None else raw
    return await open_parsed(gateway, body, parse, asker, started, prefer=turn.prefer if turn is not None else None,
                             client_gone=lambda: client_left_of(request.receive))


def parse(raw: bytes) -> tuple[dict[str, Any], Echo]:
    """The internal request's fields (only what the client set, and `probabilities: false`: no
    logprobs are offered here, so the worker skips each token's softmax) and what the answer repeats."""
    try:
        body = rs.ResponsesRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc), param=first_field(exc)) from None
    _refuse_unsupported(body)
    tools, tool_choice = _tools_of(body)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages = messages + _conversation(body.input)
    fields: dict[str, Any] = {"messages": messages, "max_tokens": body.max_output_tokens or oa.MAX_COMPLETION_TOKENS,
                              "probabilities": False}
    for name in ("model", "temperature", "top_p", "seed", "session_id", "top_k", "ignore_eos"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    if body.keep_alive is not None:
        fields["keep_alive"] = keep_alive_seconds(body.keep_alive)
    text_format = body.text.format if body.text is not None else None
    schema = _schema_of(text_format)
    if schema is not None:
        fields["json_schema"] = schema
    if tools is not None:
        offer(fields, tools, format_param="text.format")
    echo = Echo(stream=body.stream, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
                parallel_tool_calls=body.parallel_tool_calls is not False, tool_choice=tool_choice,
                user=body.user, metadata=body.metadata or {}, tools=tools, store=body.store is True,
                reasoning=body.reasoning or rs.Reasoning(),
                listed_tools=[_listed(tool) for tool in body.tools or ()],
                text_format=text_format.model_dump(by_alias=True, exclude_none=True) if text_format else None)
    return fields, echo


def _listed(tool: rs.ToolIn) -> dict[str, Any]:
    """A tool as the response lists it: as given, a function's description, parameters and strict
    present (null where not given), as the Open Responses specification's function tool has them."""
    listed = tool.model_dump(exclude_none=True)
    if tool.type == rs.TOOL_TYPE:
        listed = {"description": None, "parameters": None, "strict": None, **listed}
    return listed


def _refuse_unsupported(body: rs.ResponsesRequest) -> None:
    for name, value in (body.model_extra or {}).items():
        harmless = rs.UNSUPPORTED.get(name)
        if harmless is None or harmless(value):
            continue
        if name in _STATEFUL:
            raise _invalid(f"{name}: this pool keeps no background responses, conversations or prompts; send "
                           "the conversation as `input`, or continue a stored response with previous_response_id",
                           name)
        raise _invalid(f"{name}: not supported by this pool yet; an answer made without it would not be what "
                       "the request asks for, so leave it out", name)


def _tools_of(body: rs.ResponsesRequest) -> tuple[Tools | None, rs.ToolChoice]:
    """The request's function tools and its choice among them (as the response echoes it)."""
    functions = []
    for i, tool in enumerate(body.tools or ()):
        if tool.type != rs.TOOL_TYPE:
            continue  # a hosted tool or a namespace: this pool runs none, so the model is not offered it
        if tool.name is None:
            raise _invalid(f"tools.{i}.name: a function needs its name", f"tools.{i}.name")
        functions.append(oa.FunctionDef(name=tool.name, description=tool.description,
                                        parameters=tool.parameters or {"type": "object", "properties": {}}))
    given = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if not functions and given in (None, "auto", "none"):  # "auto" is the Responses API's default
        return None, given or "auto"  # type: ignore[return-value]  # a mode, as just checked
    if isinstance(given, dict):
        name = given.get("name")
        if given.get("type") != rs.TOOL_TYPE or not isinstance(name, str):
            raise _invalid('tool_choice: give "auto", "none", "required" or {"type": "function", "name": ...}',
                           "tool_choice")
        return choose(tuple(functions), None, name, parallel=parallel), {"type": rs.TOOL_TYPE, "name": name}
    if given is not None and given not in rs.TOOL_MODES:
        raise _invalid(f"tool_choice: {given!r} is not one of {', '.join(rs.TOOL_MODES)}", "tool_choice")
    mode: rs.ToolMode = given or "auto"  # type: ignore[assignment]  # checked just above
    return choose(tuple(functions), given, None, parallel=parallel), mode


def _schema_of(text_format: rs.TextFormatIn | None) -> dict[str, Any] | None:
    """The JSON schema `text.format` holds the answer to (any object for `json_object`); None for text."""
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "object"}
    if text_format.type != "json_schema":
        raise _invalid(f"text.format.type: {text_format.type!r} is not one of {', '.join(rs.TEXT_FORMATS)}",
                       "text.format.type")
    if text_format.schema_ is None:
        raise _invalid("text.format.schema: required with type json_schema", "text.format.schema")
    return text_format.schema_


def _conversation(items: list[rs.InputItem]) -> list[dict[str, Any]]:
    """The input as internal chat messages: messages as they are, a run of function calls as one
    assistant turn making them, each call's output as a `tool` turn naming its function."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    calls: list[oa.ToolCall] = []
    for index, item in enumerate(items):
        if item.type == rs.REASONING_ITEM_TYPE:
            continue  # an earlier answer's reasoning: not part of the conversation the template renders
        if item.type == rs.CALL_ITEM_TYPE:
            calls.append(_call(item, index))
            names[calls[-1].id] = calls[-1].function.name
            continue
        if calls:
            out.append({"role": "assistant", "content": "", "tool_calls": called(calls)})
            calls = []
        if item.type == rs.CALL_OUTPUT_ITEM_TYPE:
            out.append({"role": "tool", "content": _output(item, index), "name": _answered(item, names, index)})
        else:
            out.append(_message(item, index))
    if calls:
        out.append({"role": "assistant", "content": "", "tool_calls": called(calls)})
    return out


def _call(item: rs.InputItem, index: int) -> oa.ToolCall:
    where = f"input.{index}"
    for name in ("call_id", "name", "arguments"):
        if getattr(item, name) is None:
            raise _invalid(f"{where}.{name}: a function_call item needs its {name}", f"{where}.{name}")
    assert item.call_id is not None and item.name is not None and item.arguments is not None
    return oa.ToolCall(id=item.call_id, function=oa.FunctionCall(name=item.name, arguments=item.arguments))


def _output(item: rs.InputItem, index: int) -> str:
    where = f"input.{index}"
    if item.call_id is None:
        raise _invalid(f"{where}.call_id: a function_call_output item needs the call_id it answers",
                       f"{where}.call_id")
    if item.output is None:
        raise _invalid(f"{where}.output: a function_call_output item needs its output", f"{where}.output")
    if isinstance(item.output, str):
        return item.output
    return _texts(item.output, f"{where}.output")


def _answered(item: rs.InputItem, names: dict[str, str], index: int) -> str:
    """The function a `function_call_output` answers: a call of the conversation before it, else 400
    (as OpenAI refuses an output for no call: the model would read an answer to nothing it asked)."""
    name = names.get(item.call_id or "")
    if name is None:
        raise _invalid(f"input.{index}.call_id: no function_call with call_id {item.call_id!r} comes before "
                       "this output in the conversation", f"input.{index}.call_id")
    return name


def _message(item: rs.InputItem, index: int) -> dict[str, str]:
    where = f"input.{index}"
    if item.type != rs.INPUT_ITEM_TYPE:
        raise _invalid(f"{where}.type: {item.type!r} is not served (use one of {', '.join(rs.INPUT_ITEM_TYPES)}; "
                       "no references to stored items)", f"{where}.type")
    role = ROLES.get(item.role or "")
    if role is None:
        raise _invalid(f"{where}.role: {item.role!r} is not supported (use one of {', '.join(ROLES)})",
                       f"{where}.role")
    if item.content is None:
        raise _invalid(f"{where}.content: a message needs its content", f"{where}.content")
    return {"role": role, "content": _texts(item.content, f"{where}.content")}


def _texts(parts: list[rs.InputPart], where: str) -> str:
    texts = []
    for part in parts:
        if part.type not in rs.INPUT_PART_TYPES or part.text is None:
            raise _invalid(f"{where}: only text parts are supported ({', '.join(rs.INPUT_PART_TYPES)}), "
                           f"not {part.type!r}", where)
        texts.append(part.text)
    return "".join(texts)


def _invalid(message: str, param: str) -> CoordinatorError:
    return CoordinatorError(reasons.INVALID_REQUEST, message, param=param)


def _body() -> dict[str, Any]:
    """`ResponsesRequest` as `parse` takes it: `input` a string or items (messages with text parts,
    function calls, their outputs), function tools only, the three text formats, and the refused
    fields only with their harmless values."""
    schema = inlined(rs.ResponsesRequest)
    properties = schema["properties"]
    text = {"type": "string", "maxLength": MAX_PROMPT_CHARS}
    call_id = {"type": "string", "maxLength": 128}
    parts = {"type": "array", "maxItems": MAX_MESSAGES, "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": list(rs.INPUT_PART_TYPES)}, "text": text}}}
    message = _object({"type": _one_of(rs.INPUT_ITEM_TYPE), "role": {"type": "string", "enum": list(ROLES)},
                       "content": {"anyOf": [text, parts]}}, "role", "content")
    call = _object({"type": _one_of(rs.CALL_ITEM_TYPE), "call_id": call_id,
                    "name": {"type": "string", "maxLength": 64}, "arguments": text},
                   "type", "call_id", "name", "arguments")
    output = _object({"type": _one_of(rs.CALL_OUTPUT_ITEM_TYPE), "call_id": call_id,
                      "output": {"anyOf": [text, parts]}}, "type", "call_id", "output")
    items = {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES - 1, "items": {"anyOf": [message, call, output]}}
    properties["input"] = {"anyOf": [text, items], "description": properties["input"].get("description", "")}
    function = _object({"type": _one_of(rs.TOOL_TYPE), "name": {"type": "string", "pattern": r"^[A-Za-z0-9_-]{1,64}$"},
                        "description": {"type": "string", "maxLength": 4096}, "parameters": {"type": "object"},
                        "strict": {"type": "boolean"}}, "type", "name")
    named = _object({"type": _one_of(rs.TOOL_TYPE), "name": {"type": "string", "maxLength": 64}}, "type", "name")
    plain = _object({"type": {"type": "string", "enum": ["text", "json_object"]}}, "type")
    shaped = _object({"type": _one_of("json_schema"), "name": {"type": "string", "maxLength": 64},
                      "schema": {"type": "object"}, "strict": {"type": "boolean"}}, "type", "schema")
    properties.update(
        tools={"anyOf": [{"type": "array", "maxItems": 128, "items": function}, {"type": "null"}],
               "description": "function tools (no hosted tools)"},
        tool_choice={"anyOf": [{"type": "string", "enum": list(rs.TOOL_MODES)}, named, {"type": "null"}]},
        text={"anyOf": [_object({"format": {"anyOf": [plain, shaped]}}), {"type": "null"}]},
        truncation={"type": "string", "enum": ["disabled"], "description": "only `disabled`"})
    return schema


def _object(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required)}


def _one_of(value: str) -> dict[str, Any]:
    return {"type": "string", "enum": [value]}


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
