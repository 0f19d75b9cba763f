"""Anthropic's Messages API: `POST /v1/messages` (streamed or not) and `POST /v1/messages/count_tokens`.

Owns: parsing Anthropic's request bodies into the internal request (the system text and the turns go to
the worker as chat messages, rendered there with the model's own template; an assistant's `tool_use`
blocks as its calls, each `tool_result` as a `tool` turn naming the function it answers; `tools` and
`tool_choice` offered through tools.py), the refusals Anthropic's clients expect (an unknown block
type, a `tool_result` that answers no call of the turn before, images and documents, server tools),
Anthropic's error shape and error types (protocol/anthropic.py), choosing a streamed (`EventEncoder`)
or collected (`assemble`) answer, counting a message's prompt tokens with the model's own tokenizer
and template (through the gateway), and the OpenAPI description of these routes.
Must not: admit, schedule or relay (the gateway does, exactly as for chat completions), nor read
workers' answers itself (anthropic_format.py does).

Accepted and changing nothing: `anthropic-version` and `anthropic-beta`, `metadata`, `thinking` (the
served models have no thinking switch: the answer is made without it). `cache_control` breakpoints ask
the worker to keep the request's cells for the longest of their `ttl`s (`cache_keep`), and the usage
then says what was written (`anthropic_format.usage_of`).
`temperature`, `top_p`, `top_k` and `stop_sequences` are the worker's sampling fields; a field left out takes the pool's default, as on
every surface. An empty `messages` is served as one empty user turn, as llama.cpp's server serves it.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from coordinator.admission import priority
from coordinator.auth import client_of, tenant_of
from coordinator.errors import CoordinatorError, error_headers
from coordinator.gateway import Gateway
from coordinator.generation import Generation
from coordinator.relay.collect import CollectedResponse
from coordinator.relay.response import RelayResponse
from coordinator.relay.supervisor import client_left_of
from coordinator.state import CoordinatorState
from coordinator.surfaces.anthropic_format import EventEncoder, Shape, assemble, error_message, error_status
from coordinator.surfaces.infer import event_stream, json_body
from coordinator.surfaces.openai import internal
from coordinator.surfaces.tools import Tools, choose, offer
from coordinator.validate import describe, first_field, read_body, request_id_of
from protocol import anthropic as an
from protocol import openai as oa
from protocol import reasons
from protocol.openapi import inlined
from protocol.tokens import TokenizeResponse
from protocol.worker import REQUEST_ID_HEADER, TOKENIZE_PATH, WORKER_ID_HEADER, ChatMessage, TokenizeWork

PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
SURFACE = "anthropic-messages"
ROLES = ("user", "assistant", "system")
MODES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice -> tools.py's

router = APIRouter()


async def create(request: Request) -> Response:
    state: CoordinatorState = request.app.state.coordinator
    gateway: Gateway = request.app.state.gateway
    started, request_id, scope_state = gateway.now(), request_id_of(request), request.scope.get("state", {})
    try:
        fields, tools, stream = parse(await read_body(request, state.settings.max_body_bytes))
        fields.update({"tenant": tenant} if (tenant := tenant_of(scope_state)) else {})
        gen = Generation.of(internal(fields), request_id, SURFACE, priority.asked(request.headers.get(priority.HEADER)))
    except CoordinatorError as exc:
        gateway.refused(request_id, exc, started, surface=SURFACE)
        raise  # app.py answers it in Anthropic's shape
    opened = await gateway.open(gen, started, client_gone=lambda: client_left_of(request.receive),
                                client=client_of(scope_state), headers=request.headers)
    shape = Shape(request_id, opened.model, tools, opened.prompt_tokens, kept="cache_keep" in fields)
    headers = {REQUEST_ID_HEADER: request_id, an.REQUEST_ID_HEADER: request_id, WORKER_ID_HEADER: opened.worker_id}
    if stream:
        return RelayResponse(opened.relay, headers=headers, ping_interval=state.settings.ping_interval,
                             clock=state.clock, on_end=opened.finish, encoder=EventEncoder(shape))
    return CollectedResponse(opened.relay, on_end=opened.finish, now=state.clock.monotonic,
                             assemble=lambda events: assemble(shape, events, headers=headers))


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as a generation's would count them: the model's own template over the system
    text and the turns, with the tools' definitions (as JSON) in the system text."""
    state: CoordinatorState = request.app.state.coordinator
    gateway: Gateway = request.app.state.gateway
    request_id = request_id_of(request)
    body = _validated(an.CountTokensRequest, await read_body(request, state.settings.max_body_bytes))
    messages = conversation(body)
    if body.tools:
        listed = "\n".join(json.dumps(t.model_dump(exclude_none=True, exclude={"cache_control"}), ensure_ascii=False)
                           for t in body.tools)
        head = messages[0] if messages[0]["role"] == "system" else None
        messages = ([{"role": "system", "content": f"{head['content']}\n\n{listed}"}, *messages[1:]] if head
                    else [{"role": "system", "content": listed}, *messages])
    try:
        work = TokenizeWork(model=body.model, messages=[ChatMessage.model_validate(m) for m in messages],
                            add_special=False)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc), param=first_field(exc)) from None
    tokenized = await gateway.tokenize(TOKENIZE_PATH, body.model, work, TokenizeResponse, request_id)
    count = an.TokenCount(input_tokens=int(tokenized.answer["count"]))
    return JSONResponse(count.model_dump(), headers={REQUEST_ID_HEADER: request_id,
                                                     WORKER_ID_HEADER: tokenized.worker_id})


def parse(raw: bytes) -> tuple[dict[str, Any], Tools | None, bool]:
    """The internal request's fields (only what the client set, and `probabilities: false`: no logprobs
    are offered here, so the worker skips each token's softmax), the tools the answer may call, and
    whether it streams."""
    body = _validated(an.MessagesRequest, raw)
    fields: dict[str, Any] = {"messages": conversation(body), "probabilities": False,
                              "max_tokens": min(body.max_tokens, oa.MAX_COMPLETION_TOKENS)}
    for name in ("model", "temperature", "top_p", "top_k"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    if (keep := kept_for(body)) is not None:
        fields["cache_keep"] = keep
    tools = tools_of(body)
    if tools is not None:
        offer(fields, tools, format_param="a format")
    return fields, tools, body.stream


def kept_for(body: an.MessagesRequest) -> float | None:
    """The longest `ttl` of the request's `cache_control` breakpoints (system, message and tool blocks), in
    seconds; None without one."""
    system = body.system if isinstance(body.system, list) else []
    marks = [*(b.cache_control for b in system),
             *(b.cache_control for m in body.messages if not isinstance(m.content, str) for b in m.content),
             *(t.cache_control for t in body.tools or ())]
    return max((mark.seconds for mark in marks if mark is not None), default=None)


def tools_of(body: an.CountTokensRequest) -> Tools | None:
    """The request's client tools and its `tool_choice` among them (`auto` unless it says otherwise)."""
    functions = []
    for i, tool in enumerate(body.tools or ()):
        if tool.type not in (None, "custom"):
            raise _invalid(f"tools.{i}.type: {tool.type!r} is a server tool; this pool runs none (give client "
                           "tools: name, description, input_schema)", f"tools.{i}.type")
        try:
            functions.append(oa.FunctionDef(name=tool.name, description=tool.description,
                                            parameters=tool.input_schema or {"type": "object", "properties": {}}))
        except ValidationError as exc:
            raise _invalid(f"tools.{i}: {describe(exc)}", f"tools.{i}") from None
    choice = body.tool_choice
    parallel = choice is None or not choice.disable_parallel_tool_use
    if choice is not None and choice.type == "tool":
        if choice.name is None:
            raise _invalid("tool_choice.name: a choice of type tool names the tool", "tool_choice.name")
        return choose(tuple(functions), None, choice.name, parallel=parallel)
    return choose(tuple(functions), MODES[choice.type] if choice is not None else None, None, parallel=parallel)


def conversation(body: an.CountTokensRequest) -> list[dict[str, Any]]:
    """The system text and the turns as internal chat messages: a user turn's `tool_result` blocks as
    `tool` turns (each naming the function of the call it answers, which the assistant's turn before
    made), its text around them as user turns, in the order given; an assistant's text and calls as
    one turn making them; earlier thinking left out."""
    system = _system(body.system)
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    calls: dict[str, str] = {}  # the calls of the latest assistant turn: id -> function
    for i, message in enumerate(body.messages):
        where = f"messages.{i}"
        if message.role not in ROLES:
            raise _invalid(f"{where}.role: {message.role!r} is not one of user, assistant", f"{where}.role")
        blocks = [an.Block(type=an.TEXT, text=message.content)] if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            turn, calls = _assistant(blocks, where)
            out.append(turn)
        else:
            out.extend(_turns(message.role, blocks, calls, where))
    if not body.messages:
        out.append({"role": "user", "content": ""})
    return out


def _system(given: str | list[an.SystemBlock] | None) -> str:
    if given is None or isinstance(given, str):
        return given or ""
    for k, block in enumerate(given):
        if block.type != an.TEXT:
            raise _invalid(f"system.{k}.type: only text blocks are served, not {block.type!r}", f"system.{k}.type")
    return "\n\n".join(block.text for block in given)


def _assistant(blocks: list[an.Block], where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """An assistant's turn (its text and the calls it made) and its calls by id."""
    texts, made, calls = [], [], {}
    for k, block in enumerate(blocks):
        at = f"{where}.content.{k}"
        if block.type == an.TEXT:
            texts.append(block.text or "")
        elif block.type == an.TOOL_USE:
            if block.id is None or block.name is None or block.input is None:
                raise _invalid(f"{at}: a tool_use block needs its id, name and input", at)
            made.append({"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)})
            calls[block.id] = block.name
        elif block.type not in an.DROPPED_BLOCKS:
            raise _unknown_block(block.type, at)
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if made:
        turn["tool_calls"] = made
    return turn, calls


def _turns(role: str, blocks: list[an.Block], calls: dict[str, str], where: str) -> list[dict[str, Any]]:
    """A user's (or a system's) turn: its runs of text, and each `tool_result` as a `tool` turn."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for k, block in enumerate(blocks):
        at = f"{where}.content.{k}"
        if block.type == an.TEXT:
            texts.append(block.text or "")
        elif block.type == an.TOOL_RESULT and role == "user":
            if texts:
                out.append({"role": role, "content": "".join(texts)})
                texts = []
            out.append(_result(block, calls, at))
        else:
            raise _unknown_block(block.type, at)
    if texts or not out:
        out.append({"role": role, "content": "".join(texts)})
    return out


def _result(block: an.Block, calls: dict[str, str], at: str) -> dict[str, Any]:
    if block.tool_use_id not in calls:
        raise _invalid(f"{at}.tool_use_id: {block.tool_use_id!r} answers no tool_use block of the assistant's turn "
                       "before it", f"{at}.tool_use_id")
    content = block.content or ""
    if not isinstance(content, str):
        for n, part in enumerate(content):
            if part.type != an.TEXT:
                raise _unknown_block(part.type, f"{at}.content.{n}")
        content = "".join(part.text or "" for part in content)
    if block.is_error:
        content = f"Error: {content}"
    return {"role": "tool", "content": content, "name": calls[block.tool_use_id]}


def _unknown_block(kind: str, at: str) -> CoordinatorError:
    if kind in (an.IMAGE, an.DOCUMENT):
        return _invalid(f"{at}.type: {kind} input is not supported: the pool's models read text only", f"{at}.type")
    return _invalid(f"{at}.type: {kind!r} is not a block type served here (text, tool_use, tool_result)", f"{at}.type")


def _validated(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc), param=first_field(exc)) from None


def _invalid(message: str, param: str) -> CoordinatorError:
    return CoordinatorError(reasons.INVALID_REQUEST, message, param=param)


def error_response(request_id: str, exc: CoordinatorError) -> JSONResponse:
    """Anthropic's error shape (`{"type": "error", "error": {"type", "message"}}`), the error type from the
    status (protocol.anthropic.ERROR_TYPES); the status, `Retry-After` and request id as on every surface,
    but for a prompt longer than the session holds: 400 "prompt is too long: ...", as Anthropic answers it."""
    status = error_status(exc.reason) if exc.reason == reasons.PROMPT_TOO_LONG else exc.status
    body = an.error_body(error_message(exc.reason, exc.message), status=status, request_id=request_id or None)
    return JSONResponse(body, status_code=status, headers={**error_headers(exc, request_id), an.REQUEST_ID_HEADER:
                                                           request_id})


_REFUSALS: dict[int | str, dict[str, Any]] = {
    400: {"model": an.ErrorResponse, "description": "`invalid_request_error`: a malformed body or block, an unknown "
          "block type, a tool_result for no call, or a prompt longer than a session holds (\"prompt is too long\")"},
    401: {"model": an.ErrorResponse, "description": "`authentication_error`: API keys are set and none was given "
          "(`x-api-key` or `Authorization: Bearer`)"},
    404: {"model": an.ErrorResponse, "description": "`not_found_error`: the model is not served"},
    413: {"model": an.ErrorResponse, "description": "`request_too_large`: the body is over MAX_BODY_BYTES"},
    429: {"model": an.ErrorResponse, "description": "`rate_limit_error`: the key is over one of its limits"},
    503: {"model": an.ErrorResponse, "description": "`overloaded_error`: no capacity now; try again after `Retry-After`"},
    "5XX": {"model": an.ErrorResponse, "description": "`api_error`: the workers failed"}}

# Registered so the OpenAPI schema lists it and other methods get 405; app.py's fast path serves every
# POST to it before the router is reached.
router.add_api_route(
    PATH, create, methods=["POST"], summary="Create a message (Anthropic's Messages API)",
    response_model=None, response_class=Response,
    openapi_extra=json_body(inlined(an.MessagesRequest), "`MessagesRequest`; unknown fields are ignored"),
    responses={200: {**event_stream("`Message` JSON, or with `stream: true` Server-Sent Events",
                                    list(an.STREAM_EVENTS), "JSON: the event, its `type` the event's name"),
                     "model": an.Message}, **_REFUSALS})
router.add_api_route(
    COUNT_PATH, count_tokens, methods=["POST"], summary="Count a message's input tokens (Anthropic's Messages API)",
    response_model=None, response_class=JSONResponse,
    openapi_extra=json_body(inlined(an.CountTokensRequest), "`CountTokensRequest`; unknown fields are ignored"),
    responses={200: {"model": an.TokenCount}, **_REFUSALS})
