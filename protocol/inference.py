"""Wire types of one inference: the request both services accept and the SSE events they stream.

Owns: field names, defaults and ranges of the inference request; the shape of token/done/error events.
Must not: know about HTTP frameworks, llama.cpp or scheduling. Both services import these types;
no dict-shaped payloads cross the wire anywhere else.

The same `InferRequest` is what a client posts to `POST /coordinator/infer` and what the coordinator
posts to a worker's `POST /worker/generate`, so a field added here reaches both sides at once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# SSE event names (the `event:` line of each Server-Sent Event).
EVENT_TOKEN = "token"
EVENT_DONE = "done"
EVENT_ERROR = "error"

FinishReason = Literal["stop", "length", "cancelled"]

# Coordinator -> worker: "this session_id continues a conversation you hold". A worker that does not
# hold it answers 404 unknown_session instead of starting a new conversation under the same id.
SESSION_EXPECTED_HEADER = "x-session-expected"

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 64
MAX_PROMPT_CHARS = 1_000_000
SESSION_ID_PATTERN = r"^[A-Za-z0-9._:\-]{1,128}$"


class InferRequest(BaseModel):
    """One generation request, validated once at the edge of each service."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = Field(default=None, max_length=256, description="None: the worker's own model")
    max_tokens: int = Field(default=128, ge=1, le=32_768)
    temperature: float = Field(default=0.8, ge=0.0, le=5.0, description="0 means greedy")
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    top_k: int = Field(default=40, ge=0, le=100_000, description="0 disables top-k")
    seed: int | None = Field(default=None, ge=0, le=2**32 - 2)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    ignore_eos: bool = Field(default=False, description="keep generating past end-of-generation tokens")
    raw: bool = Field(default=False, description="True: complete the prompt as is, no chat template")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_strings_bounded(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item or len(item) > MAX_STOP_LENGTH:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_LENGTH} characters")
        return value


class TokenEvent(BaseModel):
    """One piece of generated text.

    `token` is the text of one generated token, or of several when a UTF-8 character or a possible
    stop string spans tokens (the text is held until it is complete). `index` is the 0-based position,
    among generated tokens, of the last token the text includes; `probability` is the product of the
    included tokens' softmax probabilities under the model's raw logits.
    """

    token: str
    index: int = Field(ge=0)
    probability: float = Field(ge=0.0, le=1.0)
    finished: Literal[False] = False


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0, description="tokens of the prompt as the model saw it (after templating)")
    cached_tokens: int = Field(ge=0, description="prompt tokens reused from the session's KV, not prefilled")
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class Timings(BaseModel):
    queue_ms: float = Field(ge=0.0, description="admitted until its first decode step")
    prefill_ms: float = Field(ge=0.0, description="first decode step until the prompt was in the KV cache")
    ttft_ms: float = Field(ge=0.0, description="admitted until the first token was produced")
    total_ms: float = Field(ge=0.0, description="admitted until the last token")
    tokens_per_second: float = Field(ge=0.0, description="completion tokens / (total - ttft)")


class DoneEvent(BaseModel):
    finished: Literal[True] = True
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    request_id: str
    worker_id: str
    model: str
    session_id: str | None = None


class ErrorEvent(BaseModel):
    """Sent as the last event when a stream that has started cannot complete."""

    error: str
    reason: str
    request_id: str
    finished: Literal[True] = True


class ErrorBody(BaseModel):
    """Every non-2xx JSON body of both services."""

    error: str
    reason: str
    request_id: str
