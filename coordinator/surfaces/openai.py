"""The OpenAI-compatible surface: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`.

Owns: parsing OpenAI's request bodies into the internal request (chat messages go to the worker as
messages, rendered there with the model's own template; completions are raw prompts; `n` choices
become the internal request's `n`, up to the coordinator's `max_choices`, never with a
`session_id`), the refusals OpenAI clients expect (`n` past that bound, non-text content parts, and every field in `protocol.openai.UNSUPPORTED` with a value that would change the answer), OpenAI's
error shape, choosing a streamed (`ChunkEncoder`) or collected (`assemble`) answer, and the OpenAPI
description of these routes (the bodies narrowed to what the parsers here accept).
Must not: admit, schedule or relay; the gateway does, exactly as for `/coordinator/infer`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from coordinator.admission import priority
from coordinator.auth import client_of, tenant_of
from coordinator.errors import CoordinatorError, error_headers
from coordinator.gateway import Gateway, Opened
from coordinator.generation import Generation
from coordinator.relay.collect import CollectedResponse
from coordinator.relay.response import RelayResponse
from coordinator.relay.supervisor import client_left_of
from coordinator.state import CoordinatorState
from coordinator.surfaces.infer import event_stream, json_body, refusals
from coordinator.surfaces.openai_format import ChunkEncoder, Options, assemble, fingerprint_of
from coordinator.surfaces.tools import called, offer, tools_of
from coordinator.validate import describe, first_field, read_body, request_id_of
from protocol import openai as oa
from protocol import reasons
from protocol.openapi import inlined
from protocol.worker import (
    MAX_CHOICES,
    MAX_KEEP_ALIVE,
    MAX_PROMPT_CHARS,
    REQUEST_ID_HEADER,
    WORKER_ID_HEADER,
    GenerateRequest,
)

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for our `prompt_too_long`
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
PREFIX = "/v1/"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# The request field a refusal is about, for OpenAI's `param`, when the error itself names none.
_PARAM_BY_REASON = {reasons.UNKNOWN_MODEL: "model", reasons.MODEL_UNAVAILABLE: "model",
                    reasons.UNKNOWN_SESSION: "session_id", reasons.SESSION_EXPIRED: "session_id",
                    reasons.SESSION_BUSY: "session_id"}

router = APIRouter()
Parse = Callable[[bytes], tuple[dict[str, Any], Options]]
T = TypeVar("T")
SERVICE_TIER = "service_tier"  # OpenAI's field for a request's class (admission/priority.py)


async def chat_completions(request: Request) -> Response:
    return await _serve(request, "openai-chat", partial(_parse_chat, max_choices=_max_choices(request)))


async def completions(request: Request) -> Response:
    return await _serve(request, "openai-completions", partial(_parse_completion, max_choices=_max_choices(request)))


def _max_choices(request: Request) -> int:
    state: CoordinatorState = request.app.state.coordinator
    return state.settings.max_choices


# The request bodies as this surface serves them: OpenAI's types (protocol/openai.py), narrowed to what
# the parsers below accept (anything else gets 400 with `param` naming the field).
def _body(model: type[BaseModel]) -> dict[str, Any]:
    schema = inlined(model)
    schema["properties"]["n"] = {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES, "default": 1,
                                 "description": "choices, at most the pool's MAX_CHOICES (8 unless configured; "
                                 "more: 400); more than 1 not with session_id"}
    return schema


def _chat_body() -> dict[str, Any]:
    """Roles and content parts as `_message` takes them."""
    schema = _body(oa.ChatCompletionRequest)
    message = schema["properties"]["messages"]["items"]["properties"]
    message["role"]["enum"] = [*ROLES, "tool"]
    parts = next(option for option in message["content"]["anyOf"] if option.get("type") == "array")
    parts["items"]["properties"]["type"]["enum"] = ["text"]
    return schema


def _completion_body() -> dict[str, Any]:
    """One non-empty prompt (a string or a list of one), no `suffix`, as `_parse_completion` takes them."""
    schema = _body(oa.CompletionRequest)
    text = {"type": "string", "minLength": 1, "maxLength": MAX_PROMPT_CHARS}
    schema["properties"].update(
        prompt={"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": 1}]},
        suffix={"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}],
                "description": "not supported"})
    return schema


def _described(body: type[BaseModel], schema: dict[str, Any], answer: type[BaseModel],
               chunk: str) -> dict[str, Any]:
    """The OpenAPI description of a generation route (app.py's fast path serves it, so nothing is inferred
    from the handler): its body, a JSON or streamed 200, and OpenAI-shaped refusals."""
    streamed = event_stream(f"`{answer.__name__}` JSON, or with `stream: true` Server-Sent Events",
                            ["message"], f"JSON `{chunk}` objects, an `error` object if the stream cannot "
                            "finish, then `[DONE]`")
    return {"response_model": None, "response_class": Response,
            "openapi_extra": json_body(schema, f"`{body.__name__}`; unknown fields are ignored"),
            "responses": {200: {**streamed, "model": answer}, **refusals(oa.ErrorResponse)}}


# Registered so the OpenAPI schema lists them and other methods get 405; app.py's fast path serves
# every POST to these paths before the router is reached.
router.add_api_route(
    CHAT_PATH, chat_completions, methods=["POST"], summary="Chat completion (OpenAI's API)",
    **_described(oa.ChatCompletionRequest, _chat_body(), oa.ChatCompletion, "chat.completion.chunk"))
router.add_api_route(
    COMPLETIONS_PATH, completions, methods=["POST"], summary="Text completion (OpenAI's API)",
    **_described(oa.CompletionRequest, _completion_body(), oa.Completion, "text_completion"))
# Listing models is refused only by the API keys and the edge; "4XX" also keeps FastAPI from
# documenting a 422 that this API never sends.
_OTHER_REFUSALS: dict[int | str, dict[str, Any]] = {"4XX": {
    "model": oa.ErrorResponse,
    "description": "`unauthorized` (401, with client API keys), or a refusal at the edge"}}


@router.get("/v1/models", responses=_OTHER_REFUSALS)
async def models(request: Request) -> oa.ModelList:
    state: CoordinatorState = request.app.state.coordinator
    offered = [oa.ModelCard(id=name, created=int(state.started_at),
                            state="loading" if state.loads.loading(name) else "offered")
               for name in state.registry.offered_models()]
    return oa.ModelList(data=[*(_card(state, name) for name in _served(state)), *offered])


@router.get("/v1/models/{model:path}",
            responses={404: {"model": oa.ErrorResponse, "description": "`unknown_model`"}, **_OTHER_REFUSALS})
async def model(model: str, request: Request) -> oa.ModelCard:
    state: CoordinatorState = request.app.state.coordinator
    name = state.registry.resolve(model)
    if name is None and (offered := state.registry.offered_as(model)) is not None:
        return oa.ModelCard(id=offered, created=int(state.started_at),
                            state="loading" if state.loads.loading(offered) else "offered")
    if name is None or name not in _served(state):
        served = ", ".join(_served(state)) or "none"
        raise CoordinatorError(reasons.UNKNOWN_MODEL, f"model {model!r} is not served; served: {served}",
                               param="model")
    return _card(state, name)


def _served(state: CoordinatorState) -> list[str]:
    state.registry.sweep(state.clock.monotonic())
    return state.registry.alive_models()


def _card(state: CoordinatorState, name: str) -> oa.ModelCard:
    return oa.ModelCard(id=name, created=int(state.started_at), aliases=state.registry.aliases_of(name))


async def open_generation(request: Request, surface: str, parse: Callable[[bytes], tuple[dict[str, Any], T]]
                          ) -> tuple[Opened, Generation, T] | Response:
    """Parse, admit and open one request of an OpenAI-shaped surface (`parse` gives the internal fields
    and what that surface's answer needs); a refusal comes back as OpenAI's error response."""
    state: CoordinatorState = request.app.state.coordinator
    gateway: Gateway = request.app.state.gateway
    started = gateway.now()
    request_id = request_id_of(request)
    try:
        raw = await read_body(request, state.settings.max_body_bytes)
    except CoordinatorError as exc:
        gateway.refused(request_id, exc, started, surface=surface)
        return error_response(request_id, exc)
    try:
        return await open_parsed(gateway, raw, parse, Asker(request_id, surface, request.headers,
                                                            request.scope.get("state", {})),
                                 started, client_gone=lambda: client_left_of(request.receive))
    except CoordinatorError as exc:
        return error_response(request_id, exc)


@dataclass(frozen=True, slots=True)
class Asker:
    """Who asks, as the gateway needs it: the request's id, its surface, the client's headers (priority,
    trace) and the ASGI scope's state (the API key's tenant and client, put there by the app's gate)."""

    request_id: str
    surface: str
    headers: Mapping[str, str]
    scope_state: Mapping[str, object]


async def open_parsed(gateway: Gateway, raw: bytes, parse: Callable[[bytes], tuple[dict[str, Any], T]], asker: Asker,
                      started: float, *, client_gone: Callable[[], Awaitable[None]], prefer: str | None = None
                      ) -> tuple[Opened, Generation, T]:
    """`open_generation` from a body already read (a WebSocket's message, too); raises the refusal,
    already counted and logged. `prefer`: a worker holding the conversation's KV, first if it fits."""
    try:
        fields, answer = parse(raw)
        tier = fields.pop(SERVICE_TIER, None)
        named = priority.asked(asker.headers.get(priority.HEADER), priority.SERVICE_TIERS.get(tier or "", ""),
                               param="service_tier" if tier else "priority")
        tenant = tenant_of(asker.scope_state)
        if tenant:
            fields["tenant"] = tenant
        gen = dataclasses.replace(Generation.of(internal(fields), asker.request_id, asker.surface, named),
                                  prefer=prefer)
    except CoordinatorError as exc:
        gateway.refused(asker.request_id, exc, started, surface=asker.surface)
        raise
    opened = await gateway.open(gen, started, client_gone=client_gone, client=client_of(asker.scope_state),
                                headers=asker.headers)
    return opened, gen, answer


async def _serve(request: Request, surface: str, parse: Parse) -> Response:
    found = await open_generation(request, surface, parse)
    if isinstance(found, Response):
        return found
    opened, gen, options = found
    state: CoordinatorState = request.app.state.coordinator
    request_id = gen.request_id
    created = int(state.clock.time())
    headers = {REQUEST_ID_HEADER: request_id, WORKER_ID_HEADER: opened.worker_id}
    record = state.registry.get(opened.worker_id)
    fingerprint = fingerprint_of(record.model_identity if record is not None else "")
    if options.stream:
        encoder = ChunkEncoder(options, request_id=request_id, created=created, model=opened.model,
                               fingerprint=fingerprint)
        return RelayResponse(opened.relay, headers=headers, ping_interval=state.settings.ping_interval,
                             clock=state.clock, on_end=opened.finish, encoder=encoder)
    model_name = opened.model
    return CollectedResponse(
        opened.relay, on_end=opened.finish, now=state.clock.monotonic,
        assemble=lambda events: assemble(options, events, request_id=request_id, created=created,
                                         model=model_name, fingerprint=fingerprint, headers=headers))


def _validated(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc), param=first_field(exc)) from None


def internal(fields: dict[str, Any]) -> GenerateRequest:
    try:
        return GenerateRequest.model_validate(fields)
    except ValidationError as exc:
        raise CoordinatorError(reasons.INVALID_REQUEST, describe(exc), param=first_field(exc)) from None


def _common(body: oa.ChatCompletionRequest | oa.CompletionRequest, max_tokens: int | None,
            max_choices: int) -> dict[str, Any]:
    """The internal fields both endpoints map the same way; only what the client set is sent on."""
    if body.n > max_choices:
        raise _invalid(f"n: at most {max_choices} choices per request on this pool (MAX_CHOICES)", "n")
    if body.n > 1 and body.session_id is not None:
        raise _invalid("n: several choices cannot keep a session (which one would the next turn continue?); "
                       "leave out session_id or ask for n=1", "n")
    _refuse_unsupported(body)
    fields: dict[str, Any] = {"max_tokens": oa.MAX_COMPLETION_TOKENS if max_tokens is None else max_tokens}
    if body.n > 1:
        fields["n"] = body.n
    if body.service_tier is not None:
        fields[SERVICE_TIER] = body.service_tier  # the coordinator's: open_generation takes it out
    for name in ("model", "temperature", "top_p", "seed", "stop", "session_id", "top_k", "ignore_eos",
                 "grammar", "json_schema", "logit_bias", "presence_penalty", "frequency_penalty", "repeat_penalty",
                 "repeat_last_n"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    if body.keep_alive is not None:
        fields["keep_alive"] = keep_alive_seconds(body.keep_alive)
    schema = _schema_of(body.response_format)
    if schema is not None:
        if "grammar" in fields or "json_schema" in fields:
            raise _invalid("response_format: give it, or grammar / json_schema, not both", "response_format")
        fields["json_schema"] = schema
    return fields


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: float | str) -> float:
    """Ollama's `keep_alive` in seconds: a number of seconds, or a duration as Go writes one ("5m",
    "1h30m", "300ms", "-1m"; a bare number in a string is seconds). 400 for anything else."""
    seconds = value if not isinstance(value, str) else _duration(value)
    if abs(seconds) > MAX_KEEP_ALIVE:
        raise _invalid(f"keep_alive: at most {MAX_KEEP_ALIVE:.0f} seconds either way", "keep_alive")
    return float(seconds)


def _duration(given: str) -> float:
    text = given.strip()
    sign, text = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
    try:
        return sign * float(text)
    except ValueError:
        parts = _DURATION_PART.findall(text)
        if not text or "".join(n + u for n, u in parts) != text:
            raise _invalid(f"keep_alive: {given[:40]!r} is neither seconds nor a duration such as \"5m\" or "
                           "\"1h30m\"", "keep_alive") from None
        return sign * sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def _refuse_unsupported(body: oa.ChatCompletionRequest | oa.CompletionRequest) -> None:
    """400 for a field OpenAI has and this pool does not serve, unless its value asks for nothing."""
    for name, value in (body.model_extra or {}).items():
        harmless = oa.UNSUPPORTED.get(name)
        if harmless is not None and not harmless(value):
            raise _invalid(f"{name}: not supported by this pool yet; an answer made without it would not be "
                           "what the request asks for, so leave it out", name)


def _schema_of(response_format: oa.ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema `response_format` asks the answer to match: any object for `json_object` (as
    llama.cpp's server reads it), the given schema for `json_schema`; None for text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise _invalid("response_format.json_schema.schema: required with type json_schema",
                       "response_format.json_schema")
    return spec.schema_


def _parse_chat(raw: bytes, max_choices: int = 1) -> tuple[dict[str, Any], Options]:
    body: oa.ChatCompletionRequest = _validated(oa.ChatCompletionRequest, raw)
    fields = _common(body, body.max_completion_tokens or body.max_tokens, max_choices)
    tools = tools_of(body)
    fields["messages"] = internal_messages(body.messages)
    top = body.top_logprobs or 0
    if tools is not None:
        if body.logprobs or top:
            raise _invalid("logprobs: not given with tools (a call is read from the whole answer)", "logprobs")
        offer(fields, tools, format_param="response_format or a grammar")
    options = Options("chat", body.stream, _usage(body), body.logprobs or top > 0, top, tools=tools, n=body.n)
    return _probabilities(fields, options), options


def internal_messages(messages: list[oa.ChatMessageIn]) -> list[dict[str, Any]]:
    """The conversation as internal chat messages: an assistant's calls as it made them, a tool's
    result naming the function whose call it answers; the worker writes both in its model's tool
    format."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if message.role == "tool":
            turn: dict[str, Any] = {"role": "tool",
                                    "content": _message(message.model_copy(update={"role": "user"}), i)["content"]}
            if message.tool_call_id in names:
                turn["name"] = names[message.tool_call_id]
            out.append(turn)
        elif message.role == "assistant" and message.tool_calls:
            for call in message.tool_calls:
                names[call.id] = call.function.name
            out.append({**_message(message, i), "tool_calls": called(message.tool_calls)})
        else:
            out.append(_message(message, i))
    return out


def _parse_completion(raw: bytes, max_choices: int = 1) -> tuple[dict[str, Any], Options]:
    body: oa.CompletionRequest = _validated(oa.CompletionRequest, raw)
    if body.max_tokens == 0 and not body.echo:
        raise _invalid("max_tokens: 0 only with echo (the prompt scored, nothing generated)", "max_tokens")
    if body.suffix:
        raise _invalid("suffix: not supported", "suffix")
    prompt = _one_prompt(body)
    fields = _common(body, body.max_tokens, max_choices)
    fields.update({"prompt_tokens" if isinstance(prompt, list) else "prompt": prompt, "raw": True})
    top = body.logprobs or 0
    # Echo: the worker scores the prompt when logprobs are asked for, when the prompt is token ids (their
    # texts come with the scores) and when nothing is generated; otherwise the text as given is echoed.
    scored = body.echo and (body.logprobs is not None or isinstance(prompt, list) or body.max_tokens == 0)
    if scored:
        fields["prompt_logprobs"] = top
    options = Options("text", body.stream, _usage(body), body.logprobs is not None, top, n=body.n, echo=body.echo,
                      echo_text=prompt if body.echo and not scored and isinstance(prompt, str) else None)
    return _probabilities(fields, options), options


def _one_prompt(body: oa.CompletionRequest) -> str | list[int]:
    """The request's one prompt: text, or token ids (also as a list of one list)."""
    prompts: list[Any] = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
    if prompts and all(isinstance(token, int) for token in prompts):
        prompts = [prompts]  # one prompt of token ids
    if len(prompts) != 1:
        raise _invalid("prompt: give one prompt per request", "prompt")
    prompt: str | list[int] = prompts[0]
    if not prompt:
        raise _invalid("prompt: must not be empty", "prompt")
    return prompt


def _probabilities(fields: dict[str, Any], options: Options) -> dict[str, Any]:
    """A client that did not ask for logprobs does not pay for them: the worker then skips the
    softmax over the whole vocabulary that each token's probability needs."""
    if not options.logprobs:
        fields["probabilities"] = False
    elif options.top_logprobs:  # the most likely tokens at each step, from the worker (TokenEvent.top)
        fields["alternatives"] = options.top_logprobs
    return fields


def _usage(body: oa.ChatCompletionRequest | oa.CompletionRequest) -> bool:
    return body.stream and body.stream_options is not None and body.stream_options.include_usage


def _message(message: oa.ChatMessageIn, index: int) -> dict[str, str]:
    role = ROLES.get(message.role)
    if role is None:
        raise _invalid(f"messages.{index}.role: {message.role!r} is not supported "
                       f"(use one of {', '.join(ROLES)})", f"messages.{index}.role")
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise _invalid(f"messages.{index}.content: only text parts are supported, not {part.type!r}",
                               f"messages.{index}.content")
            texts.append(part.text)
        content = "".join(texts)
    return {"role": role, "content": content or ""}


def _invalid(message: str, param: str) -> CoordinatorError:
    return CoordinatorError(reasons.INVALID_REQUEST, message, param=param)


def error_response(request_id: str, exc: CoordinatorError) -> JSONResponse:
    """OpenAI's error shape; the status, `Retry-After` and reason (as `code`) as on every surface, but
    for a prompt longer than the context: 400 `context_length_exceeded`, as OpenAI and llama.cpp's
    server answer it (the SDK then raises `BadRequestError`, which agent frameworks catch to shorten
    the conversation, instead of a generic `APIStatusError` for 413)."""
    if exc.reason == reasons.PROMPT_TOO_LONG:
        exc = CoordinatorError(CONTEXT_LENGTH_EXCEEDED, exc.message, status=400, param=exc.param)
    headers = error_headers(exc, request_id)
    param = exc.param or _PARAM_BY_REASON.get(exc.reason)
    body = oa.error_body(exc.message, status=exc.status, code=exc.reason, param=param)
    return JSONResponse(body, status_code=exc.status, headers=headers)
