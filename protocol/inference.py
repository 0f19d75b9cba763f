"""The public contract of `POST /coordinator/infer`: its request, and the events it streams.

Owns: the fields, defaults and ranges of `InferRequest` (a prompt, sampling, session; unknown fields
refused) and the documented shape of the surface's token/done/error events.
Must not: be posted to workers. The coordinator's infer surface turns an `InferRequest` into the
internal `protocol.worker.GenerateRequest`; a field added here reaches workers only through it.

The surface's events are, by design, the internal events of protocol version 1 as they are (they
were one contract before the split), so the surface relays them without re-encoding; the names below
are re-exported so readers of this contract find them here. Should the internal events change, the
infer surface must map them back to these shapes (tests/coordinator/test_surface_infer.py pins them).
Version 4's `TokenEvent.choice` and `DoneEvent.choices` (several choices per request) never appear
here: this surface asks for one choice, and a one-choice event leaves both out of its JSON.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from protocol.worker import (
    EVENT_DONE,
    EVENT_ERROR,
    EVENT_TOKEN,
    MAX_PROMPT_CHARS,
    DoneEvent,
    ErrorBody,
    ErrorEvent,
    FinishReason,
    GenerationFields,
    Timings,
    TokenEvent,
    Usage,
)

# Priority classes, lowest first (a key's default and highest class, the X-Priority header, this
# surface's `priority` field): a higher class goes first where requests wait.
PRIORITY_CLASSES = ("batch", "interactive")

__all__ = [
    "EVENT_DONE",
    "EVENT_ERROR",
    "EVENT_TOKEN",
    "PRIORITY_CLASSES",
    "DoneEvent",
    "ErrorBody",
    "ErrorEvent",
    "FinishReason",
    "InferRequest",
    "Timings",
    "TokenEvent",
    "Usage",
]


class InferRequest(GenerationFields):
    """`POST /coordinator/infer`'s body: one prompt (a user turn, or raw text with `raw`)."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    priority: Literal["interactive", "batch"] | None = Field(
        default=None, description="the request's priority class (as the X-Priority header): interactive goes "
        "before batch where requests wait; default: the API key's default class (interactive without keys). A "
        "class above the key's highest is refused with 400. An interactive request that finds every sequence "
        "taken may park a running batch request, which resumes where it stopped: its stream pauses, never fails")
