"""Internal events -> Anthropic's Messages wire format: a stream of typed events, or one whole `message`.

Owns: the `message` object built from a generation (its content: one text block, or with tools the
`tool_use` blocks the answer makes; its stop reason; its usage with the worker's real prompt-cache
reuse), the order of the streamed events (`message_start`, `ping`, then per block
`content_block_start`, its deltas and `content_block_stop`, then `message_delta` with the stop reason
and the whole usage, `message_stop`), and the `error` event that ends a stream that has started.
With tools an answer is held while it may be calls (`tools.may_be_call`): text whose start rules a call
out streams from then on; a held answer goes out at its end as a text block or, per call, a `tool_use`
block with its input in `input_json_delta` pieces, as chat streams a held answer (openai_format.py).
Must not: parse requests or touch the relay; `EventEncoder` is a `response.Encoder`, and `assemble`
turns a collected stream into a response.

Why the per-token event is formatted from a string template rather than a pydantic model: it runs once
per streamed token on the coordinator's one core (as openai_format.py's chunks do). The events around it
are a handful per stream, built from the pydantic types in protocol/anthropic.py; the tests parse every
event back through the official `anthropic` client.

Usage: `cache_read_input_tokens` is what the worker reused from its prefix cache; the rest of the prompt
is `cache_creation_input_tokens` when the request had a `cache_control` breakpoint (its cells are kept:
the whole prompt's, not only up to the breakpoint), else `input_tokens`. The
reuse is known when the worker ends the answer, so `message_start` carries the whole prompt's length
as `input_tokens` (what the worker admitted) and `message_delta` the split; its counts are cumulative,
and the SDK takes them over `message_start`'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import orjson
from fastapi.responses import JSONResponse
from starlette.responses import Response

from coordinator.errors import STATUS_BY_REASON
from coordinator.surfaces.openai_format import ARGUMENT_PIECE
from coordinator.surfaces.tools import Tools, may_be_call, read_calls
from protocol import anthropic as an
from protocol import reasons
from protocol.sse import SseEvent
from protocol.worker import EVENT_DONE, EVENT_ERROR, EVENT_TOKEN, DoneEvent, ErrorEvent

STOP_REASONS: dict[str, an.StopReason] = {"length": "max_tokens", "stop": "end_turn", "cancelled": "end_turn"}
PROMPT_TOO_LONG = "prompt is too long"  # how Anthropic's message starts, which Claude Code reads to compact


@dataclass(frozen=True, slots=True)
class Shape:
    """One request's `message`: the same id and model at every stage, the tools its answer may call,
    and the prompt's length as the worker admitted it (None: not known, a response-cache replay);
    `kept`: it had `cache_control` breakpoints (its cells kept: `usage_of`)."""

    request_id: str
    model: str
    tools: Tools | None = None
    prompt_tokens: int | None = None
    kept: bool = False

    @property
    def message_id(self) -> str:
        return an.MESSAGE_ID_PREFIX + self.request_id

    def calls(self, text: str) -> list[an.ToolUseBlock] | None:
        """The calls a whole answer makes (with tools that are called, and an answer that is exactly
        calls: coordinator/surfaces/tools.py's format); None when it is text."""
        tools = self.tools
        found = read_calls(text, tools, self.request_id) if tools is not None and tools.calling else None
        if found is None:
            return None
        return [an.ToolUseBlock(id=tool_use_id(call.id), name=call.function.name,
                                input=json.loads(call.function.arguments)) for call in found]

    def message(self, content: list[an.TextBlock | an.ToolUseBlock], stop_reason: an.StopReason | None,
                usage: an.Usage) -> an.Message:
        return an.Message(id=self.message_id, model=self.model, content=content, stop_reason=stop_reason, usage=usage)

    def started(self) -> an.Message:
        return self.message([], None, an.Usage(input_tokens=self.prompt_tokens or 0, output_tokens=0))


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic writes them (`toolu_...`), from the one tools.py made (`call_...`)."""
    return an.TOOL_USE_ID_PREFIX + call_id.removeprefix("call_")


def usage_of(done: DoneEvent, kept: bool = False) -> an.Usage:
    """The worker's counts as Anthropic splits them: reused cells are read from the cache; the rest of the
    prompt was written to it when the request's cells are kept (`kept`: it had a breakpoint), else input."""
    u = done.usage
    cached = min(u.cached_tokens, u.prompt_tokens)
    rest = u.prompt_tokens - cached
    return an.Usage(input_tokens=0 if kept else rest, output_tokens=u.completion_tokens,
                    cache_creation_input_tokens=rest if kept else 0, cache_read_input_tokens=cached)


def stop_reason(done: DoneEvent) -> an.StopReason:
    return STOP_REASONS.get(done.finish_reason, "end_turn")


def error_status(reason: str) -> int:
    """A prompt longer than the session holds is Anthropic's 400 `invalid_request_error` ("prompt is too
    long"), as Claude Code expects it; every other reason keeps its status."""
    return 400 if reason == reasons.PROMPT_TOO_LONG else STATUS_BY_REASON.get(reason, 500)


def error_message(reason: str, message: str) -> str:
    return f"{PROMPT_TOO_LONG}: {message}" if reason == reasons.PROMPT_TOO_LONG else message


def _frame(kind: str, data: str) -> bytes:
    return f"event: {kind}\ndata: {data}\n\n".encode()


class EventEncoder:
    """One stream's events. `message_start` and a `ping` go out with the first event; a text block opens
    with the first piece of text and streams; `done` closes it (or sends the held answer's blocks) and
    ends the message; an `error` event ends the stream at any point."""

    __slots__ = ("_blocks", "_delta", "_held", "_open", "_shape", "_started")

    def __init__(self, shape: Shape) -> None:
        self._shape = shape
        self._started = False  # message_start and ping are sent
        self._open = False  # a text block is open (always the last block)
        self._blocks = 0  # blocks started so far
        self._delta = ""  # the head of the open text block's deltas
        calling = shape.tools is not None and shape.tools.calling
        self._held: list[str] | None = [] if calling else None  # the answer while it may be calls

    def __call__(self, event: SseEvent) -> bytes:
        if event.event == EVENT_TOKEN:
            piece = orjson.loads(event.data)["token"]
            held = self._held
            if held is None:
                return self._start() + self._text_open() + self._text(piece)
            held.append(piece)
            tools = self._shape.tools
            if tools is not None and may_be_call(held, tools):
                return self._start()
            self._held = None  # text: what was held goes out as it came, the rest as it comes
            return self._start() + self._text_open() + b"".join(self._text(p) for p in held)
        if event.event == EVENT_DONE:
            return self._start() + self._end(DoneEvent.model_validate_json(event.data))
        if event.event == EVENT_ERROR:
            error = ErrorEvent.model_validate_json(event.data)
            body = an.error_body(error_message(error.reason, error.error), status=error_status(error.reason))
            return _frame(an.ERROR, json.dumps(body))
        return b""

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        start = an.MessageStartEvent(message=self._shape.started()).model_dump_json()
        return _frame(an.MESSAGE_START, start) + _frame(an.PING, '{"type":"ping"}')

    def _text_open(self) -> bytes:
        """The text block's start (b"" once it is open)."""
        if self._open:
            return b""
        self._open = True
        index, frame = self._block_start({"type": "text", "text": ""})
        self._delta = f'{{"type":"{an.CONTENT_BLOCK_DELTA}","index":{index},"delta":{{"type":"{an.TEXT_DELTA}","text":'
        return frame

    def _text(self, piece: str) -> bytes:
        return _frame(an.CONTENT_BLOCK_DELTA, f"{self._delta}{json.dumps(piece)}}}}}")

    def _block_start(self, block: dict[str, object]) -> tuple[int, bytes]:
        """The next block's index and its `content_block_start`."""
        index = self._blocks
        self._blocks += 1
        return index, _frame(an.CONTENT_BLOCK_START, json.dumps(
            {"type": an.CONTENT_BLOCK_START, "index": index, "content_block": block}, ensure_ascii=False))

    def _stop(self, index: int) -> bytes:
        return _frame(an.CONTENT_BLOCK_STOP, f'{{"type":"{an.CONTENT_BLOCK_STOP}","index":{index}}}')

    def _end(self, done: DoneEvent) -> bytes:
        """The held answer's blocks (calls, or its text), the open block's stop, and the message's end."""
        frames, reason = b"", stop_reason(done)
        held, self._held = self._held, None
        calls = self._shape.calls("".join(held)) if held is not None else None
        if calls is not None:
            reason = "tool_use"
            for call in calls:
                index, frame = self._block_start({"type": an.TOOL_USE, "id": call.id, "name": call.name, "input": {}})
                frames += frame
                arguments = json.dumps(call.input, ensure_ascii=False)
                for at in range(0, len(arguments), ARGUMENT_PIECE):
                    piece = json.dumps({"type": an.INPUT_JSON_DELTA, "partial_json": arguments[at:at + ARGUMENT_PIECE]},
                                       ensure_ascii=False)
                    frames += _frame(an.CONTENT_BLOCK_DELTA,
                                     f'{{"type":"{an.CONTENT_BLOCK_DELTA}","index":{index},"delta":{piece}}}')
                frames += self._stop(index)
        else:  # text: what was held (if anything), in an empty block when there was none
            frames += self._text_open() + b"".join(self._text(piece) for piece in held or () if piece)
            frames += self._stop(self._blocks - 1)
        delta = an.MessageDeltaEvent(delta=an.MessageDelta(stop_reason=reason), usage=usage_of(done, self._shape.kept))
        return frames + _frame(an.MESSAGE_DELTA, delta.model_dump_json()) + _frame(an.MESSAGE_STOP,
                                                                                   '{"type":"message_stop"}')


def assemble(shape: Shape, events: list[SseEvent], *, headers: dict[str, str]) -> Response:
    """The whole answer of a non-streamed request from its collected events; a failure is an HTTP error
    in Anthropic's shape, since nothing was sent yet."""
    pieces: list[str] = []
    for event in events:
        if event.event == EVENT_TOKEN:
            pieces.append(orjson.loads(event.data)["token"])
        elif event.event == EVENT_DONE:
            done = DoneEvent.model_validate_json(event.data)
            text = "".join(pieces)
            calls = shape.calls(text)
            content: list[an.TextBlock | an.ToolUseBlock] = list(calls) if calls else [an.TextBlock(text=text)]
            message = shape.message(content, "tool_use" if calls else stop_reason(done), usage_of(done, shape.kept))
            return JSONResponse(message.model_dump(), headers=headers)
        elif event.event == EVENT_ERROR:
            error = ErrorEvent.model_validate_json(event.data)
            status = error_status(error.reason)
            return JSONResponse(an.error_body(error_message(error.reason, error.error), status=status,
                                              request_id=error.request_id), status_code=status, headers=headers)
    # The relay always ends with done or error; guard rather than assume.
    return JSONResponse(an.error_body("the stream ended without a result", status=502), status_code=502,
                        headers=headers)
