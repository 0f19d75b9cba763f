"""Wire types of Anthropic's Messages API as this pool serves it: `POST /v1/messages` (streamed or not)
and `POST /v1/messages/count_tokens`.

Owns: the request bodies (unknown fields ignored, as Anthropic's own API ignores beta fields it was not
asked for; blocks of any type parse, so the surface can refuse an unknown one by name), the `message`
object with its text and `tool_use` blocks and usage, the streamed events and their names, the error
body with Anthropic's error types, in the shapes the official `anthropic` package parses
(`anthropic.types`).
Must not: reach workers. The coordinator's Messages surface (coordinator/surfaces/anthropic.py) maps
these onto `protocol.worker`.

What is accepted and changes nothing here (protocol/inference.http.md, "Anthropic Messages"): the
`anthropic-version` and `anthropic-beta` headers, `metadata`, `thinking` (the served models have no
thinking switch), and the beta fields Claude Code sends (`context_management`, `output_config`).
`cache_control` breakpoints keep the request's cells on its worker for their `ttl` (`CacheControl`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.worker import MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_STOP_STRINGS, MAX_TOOLS

VERSION_HEADER = "anthropic-version"
BETA_HEADER = "anthropic-beta"
REQUEST_ID_HEADER = "request-id"  # Anthropic's name for the request's id; the SDK reads it as `_request_id`
MESSAGE_ID_PREFIX = "msg_"
TOOL_USE_ID_PREFIX = "toolu_"
# The most `max_tokens` a request may name: Claude Code asks for 32,000 to 128,000 whatever the model. An
# answer still ends at its session's KV limit (`stop_reason: max_tokens`), as it does at a smaller bound.
MAX_TOKENS_ASKED = 1 << 20

# Block types, in requests and answers.
TEXT = "text"
TOOL_USE = "tool_use"
TOOL_RESULT = "tool_result"
IMAGE = "image"
DOCUMENT = "document"
THINKING = "thinking"
REDACTED_THINKING = "redacted_thinking"
# Earlier thinking sent back in an assistant's turn: a model without thinking has nothing to read there.
DROPPED_BLOCKS = frozenset({THINKING, REDACTED_THINKING})

# The `type` (and SSE `event:` name) of each streamed event, in the order a stream sends them.
MESSAGE_START = "message_start"
PING = "ping"
CONTENT_BLOCK_START = "content_block_start"
CONTENT_BLOCK_DELTA = "content_block_delta"
CONTENT_BLOCK_STOP = "content_block_stop"
MESSAGE_DELTA = "message_delta"
MESSAGE_STOP = "message_stop"
ERROR = "error"
STREAM_EVENTS = (MESSAGE_START, PING, CONTENT_BLOCK_START, CONTENT_BLOCK_DELTA, CONTENT_BLOCK_STOP, MESSAGE_DELTA,
                 MESSAGE_STOP, ERROR)
TEXT_DELTA = "text_delta"
INPUT_JSON_DELTA = "input_json_delta"

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
ToolChoiceType = Literal["auto", "any", "tool", "none"]

# Anthropic's error types by HTTP status (docs.claude.com/en/api/errors); any other 4XX is an
# `invalid_request_error`, as Anthropic says it may answer them, and any other 5XX an `api_error`.
# 503 keeps its status (the pool's one table of reasons to statuses, with Retry-After) and is named
# `overloaded_error`, the type Anthropic gives its own 529: the SDK and Claude Code retry both.
ERROR_TYPES: dict[int, str] = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                               500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}  # a breakpoint's `ttl`, in seconds; "5m" when none is given


class CacheControl(BaseModel):
    """A prompt-cache breakpoint (`{"type": "ephemeral", "ttl": "5m"}`): the request's cells are kept that
    long on its worker once it ends (`GenerateRequest.cache_keep`)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] | None = None

    @property
    def seconds(self) -> float:
        return CACHE_TTLS[self.ttl or "5m"]


class ResultPart(BaseModel):
    """A block of a `tool_result`'s content: text is served; any other type parses, to be refused by name."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(max_length=64)
    text: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)


class Block(BaseModel):
    """A content block of a message: `text`, `tool_use` (an assistant's call: `id`, `name`, `input`),
    `tool_result` (the caller's answer to one: `tool_use_id`, `content`, `is_error`), or earlier
    `thinking`. Every other type parses too, to be refused by name."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(max_length=64)
    text: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    id: str | None = Field(default=None, max_length=256)
    name: str | None = Field(default=None, max_length=128)
    input: dict[str, Any] | None = None
    tool_use_id: str | None = Field(default=None, max_length=256)
    content: str | list[ResultPart] | None = Field(default=None)
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class MessageIn(BaseModel):
    """A turn of the conversation. `system` is Claude Code's mid-conversation system text (the
    `per-turn-control` beta); Anthropic's documented roles are `user` and `assistant`."""

    model_config = ConfigDict(extra="ignore")

    role: str = Field(max_length=32)
    content: str | list[Block]


class SystemBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = Field(default=TEXT, max_length=64)
    text: str = Field(default="", max_length=MAX_PROMPT_CHARS)
    cache_control: CacheControl | None = None


class ToolIn(BaseModel):
    """A tool the model may call: a client tool (`name`, `description`, `input_schema`). A server
    tool (a `type` such as `web_search_20250305`) parses too, to be refused by name."""

    model_config = ConfigDict(extra="ignore")

    type: str | None = Field(default=None, max_length=64)
    name: str = Field(max_length=128)
    description: str | None = Field(default=None, max_length=65_536)
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: ToolChoiceType
    name: str | None = Field(default=None, max_length=128)
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    """`{"type": "enabled", "budget_tokens": N}`, `{"type": "disabled"}` or `{"type": "adaptive"}`:
    accepted; the served models have no thinking switch, so the answer is made without thinking."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(max_length=32)
    budget_tokens: int | None = Field(default=None, ge=0)


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_id: str | None = Field(default=None, max_length=4096)


class CountTokensRequest(BaseModel):
    """The body of `POST /v1/messages/count_tokens`: a message's prompt, without what generation needs."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=256)
    messages: list[MessageIn] = Field(max_length=MAX_MESSAGES - 1)
    system: str | list[SystemBlock] | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    tools: list[ToolIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    """The body of `POST /v1/messages`."""

    max_tokens: int = Field(ge=1, le=MAX_TOKENS_ASKED, description="at most this many tokens are generated "
                            "(and at most what the session's KV holds); above 32,768 the pool's bound applies")
    stream: bool = False
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=100_000)
    metadata: Metadata | None = None


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Usage(BaseModel):
    """Tokens as the worker counted them: `cache_read_input_tokens` are the prompt tokens the worker
    reused from KV it already held (not prefilled); with a `cache_control` breakpoint the rest of the
    prompt is `cache_creation_input_tokens` (prefilled, and its cells kept for the breakpoint's `ttl`:
    the whole prompt is kept, not only up to the breakpoint) and `input_tokens` is 0; without one, the
    rest is `input_tokens`."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(BaseModel):
    """Anthropic's `message` object: the whole answer, and (with `content` empty) a stream's start."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class MessageDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaEvent(BaseModel):
    """The stream's end: why it stopped, and the usage (cumulative: the whole answer's)."""

    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: Usage


class TokenCount(BaseModel):
    """The answer of `POST /v1/messages/count_tokens`."""

    input_tokens: int


class ErrorDetail(BaseModel):
    type: str = Field(description="Anthropic's error type (`ERROR_TYPES`)")
    message: str


class ErrorResponse(BaseModel):
    """Every error of these routes, as a JSON body before the first byte and as a stream's `error` event after."""

    type: Literal["error"] = "error"
    error: ErrorDetail
    request_id: str | None = None


def error_body(message: str, *, status: int, request_id: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorDetail(type=error_type(status), message=message),
                         request_id=request_id).model_dump(exclude_none=True)

