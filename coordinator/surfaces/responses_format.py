"""Internal events -> OpenAI's Responses wire format: a stream of typed `response.*` events, or one
whole `response` object.

Owns: the `response` object built from a generation (its status from the finish reason, its output:
one message, or with function tools the calls the answer makes, usage, and the request fields it
repeats), the order and sequence numbers of the streamed events, and the `response.failed` event
that ends a stream that has started. With function tools an answer is held while it may be calls
(`tools.may_be_call`): text whose start rules a call out streams from then on; a held answer goes out
at its end as a message's events or, per call, its item, its arguments in pieces and their end, as
chat streams a held answer (openai_format.py).
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi.responses import JSONResponse
from starlette.responses import Response

from coordinator.errors import STATUS_BY_REASON
from coordinator.surfaces.openai_format import ARGUMENT_PIECE
from coordinator.surfaces.tools import Tools, may_be_call, read_calls
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
    tools: Tools | None = None  # the answer is read for calls when `tools.calling`
    listed_tools: list[dict[str, Any]] = field(default_factory=list)  # the request's tools, as given
    text_format: dict[str, Any] | None = None  # the request's `text.format`, as given
    reasoning: rs.Reasoning = field(default_factory=rs.Reasoning)  # the request's, as given
    store: bool = False
    previous_response_id: str | None = None  # the response this one continues (the WebSocket's chains)


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

    def calls(self, text: str) -> list[rs.FunctionCallItem] | None:
        """The function calls a whole answer makes (with tools that are called, and an answer that is
        exactly calls: coordinator/surfaces/tools.py's format); None when it is text."""
        tools = self.echo.tools
        found = read_calls(text, tools, self.request_id) if tools is not None and tools.calling else None
        if found is None:
            return None
        base = rs.FUNCTION_CALL_ID_PREFIX + self.request_id
        return [rs.FunctionCallItem(id=base if k == 0 else f"{base}_{k}", call_id=call.id, name=call.function.name,
                                    arguments=call.function.arguments, status="completed")
                for k, call in enumerate(found)]

    def response(self, status: rs.Status, output: Sequence[rs.OutputMessage | rs.FunctionCallItem], *,
                 done: DoneEvent | None = None,
                  error: ErrorEvent | None = None, completed_at: int | None = None) -> rs.ResponseObject:
        echo = self.echo
        return rs.ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, completed_at=completed_at,
            error=rs.ResponseError(code=error.reason, message=error.error) if error is not None else None,
            incomplete_details=rs.IncompleteDetails() if status == "incomplete" else None,
            instructions=echo.instructions, max_output_tokens=echo.max_output_tokens, model=self.model,
            output=list(output), parallel_tool_calls=echo.parallel_tool_calls, temperature=echo.temperature,
            tool_choice=echo.tool_choice, tools=echo.listed_tools, top_p=echo.top_p, user=echo.user,
            metadata=echo.metadata, text=rs.TextSettings(format=echo.text_format or dict(rs.TEXT_FORMAT)),
            reasoning=echo.reasoning, store=echo.store, previous_response_id=echo.previous_response_id,
            usage=usage_of(done) if done is not None else None)

    def finished(self, text: str, done: DoneEvent, now: float) -> rs.ResponseObject:
        """The response of a generation that ended with `done`: its calls when the answer is calls
        (completed), else its message: incomplete when it ran out of tokens (`max_output_tokens`, or
        the session's KV limit), completed otherwise."""
        calls = self.calls(text)
        if calls is not None:
            return self.response("completed", calls, done=done, completed_at=int(now))
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
    `error` at any point ends it with `response.failed`. With tools that are called, the first token
    sends only `created` and `in_progress`, and the answer is held while it may be a call: one whose
    start rules a call out goes out at once and streams from then on; a call goes out with `done`."""

    __slots__ = ("_delta", "_held", "_now", "_opened", "_pieces", "_sequence", "_shape", "_started", "ended")

    def __init__(self, shape: Shape, *, now: Callable[[], float]) -> None:
        self._shape = shape
        self._now = now
        self._sequence = 0
        self._started = False  # response.created and response.in_progress are sent
        self._opened = False  # the message item and its text part are announced
        self._pieces: list[str] = []
        self._delta = (f',"item_id":{json.dumps(shape.message_id)},"output_index":0,"content_index":0,'
                       '"delta":')
        self._held = shape.echo.tools is not None and shape.echo.tools.calling
        self.ended: rs.ResponseObject | None = None  # the response its terminal event carried, once built

    def __call__(self, event: SseEvent) -> bytes:
        # One call may build several events; if it raises, none of them reaches the client, so the
        # encoder goes back to where it was and the `response.failed` that the relay then asks for
        # still follows the events the client did get (created first, sequence numbers unbroken).
        before = (self._started, self._opened, self._sequence, self._held, len(self._pieces), self.ended)
        try:
            return self._encode(event)
        except Exception:
            self._started, self._opened, self._sequence, self._held, pieces, self.ended = before
            del self._pieces[pieces:]
            raise

    def _encode(self, event: SseEvent) -> bytes:
        if event.event == EVENT_TOKEN:
            if self._held:
                self._pieces.append(orjson.loads(event.data)["token"])
                tools = self._shape.echo.tools
                if tools is not None and not may_be_call(self._pieces, tools):
                    self._held = False  # text: what was held goes out as it came, the rest as it comes
                    return self._open() + b"".join(self._delta_frame(piece) for piece in self._pieces)
                return self._start()
            return self._open() + self._text(orjson.loads(event.data)["token"])
        if event.event == EVENT_DONE:
            done = DoneEvent.model_validate_json(event.data)
            if self._held:
                return self._release(done)
            return self._open() + self._close(done)
        if event.event == EVENT_ERROR:
            return self._start() + self._fail(ErrorEvent.model_validate_json(event.data))
        return b""

    def _text(self, text: str) -> bytes:
        self._pieces.append(text)
        return self._delta_frame(text)

    def _delta_frame(self, text: str) -> bytes:
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

    def _release(self, done: DoneEvent) -> bytes:
        """A held answer, whole: each call's item, its arguments in pieces and their end; or, when the
        answer is text, the message's events as if it had streamed as one piece."""
        text = "".join(self._pieces)
        calls = self._shape.calls(text)
        if calls is None:
            return self._open() + b"".join(self._delta_frame(piece) for piece in self._pieces if piece) + self._close(done)
        frames = self._start()
        for index, call in enumerate(calls):
            item = call.model_copy(update={"arguments": "", "status": "in_progress"})
            frames += self._frame(rs.OutputItemEvent(type=rs.OUTPUT_ITEM_ADDED, sequence_number=self._next(),
                                                     output_index=index, item=item))
            for at in range(0, len(call.arguments), ARGUMENT_PIECE):
                frames += self._frame(rs.ArgumentsDeltaEvent(sequence_number=self._next(), item_id=call.id,
                                                             output_index=index,
                                                             delta=call.arguments[at:at + ARGUMENT_PIECE]))
            frames += self._frame(rs.ArgumentsDoneEvent(sequence_number=self._next(), item_id=call.id,
                                                        output_index=index, name=call.name, arguments=call.arguments))
            frames += self._frame(rs.OutputItemEvent(type=rs.OUTPUT_ITEM_DONE, sequence_number=self._next(),
                                                     output_index=index, item=call))
        return frames + self._response_event(rs.COMPLETED, self._shape.finished(text, done, self._now()))

    def _fail(self, error: ErrorEvent) -> bytes:
        text = "".join(self._pieces) if self._opened else None
        return self._response_event(rs.FAILED, self._shape.failed(text, error))

    def _part(self, kind: str, text: str) -> bytes:
        return self._frame(rs.ContentPartEvent(type=kind, sequence_number=self._next(), item_id=self._shape.message_id,
                                               output_index=0, content_index=0, part=rs.OutputText(text=text)))

    def _response_event(self, kind: str, response: rs.ResponseObject) -> bytes:
        if kind in rs.TERMINAL_EVENTS:
            self.ended = response
        return self._frame(rs.ResponseEvent(type=kind, sequence_number=self._next(), response=response))

    @staticmethod
    def _frame(event: rs.ResponseEvent | rs.OutputItemEvent | rs.ContentPartEvent | rs.TextDoneEvent
               | rs.ArgumentsDeltaEvent | rs.ArgumentsDoneEvent) -> bytes:
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
            pieces.append(orjson.loads(event.data)["token"])
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
