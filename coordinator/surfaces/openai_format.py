"""Internal events -> OpenAI's wire format: streamed chunks (`data: {...}` ... `data: [DONE]`) or one
whole `chat.completion` / `text_completion` object.

Owns: the chunk shapes of both endpoints, one choice or several (`n`: each token event names its
choice, and `done` how each one ended), the finish-reason mapping, logprobs (the chosen token's,
from the probability every token event carries), the usage chunk of `stream_options.include_usage`
(every choice's tokens, the prompt once), and the error chunk that ends a stream that has started.
Must not: parse requests or touch the relay; `ChunkEncoder` is a `response.Encoder`, and `assemble`
turns a collected stream into a response.

Why chunks are formatted from string templates rather than pydantic models: this runs once per
streamed token on the coordinator's one core; the tests parse every shape back through the pydantic
types in protocol/openai.py and through the official `openai` client.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from fastapi.responses import JSONResponse
from starlette.responses import Response

from coordinator.errors import STATUS_BY_REASON
from coordinator.surfaces.tools import Tools, may_be_call, read_calls
from protocol import openai as oa
from protocol.sse import SseEvent
from protocol.worker import (
    EVENT_DONE,
    EVENT_ERROR,
    EVENT_PROMPT,
    EVENT_TOKEN,
    DoneEvent,
    ErrorEvent,
    PromptEvent,
)

Kind = Literal["chat", "text"]
DONE_FRAME = b"data: [DONE]\n\n"
ARGUMENT_PIECE = 24  # characters of a tool call's arguments per streamed chunk
MIN_LOGPROB = -9999.0  # OpenAI's floor, instead of -inf (not valid JSON) for a probability of 0


@dataclass(frozen=True, slots=True)
class Options:
    kind: Kind
    stream: bool
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    tools: Tools | None = None  # the answer is read for a tool call when `tools.calling`
    n: int = 1  # choices
    # A completion's `echo`: each choice's text starts with the prompt; the worker's `prompt` events
    # give it (its tokens' texts, and their logprobs when asked), else `echo_text` does (the prompt as given).
    echo: bool = False
    echo_text: str | None = None


def finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def logprob(probability: float) -> float:
    return math.log(probability) if probability > 0.0 else MIN_LOGPROB


def fingerprint_of(model_identity: str) -> str:
    """OpenAI's `system_fingerprint`: it changes when what serves the model changes, here the model's
    identity as its worker reports it (its file's digest)."""
    if not model_identity:
        return oa.FINGERPRINT_UNKNOWN
    return "fp_" + hashlib.sha256(model_identity.encode()).hexdigest()[:12]


def completion_id(kind: Kind, request_id: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


def usage_of(done: DoneEvent) -> oa.CompletionUsage:
    u = done.usage
    return oa.CompletionUsage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                              total_tokens=u.total_tokens, prompt_tokens_details={"cached_tokens": u.cached_tokens})


def error_detail(error: ErrorEvent) -> dict[str, Any]:
    status = STATUS_BY_REASON.get(error.reason, 500)
    return oa.error_body(error.error, status=status, code=error.reason)


class ChunkEncoder:
    """One stream's chunks. A chat opens each choice with a chunk that carries only the assistant role (and
    empty content), and closes it with an empty `delta` and the finish reason, as OpenAI streams them.
    With several choices each chunk carries one choice's `index`; the worker reports how each ended in
    its one `done` event, so every choice's closing chunk goes out then, in index order."""

    __slots__ = ("_base", "_choice", "_echoed", "_first", "_held", "_offset", "_options", "_request_id", "_tail")

    def __init__(self, options: Options, *, request_id: str, created: int, model: str,
                 fingerprint: str = oa.FINGERPRINT_UNKNOWN) -> None:
        obj = "chat.completion.chunk" if options.kind == "chat" else "text_completion"
        ident = completion_id(options.kind, request_id)
        self._options = options
        self._base = (f'{{"id":{json.dumps(ident)},"object":"{obj}","created":{created},"model":{json.dumps(model)},'
                      f'"system_fingerprint":{json.dumps(fingerprint)},')
        # Per choice: the head of its chunks, whether its role chunk is still to come, its text offset.
        self._choice = [self._base + f'"choices":[{{"index":{i},' for i in range(options.n)]
        self._tail = "}]" + (',"usage":null' if options.include_usage else "") + "}"
        self._first = [True] * options.n
        self._offset = [0] * options.n
        self._request_id = request_id
        self._echoed = not options.echo  # the prompt is in every choice's text (or none was asked for)
        # With tools, each answer is held (its pieces and their probabilities) while it may be a call; one
        # whose start rules a call out goes out at once and streams from then on (None: not held).
        calling = options.tools is not None and options.tools.calling
        self._held: list[list[tuple[str, float]] | None] = [[] if calling else None for _ in range(options.n)]

    def __call__(self, event: SseEvent) -> bytes:
        if event.event == EVENT_PROMPT:
            self._echoed = True
            return self._prompt(PromptEvent.model_validate_json(event.data))
        if not self._echoed and event.event != EVENT_ERROR:
            self._echoed = True
            return self._echo_text() + self(event)
        if event.event == EVENT_TOKEN:
            data = orjson.loads(event.data)
            i = data.get("choice", 0)
            held = self._held[i]
            if held is not None:
                held.append((data["token"], data["probability"]))
                return self._opening(i) + self._release(i, held)
            return self._opening(i) + self._frame(i, self._piece(i, data["token"], data["probability"],
                                                                 data.get("top")))
        if event.event == EVENT_DONE:
            return self._done(DoneEvent.model_validate_json(event.data))
        if event.event == EVENT_ERROR:
            error = json.dumps(error_detail(ErrorEvent.model_validate_json(event.data)))
            return b"data: " + error.encode() + b"\n\n" + DONE_FRAME
        return b""

    def _prompt(self, scored: PromptEvent) -> bytes:
        """Some of the prompt's tokens, scored, at the start of every choice's text (`echo`)."""
        text = "".join(scored.tokens)
        quoted = json.dumps(text)
        frames = b""
        for i in range(self._options.n):
            lp = "null"
            if self._options.logprobs:
                lp = json.dumps(prompt_logprobs((scored,), self._options.top_logprobs, self._offset[i]).model_dump())
            self._offset[i] += len(text)
            frames += self._frame(i, f'"text":{quoted},"logprobs":{lp},"finish_reason":null')
        return frames

    def _echo_text(self) -> bytes:
        """The prompt as given at the start of every choice's text (`echo` with no scores asked for)."""
        text = self._options.echo_text or ""
        frames = b""
        for i in range(self._options.n):
            self._offset[i] += len(text)
            frames += self._frame(i, f'"text":{json.dumps(text)},"logprobs":null,"finish_reason":null')
        return frames

    def _release(self, i: int, held: list[tuple[str, float]]) -> bytes:
        """Choice i's held pieces, once its start shows it is no call: as they would have streamed."""
        assert self._options.tools is not None
        if may_be_call((text for text, _ in held), self._options.tools):
            return b""
        self._held[i] = None
        return b"".join(self._frame(i, self._piece(i, text, probability)) for text, probability in held)

    def _piece(self, i: int, text: str, probability: float, top: Top | None = None) -> str:
        options, quoted = self._options, json.dumps(text)
        lp = self._logprobs(i, text, probability, top) if options.logprobs else "null"
        if options.kind == "text":
            self._offset[i] += len(text)
            return f'"text":{quoted},"logprobs":{lp},"finish_reason":null'
        return f'"delta":{{"content":{quoted}}},"logprobs":{lp},"finish_reason":null'

    def _opening(self, i: int) -> bytes:
        """A chat choice's first chunk, role only, before its first content (b"" after it, and for text).
        Its `content` is null, as llama-server sends it (OpenAI sends "", its schema allows both): llama.cpp's
        own server suite holds a chunk's `content` to absent, null or not empty."""
        if not self._first[i] or self._options.kind != "chat":
            return b""
        self._first[i] = False
        return self._frame(i, '"delta":{"role":"assistant","content":null},"logprobs":null,"finish_reason":null')

    def _logprobs(self, i: int, text: str, probability: float, top: Top | None) -> str:
        value, k = logprob(probability), self._options.top_logprobs
        if self._options.kind == "text":
            return json.dumps({"tokens": [text], "token_logprobs": [value], "top_logprobs": text_top(text, value, top, k),
                               "text_offset": [self._offset[i]]})
        entry: dict[str, Any] = {"token": text, "logprob": value, "bytes": list(text.encode())}
        return json.dumps({"content": [{**entry, "top_logprobs": [t.model_dump() for t in chat_top(text, value, top, k)]}]})

    def _done(self, done: DoneEvent) -> bytes:
        frames = b"".join(self._close(i, reason) for i, reason in enumerate(choice_endings(done)))
        if self._options.include_usage:
            usage = usage_of(done).model_dump_json()
            frames += b"data: " + (self._base + f'"choices":[],"usage":{usage}}}').encode() + b"\n\n"
        return frames + DONE_FRAME

    def _close(self, i: int, ending: str) -> bytes:
        """Choice i's last chunks: its held answer (a tool call, or text) if any, then its finish reason."""
        reason = json.dumps(finish_reason(ending))
        held = self._held[i]
        if held is not None and self._options.tools is not None:
            text = "".join(piece for piece, _ in held)
            calls = read_calls(text, self._options.tools, self._request_id, choice=i)
            if calls is None:  # text after all (a start like a call's that did not become one): as it came
                pieces = b"".join(self._frame(i, self._piece(i, piece, p)) for piece, p in held)
                return self._opening(i) + pieces + self._finish(i, reason)
            frames = self._opening(i)
            for k, call in enumerate(calls):  # each call: its id and name, then its arguments in pieces
                head = {"index": k, "id": call.id, "type": "function",
                        "function": {"name": call.function.name, "arguments": ""}}
                frames += self._frame(i, self._tool_delta(head))
                arguments = call.function.arguments
                for at in range(0, len(arguments), ARGUMENT_PIECE):
                    piece = {"index": k, "function": {"arguments": arguments[at:at + ARGUMENT_PIECE]}}
                    frames += self._frame(i, self._tool_delta(piece))
            return frames + self._finish(i, '"tool_calls"')
        return self._finish(i, reason)

    @staticmethod
    def _tool_delta(call: dict[str, Any]) -> str:
        return f'"delta":{{"tool_calls":[{json.dumps(call, ensure_ascii=False)}]}},"logprobs":null,"finish_reason":null'

    def _finish(self, i: int, reason: str) -> bytes:
        if self._options.kind == "text":
            last = f'"text":"","logprobs":null,"finish_reason":{reason}'
        else:
            last = f'"delta":{{}},"logprobs":null,"finish_reason":{reason}'
        return self._opening(i) + self._frame(i, last)

    def _frame(self, i: int, choice: str) -> bytes:
        return b"data: " + (self._choice[i] + choice + self._tail).encode() + b"\n\n"


Top = list[tuple[str, float]]  # a token event's alternatives: (text, log-probability), most likely first


def chat_top(text: str, value: float, top: Top | None, k: int) -> list[oa.TopLogprob]:
    """A chat token's `top_logprobs`: the worker's alternatives (at most `k`), or with none the chosen
    token alone when any were asked for."""
    found = top[:k] if top else ([(text, value)] if k > 0 else [])
    return [oa.TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in found]


def text_top(text: str, value: float, top: Top | None, k: int) -> list[dict[str, float]]:
    """A completion token's `top_logprobs` entry (one dict of text -> log-probability), or none."""
    if top:
        return [dict(top[:k])]
    return [{text: value}] if k > 0 else []


def prompt_logprobs(scored: Sequence[PromptEvent], k: int, offset: int) -> oa.CompletionLogprobs:
    """Prompt tokens' logprobs (of one `prompt` event, or of all of them) in the legacy shape, their text
    offsets from `offset`: the prompt's first token has null ones (nothing predicts it)."""
    tokens = [t for part in scored for t in part.tokens]
    logprobs = [lp for part in scored for lp in part.logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    tops: list[dict[str, float] | None] = []
    if k > 0:
        tops = [{t: value for t, value in top[:k]} if given is not None else None
                for top, given in zip((t for part in scored for t in part.top), logprobs, strict=True)]
    return oa.CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets)


def choice_endings(done: DoneEvent) -> list[str]:
    """Each choice's finish reason, in index order (a one-choice `done` carries only its own)."""
    return [done.finish_reason] if done.choices is None else [end.finish_reason for end in done.choices]


def assemble(options: Options, events: list[SseEvent], *, request_id: str, created: int, model: str,
             headers: dict[str, str], fingerprint: str = oa.FINGERPRINT_UNKNOWN) -> Response:
    """The whole answer of a non-streaming request from its collected events: one choice per index,
    each with its own text (or tool call) and finish reason; the usage counts them all."""
    pieces: list[list[tuple[str, float, Top | None]]] = [[] for _ in range(options.n)]
    done: DoneEvent | None = None
    prompt: list[PromptEvent] = []
    for event in events:
        if event.event == EVENT_PROMPT:
            prompt.append(PromptEvent.model_validate_json(event.data))
        elif event.event == EVENT_TOKEN:
            data = orjson.loads(event.data)
            pieces[data.get("choice", 0)].append((data["token"], data["probability"], data.get("top")))
        elif event.event == EVENT_DONE:
            done = DoneEvent.model_validate_json(event.data)
        elif event.event == EVENT_ERROR:
            error = ErrorEvent.model_validate_json(event.data)
            return JSONResponse(error_detail(error), status_code=STATUS_BY_REASON.get(error.reason, 500),
                                headers=headers)
    if done is None:  # the relay always ends with done or error; guard rather than assume
        return JSONResponse(oa.error_body("the stream ended without a result", status=502, code="worker_failed"),
                            status_code=502, headers=headers)
    ident, usage = completion_id(options.kind, request_id), usage_of(done)
    endings = choice_endings(done)
    body: oa.ChatCompletion | oa.Completion
    if options.kind == "chat":
        body = oa.ChatCompletion(id=ident, created=created, model=model, usage=usage, system_fingerprint=fingerprint,
                                 choices=[_chat_choice(options, i, pieces[i], endings[i], request_id)
                                          for i in range(len(endings))])
    else:
        echoed = _echoed(options, prompt)
        body = oa.Completion(id=ident, created=created, model=model, usage=usage, system_fingerprint=fingerprint,
                             choices=[oa.CompletionChoice(index=i, text=echoed[0] + "".join(t for t, _, _ in pieces[i]),
                                                          logprobs=_text_logprobs(options, pieces[i], echoed[1]),
                                                          finish_reason=finish_reason(endings[i]))
                                      for i in range(len(endings))])
    return JSONResponse(body.model_dump(mode="json"), headers=headers)


def _chat_choice(options: Options, i: int, pieces: list[tuple[str, float, Top | None]], ending: str,
                 request_id: str) -> oa.ChatChoice:
    """One choice of a chat answer: a tool call when it is one (with tools), else its text."""
    text = "".join(t for t, _, _ in pieces)
    calls = read_calls(text, options.tools, request_id, choice=i) if options.tools and options.tools.calling else None
    if calls is not None:
        return oa.ChatChoice(index=i, message=oa.AssistantMessage(content=None, tool_calls=calls),
                             finish_reason="tool_calls")
    return oa.ChatChoice(index=i, message=oa.AssistantMessage(content=text), finish_reason=finish_reason(ending),
                         logprobs=_chat_logprobs(options, pieces))


def _chat_logprobs(options: Options, pieces: list[tuple[str, float, Top | None]]) -> oa.ChoiceLogprobs | None:
    if not options.logprobs:
        return None
    return oa.ChoiceLogprobs(content=[
        oa.TokenLogprob(token=t, logprob=logprob(p), bytes=list(t.encode()),
                        top_logprobs=chat_top(t, logprob(p), top, options.top_logprobs)) for t, p, top in pieces])


def _echoed(options: Options, prompt: list[PromptEvent]) -> tuple[str, oa.CompletionLogprobs]:
    """What `echo` puts first in each choice: the prompt's text, and its scored tokens' logprobs."""
    if not options.echo:
        return "", oa.CompletionLogprobs()
    text = "".join(t for part in prompt for t in part.tokens) if prompt else options.echo_text or ""
    return text, prompt_logprobs(prompt, options.top_logprobs, 0)


def _text_logprobs(options: Options, pieces: list[tuple[str, float, Top | None]],
                   echoed: oa.CompletionLogprobs) -> oa.CompletionLogprobs | None:
    """A completion choice's logprobs: its echoed prompt's (when any), then its own tokens'."""
    if not options.logprobs:
        return None
    offsets, at = [], sum(len(t) for t in echoed.tokens)
    for t, _, _ in pieces:
        offsets.append(at)
        at += len(t)
    k = options.top_logprobs
    tops: list[dict[str, float] | None] = [e for t, p, top in pieces for e in text_top(t, logprob(p), top, k)]
    return oa.CompletionLogprobs(tokens=echoed.tokens + [t for t, _, _ in pieces],
                                 token_logprobs=echoed.token_logprobs + [logprob(p) for _, p, _ in pieces],
                                 top_logprobs=echoed.top_logprobs + tops, text_offset=echoed.text_offset + offsets)
