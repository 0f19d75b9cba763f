"""Internal events -> OpenAI's Responses wire format: a stream of typed `response.*` events, or one
whole `response` object.

Owns: the `response` object built from a generation (its status from the finish reason, its one
output message, usage, and the request fields it repeats), the order and sequence numbers of the
streamed events, and the `response.failed` event that ends a stream that has started.
Must not: parse requests or touch the relay; `EventEncoder` is a `response.Encoder`, and `assemble`
turns a collected stream into a response.

Why the per-token event is formatted from a string template rather than a pydantic model: it runs
once per streamed token on the coordinator's one core (as openai_format.py's chunks do). The events
around it are a handful per stream and are built from the pydantic types in
protocol/openai_responses.py; the tests parse every event back through those types and through the
official `openai` client.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from starlette.responses import Response

from coordinator.errors import STATUS_BY_REASON
from protocol import openai as oa
from protocol import openai_responses as rs
from protocol.sse import SseEvent
from protocol.worker import EVENT_DONE, EVENT_ERROR, EVENT_TOKEN, DoneEvent, ErrorEvent


@dataclass(frozen=True, slots=True)
class Echo:
    """What a `response` object repeats of its request (sampling as the worker applies it: the
    client's value or the pool's default)."""

    stream: bool
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True
    tool_choice: rs.ToolChoice = "auto"
    user: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Shape:
    """One request's `response` objects: the same id, creation time, model and echo at every stage."""

    echo: Echo
    request_id: str
    created_at: int
    model: str

    @property
    def response_id(self) -> str:
        return rs.RESPONSE_ID_PREFIX + self.request_id

    @property
    def message_id(self) -> str:
        return rs.MESSAGE_ID_PREFIX + self.request_id

    def message(self, text: str, status: rs.MessageStatus) -> rs.OutputMessage:
        return rs.OutputMessage(id=self.message_id, status=status, content=[rs.OutputText(text=text)])

    def response(self, status: rs.Status, output: list[rs.OutputMessage], *, done: DoneEvent | None = None,
                  error: ErrorEvent | None = None, completed_at: int | None = None) -> rs.ResponseObject:
        echo = self.echo
        return rs.ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, completed_at=completed_at,
            error=rs.ResponseError(code=error.reason, message=error.error) if error is not None else None,
            incomplete_details=rs.IncompleteDetails() if status == "incomplete" else None,
            instructions=echo.instructions, max_output_tokens=echo.max_output_tokens, model=self.model,
            output=output, parallel_tool_calls=echo.parallel_tool_calls, temperature=echo.temperature,
            tool_choice=echo.tool_choice, top_p=echo.top_p, user=echo.user, metadata=echo.metadata,
            usage=usage_of(done) if done is not None else None)

    def finished(self, text: str, done: DoneEvent, now: float) -> rs.ResponseObject:
        """The response of a generation that ended with `done`: incomplete when it ran out of tokens
        (`max_output_tokens`, or the session's KV limit), completed otherwise."""
        if done.finish_reason == "length":
            return self.response("incomplete", [self.message(text, "incomplete")], done=done)
        return self.response("completed", [self.message(text, "completed")], done=done, completed_at=int(now))

    def failed(self, text: str | None, error: ErrorEvent) -> rs.ResponseObject:
        """A generation that broke off: what was streamed so far (None: nothing began), and why."""
        output = [self.message(text, "incomplete")] if text is not None else []
        return self.response("failed", output, error=error)


def usage_of(done: DoneEvent) -> rs.ResponseUsage:
    u = done.usage
    return rs.ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens, total_tokens=u.total_tokens,
                            input_tokens_details=rs.InputTokensDetails(cached_tokens=u.cached_tokens))


def error_status(error: ErrorEvent) -> int:
    return STATUS_BY_REASON.get(error.reason, 500)


class EventEncoder:
    """One stream's events. The opening events (`created`, `in_progress`, the message item and its
    text part) go out with the first token; `done` closes the part, the item and the response, and an
    `error` at any point ends it with `response.failed`."""

    __slots__ = ("_delta", "_now", "_opened", "_pieces", "_sequence", "_shape", "_started")

    def __init__(self, shape: Shape, *, now: Callable[[], float]) -> None:
        self._shape = shape
        self._now = now
        self._sequence = 0
        self._started = False  # response.created and response.in_progress are sent
        self._opened = False  # the message item and its text part are announced
        self._pieces: list[str] = []
        self._delta = (f',"item_id":{json.dumps(shape.message_id)},"output_index":0,"content_index":0,'
                       '"delta":')

    def __call__(self, event: SseEvent) -> bytes:
        # One call may build several events; if it raises, none of them reaches the client, so the
        # encoder goes back to where it was and the `response.failed` that the relay then asks for
        # still follows the events the client did get (created first, sequence numbers unbroken).
        before = (self._started, self._opened, self._sequence, len(self._pieces))
        try:
            return self._encode(event)
        except Exception:
            self._started, self._opened, self._sequence, pieces = before
            del self._pieces[pieces:]
            raise

    def _encode(self, event: SseEvent) -> bytes:
        if event.event == EVENT_TOKEN:
            return self._open() + self._text(json.loads(event.data)["token"])
        if event.event == EVENT_DONE:
            return self._open() + self._close(DoneEvent.model_validate_json(event.data))
        if event.event == EVENT_ERROR:
            return self._start() + self._fail(ErrorEvent.model_validate_json(event.data))
        return b""

    def _text(self, text: str) -> bytes:
        self._pieces.append(text)
        sequence = self._next()
        return (f'event: {rs.OUTPUT_TEXT_DELTA}\ndata: {{"type":"{rs.OUTPUT_TEXT_DELTA}","sequence_number":{sequence}'
                f'{self._delta}{json.dumps(text)},"logprobs":[]}}\n\n').encode()

    def _start(self) -> bytes:
        """`response.created` and `response.in_progress` (b"" after them)."""
        if self._started:
            return b""
        self._started = True
        frames = self._response_event(rs.CREATED, self._shape.response("in_progress", []))
        return frames + self._response_event(rs.IN_PROGRESS, self._shape.response("in_progress", []))

    def _open(self) -> bytes:
        """The events before the first piece of text: the message item and its empty text part (b""
        after them)."""
        if self._opened:
            return b""
        self._opened = True
        frames = self._start()
        empty = rs.OutputMessage(id=self._shape.message_id, status="in_progress", content=[])
        frames += self._frame(rs.OutputItemEvent(type=rs.OUTPUT_ITEM_ADDED, sequence_number=self._next(),
                                                 output_index=0, item=empty))
        return frames + self._part(rs.CONTENT_PART_ADDED, "")

    def _close(self, done: DoneEvent) -> bytes:
        shape, text = self._shape, "".join(self._pieces)
        response = shape.finished(text, done, self._now())
        frames = self._frame(rs.TextDoneEvent(sequence_number=self._next(), item_id=shape.message_id, output_index=0,
                                              content_index=0, text=text))
        frames += self._part(rs.CONTENT_PART_DONE, text)
        frames += self._frame(rs.OutputItemEvent(type=rs.OUTPUT_ITEM_DONE, sequence_number=self._next(),
                                                 output_index=0, item=response.output[0]))
        return frames + self._response_event(rs.INCOMPLETE if response.status == "incomplete" else rs.COMPLETED,
                                             response)

    def _fail(self, error: ErrorEvent) -> bytes:
        text = "".join(self._pieces) if self._opened else None
        return self._response_event(rs.FAILED, self._shape.failed(text, error))

    def _part(self, kind: str, text: str) -> bytes:
        return self._frame(rs.ContentPartEvent(type=kind, sequence_number=self._next(), item_id=self._shape.message_id,
                                               output_index=0, content_index=0, part=rs.OutputText(text=text)))

    def _response_event(self, kind: str, response: rs.ResponseObject) -> bytes:
        return self._frame(rs.ResponseEvent(type=kind, sequence_number=self._next(), response=response))

    @staticmethod
    def _frame(event: rs.ResponseEvent | rs.OutputItemEvent | rs.ContentPartEvent | rs.TextDoneEvent) -> bytes:
        return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n".encode()

    def _next(self) -> int:
        """The next event's `sequence_number`: taken as each event is built, in the order they are sent."""
        sequence, self._sequence = self._sequence, self._sequence + 1
        return sequence


def assemble(shape: Shape, events: list[SseEvent], *, headers: dict[str, str],
             now: Callable[[], float]) -> Response:
    """The whole answer of a non-streamed request from its collected events; a failure is an HTTP
    error in OpenAI's shape, since nothing was sent yet."""
    pieces: list[str] = []
    for event in events:
        if event.event == EVENT_TOKEN:
            pieces.append(json.loads(event.data)["token"])
        elif event.event == EVENT_DONE:
            response = shape.finished("".join(pieces), DoneEvent.model_validate_json(event.data), now())
            return JSONResponse(response.model_dump(mode="json"), headers=headers)
        elif event.event == EVENT_ERROR:
            error = ErrorEvent.model_validate_json(event.data)
            status = error_status(error)
            return JSONResponse(oa.error_body(error.error, status=status, code=error.reason), status_code=status,
                                headers=headers)
    # The relay always ends with done or error; guard rather than assume.
    return JSONResponse(oa.error_body("the stream ended without a result", status=502, code="worker_failed"),
                        status_code=502, headers=headers)
