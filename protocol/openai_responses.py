"""Wire types of OpenAI's Responses API as this pool serves it: `POST /v1/responses`, text and function
calls in, text (free, or held to a JSON schema) or function calls out.

Owns: the request body (`ResponsesRequest`: unknown fields ignored, as on the other OpenAI routes,
except the ones in `UNSUPPORTED`, which change what an answer means and are refused rather than
dropped), the `response` object with its output (one message, or the function calls the answer
makes) and usage, the streamed events and their names, in the shapes the official `openai` package
parses (`openai.types.responses`).
Must not: reach workers, or repeat the shapes `protocol.openai` already defines (the error body is
the same on every OpenAI route). The coordinator's Responses surface maps these onto `protocol.worker`.

A response is stored (`store`, true unless false, as OpenAI's) on the worker that ran it, and
`previous_response_id` naming a stored one continues it (coordinator/surfaces/responses_stored.py);
the other fields that need state this pool does not keep (`conversation`, `prompt`, `background`) are
refused. Over the WebSocket (`/v1/responses` upgraded) a socket also keeps its own responses for its
life, `store: false` ones too (`SocketCreate`, `SocketError`).

`POST /v1/responses/compact` (`CompactRequest`, `CompactResponse`) answers one `compaction` item that
stands for the conversation; a request's input expands it back in place (`expand_compactions`).

`reasoning` is accepted (`Reasoning`) and repeated in the answer; a model served without a thinking
switch answers without reasoning items (`reasoning_tokens` 0), as the docs say.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocol.openai import MAX_COMPLETION_TOKENS, ReasoningEffort
from protocol.worker import MAX_MESSAGES, MAX_PROMPT_CHARS, SESSION_ID_PATTERN

RESPONSE_ID_PREFIX = "resp_"
MESSAGE_ID_PREFIX = "msg_"

# The `type` (and SSE `event:` name) of each streamed event, in the order a stream sends them; a
# stream ends with exactly one of the last three.
CREATED = "response.created"
IN_PROGRESS = "response.in_progress"
OUTPUT_ITEM_ADDED = "response.output_item.added"
CONTENT_PART_ADDED = "response.content_part.added"
OUTPUT_TEXT_DELTA = "response.output_text.delta"
OUTPUT_TEXT_DONE = "response.output_text.done"
CONTENT_PART_DONE = "response.content_part.done"
OUTPUT_ITEM_DONE = "response.output_item.done"
ARGUMENTS_DELTA = "response.function_call_arguments.delta"  # a function call's arguments, in pieces
ARGUMENTS_DONE = "response.function_call_arguments.done"
COMPLETED = "response.completed"
INCOMPLETE = "response.incomplete"
FAILED = "response.failed"
STREAM_EVENTS = (CREATED, IN_PROGRESS, OUTPUT_ITEM_ADDED, CONTENT_PART_ADDED, OUTPUT_TEXT_DELTA, OUTPUT_TEXT_DONE,
                 CONTENT_PART_DONE, ARGUMENTS_DELTA, ARGUMENTS_DONE, OUTPUT_ITEM_DONE, COMPLETED, INCOMPLETE, FAILED)
TERMINAL_EVENTS = frozenset({COMPLETED, INCOMPLETE, FAILED})

# What the request may say, as this surface takes it (the parser refuses anything else, naming it).
INPUT_ROLES = ("user", "system", "developer", "assistant")
INPUT_PART_TYPES = ("input_text", "output_text")  # output_text: an assistant turn sent back as history
INPUT_ITEM_TYPE = "message"
CALL_ITEM_TYPE = "function_call"  # an earlier answer's call, sent back as history
CALL_OUTPUT_ITEM_TYPE = "function_call_output"  # what the caller's function returned for it
REASONING_ITEM_TYPE = "reasoning"  # an earlier answer's reasoning, sent back: accepted and left out
COMPACTION_ITEM_TYPE = "compaction"  # POST /v1/responses/compact's window, sent back: its items in its place
INPUT_ITEM_TYPES = (INPUT_ITEM_TYPE, CALL_ITEM_TYPE, CALL_OUTPUT_ITEM_TYPE, REASONING_ITEM_TYPE)
FUNCTION_CALL_ID_PREFIX = "fc_"
TEXT_FORMAT = {"type": "text"}
TEXT_FORMATS = ("text", "json_object", "json_schema")
TOOL_TYPE = "function"  # the only kind of tool offered (hosted tools and namespaces are accepted, not offered)
ToolMode = Literal["auto", "none", "required"]
TOOL_MODES: tuple[ToolMode, ...] = ("auto", "none", "required")
# As a response echoes it: a mode, or {"type": "function", "name": ...}.
ToolChoice = ToolMode | dict[str, str]


def _absent(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


# `include` values that ask for nothing this pool would leave out: no reasoning is encrypted here, so
# there is none to return (Codex CLI asks for it on every turn).
HARMLESS_INCLUDES = frozenset({"reasoning.encrypted_content"})


def _harmless_includes(value: Any) -> bool:
    return _absent(value) or (isinstance(value, list) and all(v in HARMLESS_INCLUDES for v in value))


# Fields of the Responses API this pool does not implement, each with the test of a value that changes
# nothing. Any other value is a 400 naming the field: a client that asks for a stored conversation
# must not get an answer made without it. (`text.format` types other than the three above are refused
# by the surface, since `text` itself is served; `previous_response_id` is taken out before parsing.)
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "previous_response_id": _absent,
    "conversation": _absent,
    "prompt": _absent,
    "background": lambda v: v is None or v is False,
    "include": _harmless_includes,
    "truncation": lambda v: _absent(v) or v == "disabled",
}


class InputPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: str = Field(max_length=64)
    text: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)


class InputItem(BaseModel):
    """An item of the conversation: a message (OpenAI's `EasyInputMessage`, or a `message` item; an
    output message sent back as input parses too), a `function_call` an earlier answer made (`call_id`,
    `name`, `arguments`), or a `function_call_output` (`call_id`, `output`). Other item types parse as
    well, to be refused by name. String content is one `input_text` part, as OpenAI defines it."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: str = Field(default=INPUT_ITEM_TYPE, max_length=64)
    role: str | None = Field(default=None, max_length=32)
    content: list[InputPart] | None = Field(default=None, max_length=MAX_MESSAGES)
    call_id: str | None = Field(default=None, max_length=128)
    name: str | None = Field(default=None, max_length=64)
    arguments: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    output: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[
        list[InputPart], Field(max_length=MAX_MESSAGES)] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_as_part(cls, value: Any) -> Any:
        return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


ReasoningSummary = Literal["auto", "concise", "detailed", "none"]


class Reasoning(BaseModel):
    """`reasoning`: how hard a reasoning model should think, and whether to summarise it. Accepted on
    every model; one without a thinking switch answers as it always does (no reasoning items)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    effort: ReasoningEffort | None = None
    summary: ReasoningSummary | None = None


class ToolIn(BaseModel):
    """A tool of the request: a function (`name`, `description`, `parameters`, `strict`). Other types
    (OpenAI's hosted tools, Codex's `namespace` groups) parse too: accepted, listed back, not offered."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: str = Field(max_length=64)
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormatIn(BaseModel):
    """`text.format`: `{"type": "text"}`, `{"type": "json_object"}`, or `{"type": "json_schema", "name",
    "schema", "strict", "description"}` (flat, unlike chat's `response_format`)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: str = Field(max_length=64)
    name: str | None = Field(default=None, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = Field(default=None, max_length=4096)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    format: TextFormatIn | None = None


MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ResponsesRequest(BaseModel):
    """The body of `POST /v1/responses`. Strict types, as OpenAI's own API checks them."""

    model_config = ConfigDict(extra="allow", strict=True)  # kept only to check them against UNSUPPORTED

    model: str | None = Field(default=None, max_length=256)
    input: list[InputItem] = Field(min_length=1, max_length=MAX_MESSAGES - 1,
                                   description="a user message (a string), or the conversation as message items")
    instructions: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS,
                                     description="a system message put before the input")
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_COMPLETION_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=5.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = Field(default=None, description="false: not stored; otherwise the response is kept "
                               "to continue (previous_response_id) and read back (GET /v1/responses/{id})")
    reasoning: Reasoning | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    tools: list[ToolIn] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = Field(
        default=None, description='"auto", "none", "required", or {"type": "function", "name": ...}')
    # Extensions (not in OpenAI's API): the same meaning as on /coordinator/infer and chat.
    seed: int | None = Field(default=None, ge=0, le=2**32 - 2)
    top_k: int | None = Field(default=None, ge=0, le=100_000)
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    ignore_eos: bool | None = None
    keep_alive: float | str | None = None  # Ollama's, as on chat

    @field_validator("input", mode="before")
    @classmethod
    def _text_as_message(cls, value: Any) -> Any:
        """A string is one user message, as OpenAI defines it; anything but a list is named here, so
        the error does not read as if only a list were allowed."""
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if not isinstance(value, list):
            raise ValueError("give a string or a list of message items")  # noqa: TRY004 - pydantic reports only ValueError
        return expand_compactions(value)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


MessageStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: MessageStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    """A call the answer makes: the caller runs the function and sends its output back as a
    `function_call_output` item with the same `call_id`."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as a JSON text")
    status: MessageStatus


OutputItem = Annotated[OutputMessage | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens reused from KV a worker already held")
    cache_write_tokens: int = Field(default=0, description="always 0: no prompt cache is billed for here")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    code: str = Field(description="the `reason` string, as in every other error body of the pool")
    message: str


class TextSettings(BaseModel):
    format: dict[str, Any] = Field(default_factory=lambda: dict(TEXT_FORMAT),
                                   description="the request's `text.format`, as given")


Status = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponseObject(BaseModel):
    """OpenAI's `response` object: the whole answer, and the payload of the stream's `response.*` events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = Field(default=None, description="the response this one continues")
    reasoning: Reasoning = Field(default_factory=Reasoning, description="the request's `reasoning`, as given")
    store: bool = False
    temperature: float | None = None
    text: TextSettings = Field(default_factory=TextSettings)
    tool_choice: ToolChoice = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list, description="the request's function tools")
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    # Fields the Open Responses specification requires in every response (nullable ones as null): what
    # the pool applies, which the request cannot change here.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    max_tool_calls: int | None = None
    service_tier: str = "default"
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class ResponseEvent(BaseModel):
    """`response.created`, `response.in_progress`, and the terminal `response.completed`,
    `response.incomplete` and `response.failed`."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(BaseModel):
    """`response.output_item.added` and `response.output_item.done`."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(BaseModel):
    """`response.content_part.added` and `response.content_part.done`."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(BaseModel):
    """`response.output_text.delta`: one piece of text as the worker streamed it."""

    type: str = OUTPUT_TEXT_DELTA
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class TextDoneEvent(BaseModel):
    """`response.output_text.done`: the whole text of the content part."""

    type: str = OUTPUT_TEXT_DONE
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ArgumentsDeltaEvent(BaseModel):
    """`response.function_call_arguments.delta`: a piece of a function call's arguments."""

    type: str = ARGUMENTS_DELTA
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(BaseModel):
    """`response.function_call_arguments.done`: a function call's whole arguments."""

    type: str = ARGUMENTS_DONE
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


# The WebSocket (`/v1/responses` upgraded): the client's one event, and the server's error event (every
# other server event is the HTTP stream's, one JSON text message each).
# --- POST /v1/responses/compact -------------------------------------------------------------------

COMPACTION_ID_PREFIX = "cmp_"
COMPACT_OBJECT = "response.compaction"
# The content of a `compaction` item made here: this tag, then the conversation's items as base64url
# JSON. Not encrypted and not summarized: the pool runs no model to compact, so the window carries the
# conversation whole and a turn given it back prefills the same conversation (which its worker's prompt
# cache may still hold).
COMPACTION_TAG = "llm-pool.v1."


class CompactRequest(BaseModel):
    """The body of `POST /v1/responses/compact`: the conversation to compact (`input`, and/or the stored
    response `previous_response_id` continues), for `model`."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(max_length=256)
    input: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[
        list[dict[str, Any]], Field(max_length=MAX_MESSAGES - 1)] | None = None
    instructions: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    previous_response_id: str | None = Field(default=None, max_length=256)


class CompactionItem(BaseModel):
    type: Literal["compaction"] = "compaction"
    id: str
    encrypted_content: str = Field(description=f"{COMPACTION_TAG} and the items as base64url JSON (not encrypted)")


class CompactResponse(BaseModel):
    """Open Responses' `CompactResource`."""

    id: str
    object: Literal["response.compaction"] = "response.compaction"
    output: list[CompactionItem]
    created_at: int
    usage: ResponseUsage


def compaction_of(items: list[dict[str, Any]], item_id: str) -> CompactionItem:
    """The one item standing for `items` (compactions among them expanded first, so none nests)."""
    flat = json.dumps(expand_compactions(items), separators=(",", ":")).encode()
    return CompactionItem(id=item_id, encrypted_content=COMPACTION_TAG + base64.urlsafe_b64encode(flat).decode())


def expand_compactions(items: list[Any]) -> list[Any]:
    """`items` with each `compaction` item made here replaced by the items it stands for; one that does
    not read as one of ours stays, for the parser to refuse by its type."""
    out: list[Any] = []
    for item in items:
        inner = _compacted(item) if isinstance(item, dict) and item.get("type") == COMPACTION_ITEM_TYPE else None
        out.extend(inner if inner is not None else [item])
    return out


def _compacted(item: dict[str, Any]) -> list[Any] | None:
    content = item.get("encrypted_content")
    if not isinstance(content, str) or not content.startswith(COMPACTION_TAG):
        return None
    try:
        inner = json.loads(base64.urlsafe_b64decode(content[len(COMPACTION_TAG):].encode()))
    except ValueError:
        return None
    return inner if isinstance(inner, list) else None


CREATE_EVENT = "response.create"
ERROR_EVENT = "error"
PREVIOUS_NOT_FOUND = "previous_response_not_found"  # OpenAI's code: no such stored response (for this key)


class SocketCreate(BaseModel):
    """`{"type": "response.create", ...}`: the fields of `POST /v1/responses` (`stream` is implied), and
    `generate: false` to record the request as a response to continue without generating anything."""

    model_config = ConfigDict(extra="allow", strict=True)  # the POST body's fields, parsed as the POST's

    type: Literal["response.create"]
    generate: bool = True
    previous_response_id: str | None = Field(default=None, max_length=256)


class SocketErrorBody(BaseModel):
    type: str = "invalid_request_error"
    code: str
    message: str
    param: str | None = None


class SocketError(BaseModel):
    """`{"type": "error", "status", "error": {...}}`: a refused `response.create` or message, as OpenAI
    sends it over the socket; the socket stays open."""

    type: Literal["error"] = "error"
    status: int
    error: SocketErrorBody
