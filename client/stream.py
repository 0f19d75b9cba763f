"""One job over HTTP: send it, read its Server-Sent Events into a `Result`, retry it when refused.

Owns: the request for each surface, reading each surface's stream (`/coordinator/infer`: `token`,
`done`, `error` events, protocol/inference.http.md; `/v1/chat/completions`: OpenAI chunks ending in
`data: [DONE]`), the client-side timings, and the retry loop around them.
Must not: write files or draw; it reports to a `JobObserver` and returns the `Result`.

What is retried: an answer with a status in `retry.RETRY_STATUSES` (the coordinator's 503s first) and a
connection that fails before any status line, within the `RetryPolicy`. What is not: any other
status (a 400 stays a 400), and a stream that started and then broke or ended with an `error` event,
since tokens were already produced; such a job is failed here and runs again on the next run.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from pydantic import ValidationError

from client.jobs import Job, Surface
from client.results import JobError, Result
from client.retry import RETRY_STATUSES, RetryPolicy, parse_retry_after
from protocol.inference import EVENT_DONE, EVENT_ERROR, EVENT_TOKEN, DoneEvent, ErrorEvent, TokenEvent
from protocol.sse import SseEvent, SseParser, SseTooLarge
from protocol.worker import REQUEST_ID_HEADER, WORKER_ID_HEADER

MAX_ERROR_BODY = 64 * 1024  # bytes of a refusal's body worth reading
CHAT_DONE = "[DONE]"

# Reasons the client gives to failures it detects itself (the pool's own reasons pass through).
UNREACHABLE = "unreachable"
STREAM_BROKEN = "stream_broken"
STREAM_INCOMPLETE = "stream_incomplete"
BAD_STREAM = "bad_stream"
TIMEOUT = "timeout"


class JobObserver(Protocol):
    def started(self, job: Job, worker: str | None) -> None: ...
    def token(self, job: Job, worker: str | None) -> None: ...
    def retrying(self, job: Job, delay: float, reason: str) -> None: ...


@dataclass(frozen=True)
class _Refusal:
    """An attempt that may be tried again."""

    status: int | None
    reason: str
    message: str
    retry_after: float | None


class _Cut(Exception):
    """The stream failed after its status line: final for this run."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.error = JobError(reason, message, 200)


async def run_job(client: httpx.AsyncClient, job: Job, policy: RetryPolicy, observer: JobObserver, *,
                  attempt_timeout: float, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                  rand: Callable[[], float] = random.random,
                  clock: Callable[[], float] = time.perf_counter) -> Result:
    """Runs `job` to a result, success or failure; it never raises for the job's own failures.

    `client` carries the base URL and the credentials; `attempt_timeout` bounds one attempt from
    sending to the end of its stream.
    """
    result = Result(job)
    waited = 0.0
    while True:
        result.attempts += 1
        try:
            async with asyncio.timeout(attempt_timeout):
                refusal = await _attempt(client, job, result, observer, clock)
        except _Cut as cut:
            result.error = cut.error
            return result
        except TimeoutError:
            started = result.status == 200
            result.error = JobError(TIMEOUT, f"no end of stream within {attempt_timeout:g} s",
                                    200 if started else None)
            if started:
                return result
            refusal = _Refusal(None, TIMEOUT, result.error.message, None)
        if refusal is None:
            result.retry_wait_ms = waited * 1000
            return result
        delay = policy.delay(result.attempts, waited, refusal.retry_after, rand)
        if delay is None:
            result.error = JobError(refusal.reason, _gave_up(refusal, result.attempts, waited), refusal.status)
            result.retry_wait_ms = waited * 1000
            return result
        observer.retrying(job, delay, refusal.reason)
        await sleep(delay)
        waited += delay


def _gave_up(refusal: _Refusal, attempts: int, waited: float) -> str:
    return f"{refusal.message} (gave up after {attempts} attempts and {waited:.1f} s of waiting)"


async def _attempt(client: httpx.AsyncClient, job: Job, result: Result, observer: JobObserver,
                   clock: Callable[[], float]) -> _Refusal | None:
    """One try. Returns a refusal worth retrying, or None once `result` holds the outcome."""
    result.worker = result.request_id = result.error = result.status = None
    started = clock()
    body = job.body if job.surface is Surface.INFER else {
        **job.body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", job.surface.value, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                return await _refused(response, result)
            result.worker = response.headers.get(WORKER_ID_HEADER)
            result.request_id = response.headers.get(REQUEST_ID_HEADER)
            observer.started(job, result.worker)
            reader = _InferReader(result) if job.surface is Surface.INFER else _ChatReader(result)
            try:
                await _read(response, reader, observer, job, started, clock)
            finally:
                result.text = "".join(reader.pieces)  # what arrived, also when the stream failed
            return None
    except httpx.TransportError as exc:
        if result.status == 200:
            raise _Cut(STREAM_BROKEN, f"the stream broke: {exc!r}") from None
        return _Refusal(None, UNREACHABLE, f"cannot reach {client.base_url}: {exc!r}", None)


async def _read(response: httpx.Response, reader: _InferReader | _ChatReader, observer: JobObserver, job: Job,
                started: float, clock: Callable[[], float]) -> None:
    """Feeds the stream to `reader` until its final event; raises `_Cut` when the stream fails."""
    parser = SseParser()
    try:
        async for chunk in response.aiter_bytes():
            for event in parser.feed(chunk):
                if reader.feed(event, observer, job, clock() - started):
                    return
    except httpx.TransportError as exc:
        raise _Cut(STREAM_BROKEN, f"the stream broke: {exc!r}") from None
    except SseTooLarge as exc:
        raise _Cut(BAD_STREAM, str(exc)) from None
    tail = parser.close()
    if tail is not None and reader.feed(tail, observer, job, clock() - started):
        return
    raise _Cut(STREAM_INCOMPLETE, "the stream ended without a final event")


async def _refused(response: httpx.Response, result: Result) -> _Refusal | None:
    raw = bytearray()
    async for chunk in response.aiter_bytes():
        raw += chunk
        if len(raw) >= MAX_ERROR_BODY:
            break
    reason, message = _error_of(bytes(raw[:MAX_ERROR_BODY]), response.status_code)
    result.request_id = response.headers.get(REQUEST_ID_HEADER)
    if response.status_code in RETRY_STATUSES:
        return _Refusal(response.status_code, reason, message,
                        parse_retry_after(response.headers.get("retry-after")))
    result.error = JobError(reason, message, response.status_code)
    return None


def _error_of(raw: bytes, status: int) -> tuple[str, str]:
    """(reason, message) from either error shape: the pool's `{"error", "reason"}` or OpenAI's
    `{"error": {"message", "code"}}`; the raw text when it is neither."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return str(error.get("code") or f"http_{status}"), f"HTTP {status}: {error.get('message', '')}"
        if isinstance(error, str):
            return str(body.get("reason") or f"http_{status}"), f"HTTP {status}: {error}"
    text = raw.decode("utf-8", "replace").strip()[:500]
    return f"http_{status}", f"HTTP {status}: {text or '(no body)'}"


class _InferReader:
    """`/coordinator/infer`'s events into the result."""

    def __init__(self, result: Result) -> None:
        self.result = result
        self.pieces: list[str] = []

    def feed(self, event: SseEvent, observer: JobObserver, job: Job, elapsed: float) -> bool:
        result = self.result
        try:
            if event.event == EVENT_TOKEN:
                token = TokenEvent.model_validate_json(event.data)
                if result.ttft_ms is None:
                    result.ttft_ms = elapsed * 1000
                self.pieces.append(token.token)
                observer.token(job, result.worker)
                return False
            if event.event == EVENT_DONE:
                done = DoneEvent.model_validate_json(event.data)
                result.total_ms = elapsed * 1000
                result.finish_reason = done.finish_reason
                result.model, result.worker = done.model, done.worker_id
                result.request_id = done.request_id
                result.prompt_tokens = done.usage.prompt_tokens
                result.cached_tokens = done.usage.cached_tokens
                result.completion_tokens = done.usage.completion_tokens
                result.server_ttft_ms = done.timings.ttft_ms
                result.server_total_ms = done.timings.total_ms
                return True
            if event.event == EVENT_ERROR:
                error = ErrorEvent.model_validate_json(event.data)
                raise _Cut(error.reason, error.error)
        except ValidationError as exc:
            raise _Cut(BAD_STREAM, f"unreadable {event.event} event: {exc.errors()[0]['msg']}") from None
        return False  # an event this client does not know: ignored, as SSE readers do


class _ChatReader:
    """`/v1/chat/completions` chunks into the result (OpenAI's streaming shape, with usage)."""

    def __init__(self, result: Result) -> None:
        self.result = result
        self.pieces: list[str] = []

    def feed(self, event: SseEvent, observer: JobObserver, job: Job, elapsed: float) -> bool:
        result = self.result
        if event.data.strip() == CHAT_DONE:
            if result.finish_reason is None:
                raise _Cut(STREAM_INCOMPLETE, "the stream ended without a finish_reason")
            return True
        try:
            chunk: dict[str, Any] = json.loads(event.data)
        except json.JSONDecodeError:
            raise _Cut(BAD_STREAM, f"unreadable chunk: {event.data[:200]!r}") from None
        error = chunk.get("error")
        if isinstance(error, dict):
            raise _Cut(str(error.get("code") or "error"), str(error.get("message", "")))
        result.model = chunk.get("model", result.model)
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                if result.ttft_ms is None:
                    result.ttft_ms = elapsed * 1000
                self.pieces.append(content)
                observer.token(job, result.worker)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
                result.total_ms = elapsed * 1000
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            result.prompt_tokens = usage.get("prompt_tokens")
            result.completion_tokens = usage.get("completion_tokens")
            result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return False
