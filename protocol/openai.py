"""Wire types of the OpenAI-compatible surface: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Owns: the request bodies as OpenAI documents them (unknown fields ignored, as vLLM does, except the
ones in `UNSUPPORTED`, which change what an answer means and are refused rather than dropped), our
extensions (`session_id`, `top_k`, `ignore_eos`), and the response, chunk, model-list and error
shapes the official clients parse.
Must not: reach workers. The coordinator's OpenAI surface maps these onto `protocol.worker`.

Defaults follow llama.cpp's server rather than OpenAI's cloud: a sampling field the client leaves
out takes the pool's default (temperature 0.8, top_p 0.95, top_k 40), and a missing `max_tokens`
means "until the end of generation or the session's KV limit".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.worker import (
    MAX_GRAMMAR_CHARS,
    MAX_PROMPT_CHARS,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    SESSION_ID_PATTERN,
)

MAX_COMPLETION_TOKENS = 32_768
# How hard a reasoning model should think (chat's `reasoning_effort`, the Responses API's
# `reasoning.effort`): accepted on every model; one without a thinking switch answers as it always does.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# Our own value of OpenAI's `system_fingerprint` when the serving worker reports no model identity.
FINGERPRINT_UNKNOWN = "fp_llm-pool"


def _absent(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


# Fields of OpenAI's API, and of llama.cpp's server's, that this pool does not implement yet, each with
# the test of a value that changes nothing. Any other value is a 400 naming the field: a client that
# asks for JSON, tools or a penalty must not get an answer made without them.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "functions": _absent,
    "function_call": lambda v: _absent(v) or v == "none",
    "best_of": lambda v: _absent(v) or v == 1,
    "min_p": lambda v: _absent(v) or v == 0,
    "typical_p": lambda v: _absent(v) or v == 1,
    "mirostat": lambda v: _absent(v) or v == 0,
    "modalities": lambda v: _absent(v) or v == ["text"],
    "audio": _absent,
    "prediction": _absent,
}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(max_length=64)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS, description="the arguments as a JSON text")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(max_length=32)
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=64)  # an assistant's calls
    tool_call_id: str | None = Field(default=None, max_length=128)  # a tool message: the call it answers


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: dict[str, str]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(default="response", max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """`{"type": "text"}`, `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}`: the answer is constrained by a grammar to match."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


Stop = str | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]],
                       Field(max_length=MAX_STOP_STRINGS)]


class _Common(BaseModel):
    """Fields both endpoints share: model, sampling, streaming, our extensions. Strict types, as
    OpenAI's own API checks them: `"5"` is not a number and `true` is not 1."""

    model_config = ConfigDict(extra="allow", strict=True)  # kept only to check them against UNSUPPORTED

    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_COMPLETION_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=5.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**32 - 2)
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)
    user: str | None = Field(default=None, max_length=256)
    # The request's priority class: flex is batch, priority interactive, auto and default the API key's.
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    # Extensions (not in OpenAI's API): the same meaning as on /coordinator/infer.
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    top_k: int | None = Field(default=None, ge=0, le=100_000)
    ignore_eos: bool | None = None
    # llama.cpp's server's extensions: constrain the answer to a GBNF grammar or a JSON schema.
    grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    json_schema: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # llama.cpp's server's repetition penalty (its names and meaning).
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(default=None, ge=0, le=4_096)
    # Ollama's: how long the model stays loaded once idle, in seconds or as a duration ("5m", "1h30m",
    # "-1"); on workers that offer a folder (--model-dir).
    keep_alive: float | str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=1_024)
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_COMPLETION_TOKENS)
    reasoning_effort: ReasoningEffort | None = Field(
        default=None, description="accepted; the models served here have no thinking switch to set")
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(max_length=MAX_PROMPT_CHARS)
    # OpenAI's default here; 0 only with `echo` (the prompt scored, nothing generated)
    max_tokens: int | None = Field(default=16, ge=0, le=MAX_COMPLETION_TOKENS)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = Field(default=False, description="the prompt first in `text`, and with `logprobs` its tokens "
                       "first in `logprobs` (the first token's log-probability null: nothing predicts it)")
    suffix: str | None = None


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """One piece of text as the worker streamed it (a token, or a few when a character spans them)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str = FINGERPRINT_UNKNOWN
    choices: list[ChatChoice]
    usage: CompletionUsage


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str = FINGERPRINT_UNKNOWN
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape. With `echo` the prompt's tokens come first: the first one's
    `token_logprobs` and `top_logprobs` entries are null."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """Both the whole answer and each streamed chunk of `/v1/completions` (OpenAI uses one type)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str = FINGERPRINT_UNKNOWN
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llm-pool"
    aliases: list[str] = Field(default_factory=list, description="other names requests may use")
    state: Literal["loaded", "loading", "offered"] = Field(
        default="loaded", description="loaded: a worker serves it now; offered: a worker offers it from its folder "
        "(--model-dir) but none serves it; loading: a worker loads it for requests that wait for it")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(message: str, *, status: int, code: str | None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object; `type` from the status as OpenAI's own API names them."""
    if status == 401:
        kind = "authentication_error"
    elif status >= 500:
        kind = "server_error"
    else:
        kind = "invalid_request_error"
    return ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code)).model_dump()
