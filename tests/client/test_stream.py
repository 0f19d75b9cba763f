"""One job against a faked upstream (httpx's MockTransport): streams read, refusals retried, the rest not."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from client.jobs import Job, parse_jobs
from client.results import Result
from client.retry import RetryPolicy
from client.stream import BAD_STREAM, STREAM_BROKEN, STREAM_INCOMPLETE, UNREACHABLE, run_job
from protocol.inference import DoneEvent, ErrorEvent, Timings, TokenEvent, Usage
from protocol.sse import encode

PROMPT_JOB = parse_jobs('{"prompt": "Hi", "max_tokens": 3}')[0]
CHAT_JOB = parse_jobs('{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}')[0]
POLICY = RetryPolicy(attempts=4, max_wait=30)
SSE = {"content-type": "text/event-stream", "x-worker-id": "w7", "x-request-id": "r1"}


def infer_stream(tokens: list[str], end: str = "done") -> bytes:
    out = b"".join(encode("token", TokenEvent(token=t, index=i, probability=0.5).model_dump_json())
                   for i, t in enumerate(tokens))
    out += b": ping\r\n\r\n"
    if end == "done":
        done = DoneEvent(finish_reason="length", request_id="r1", worker_id="w7", model="m",
                         usage=Usage(prompt_tokens=9, cached_tokens=2, completion_tokens=len(tokens),
                                     total_tokens=9 + len(tokens)),
                         timings=Timings(queue_ms=1, prefill_ms=2, ttft_ms=3, total_ms=40, tokens_per_second=50))
        out += encode("done", done.model_dump_json())
    elif end == "error":
        out += encode("error", ErrorEvent(error="the worker died", reason="worker_failed",
                                          request_id="r1").model_dump_json())
    return out


def refusal(status: int = 503, retry_after: str | None = "2", reason: str = "queue_full") -> httpx.Response:
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    return httpx.Response(status, headers=headers, json={"error": "busy", "reason": reason, "request_id": "r0"})


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def started(self, job: Job, worker: str | None) -> None:
        self.calls.append(("started", worker))

    def token(self, job: Job, worker: str | None) -> None:
        self.calls.append(("token", worker))

    def retrying(self, job: Job, delay: float, reason: str) -> None:
        self.calls.append(("retrying", reason))


def run(job: Job, answers: list[httpx.Response] | Callable[[httpx.Request], httpx.Response],
        policy: RetryPolicy = POLICY) -> tuple[Result, list[httpx.Request], list[float], Recorder]:
    requests: list[httpx.Request] = []
    sleeps: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        if callable(answers):
            return answers(request)
        return answers[min(len(requests), len(answers)) - 1]

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def go() -> Result:
        async with httpx.AsyncClient(base_url="http://pool", transport=httpx.MockTransport(handler)) as client:
            return await run_job(client, job, policy, recorder, attempt_timeout=5, sleep=sleep, rand=lambda: 0.0)

    recorder = Recorder()
    return asyncio.run(go()), requests, sleeps, recorder


def test_a_streamed_answer_becomes_a_result() -> None:
    result, requests, sleeps, recorder = run(PROMPT_JOB, [httpx.Response(200, headers=SSE,
                                                                         content=infer_stream(["Hel", "lo", "!"]))])
    assert result.ok and result.text == "Hello!" and result.finish_reason == "length"
    assert (result.worker, result.model, result.request_id) == ("w7", "m", "r1")
    assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (9, 2, 3)
    assert (result.server_ttft_ms, result.server_total_ms) == (3, 40)
    assert result.ttft_ms is not None and result.total_ms is not None and result.ttft_ms <= result.total_ms
    assert result.attempts == 1 and sleeps == []
    assert requests[0].url.path == "/coordinator/infer"
    assert json.loads(requests[0].content) == {"prompt": "Hi", "max_tokens": 3}
    assert recorder.calls == [("started", "w7")] + [("token", "w7")] * 3


def test_a_503_is_retried_after_its_retry_after() -> None:
    ok = httpx.Response(200, headers=SSE, content=infer_stream(["a"]))
    result, requests, sleeps, recorder = run(PROMPT_JOB, [refusal(retry_after="2"), refusal(retry_after="3"), ok])
    assert result.ok and result.attempts == 3 and len(requests) == 3
    assert sleeps == [2.0, 3.0]
    assert result.retry_wait_ms == 5000.0
    assert [c for c in recorder.calls if c[0] == "retrying"] == [("retrying", "queue_full")] * 2


def test_a_pool_that_always_refuses_fails_the_job_after_the_bounded_attempts() -> None:
    result, requests, sleeps, _ = run(PROMPT_JOB, [refusal(retry_after="1")], RetryPolicy(attempts=4, max_wait=30))
    assert not result.ok and len(requests) == 4 and result.attempts == 4 and sleeps == [1.0] * 3
    assert result.error is not None and (result.error.status, result.error.reason) == (503, "queue_full")
    assert "gave up after 4 attempts" in result.error.message


def test_a_retry_after_past_the_budget_ends_the_job_without_waiting() -> None:
    result, requests, sleeps, _ = run(PROMPT_JOB, [refusal(retry_after="300")], RetryPolicy(attempts=10, max_wait=60))
    assert not result.ok and len(requests) == 1 and sleeps == []


def test_without_retry_after_it_backs_off_exponentially() -> None:
    calls = iter([refusal(502, None, "worker_unavailable"), refusal(502, None, "worker_unavailable"),
                  httpx.Response(200, headers=SSE, content=infer_stream(["a"]))])
    policy = RetryPolicy(attempts=4, max_wait=30, base=0.5)
    requests: list[httpx.Request] = []
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return next(calls)

    async def go() -> Result:
        async with httpx.AsyncClient(base_url="http://pool", transport=httpx.MockTransport(handler)) as client:
            return await run_job(client, PROMPT_JOB, policy, Recorder(), attempt_timeout=5, sleep=sleep,
                                 rand=lambda: 0.999)

    assert asyncio.run(go()).ok
    assert sleeps == pytest.approx([0.4995, 0.999])


@pytest.mark.parametrize(("status", "reason"), [(400, "invalid_request"), (404, "unknown_model"),
                                                (413, "prompt_too_long"), (401, "unauthorized")])
def test_other_refusals_are_final(status: int, reason: str) -> None:
    result, requests, sleeps, _ = run(PROMPT_JOB, [refusal(status, None, reason)])
    assert len(requests) == 1 and sleeps == []
    assert result.error is not None and (result.error.status, result.error.reason) == (status, reason)
    assert result.error.message == f"HTTP {status}: busy"


def test_an_error_event_fails_the_job_and_keeps_the_text_so_far() -> None:
    result, requests, _, _ = run(PROMPT_JOB, [httpx.Response(200, headers=SSE, content=infer_stream(["x", "y"], "error"))])
    assert len(requests) == 1 and result.text == "xy"
    assert result.error is not None and (result.error.reason, result.error.status) == ("worker_failed", 200)


def test_a_stream_without_its_final_event_fails_the_job() -> None:
    result, requests, _, _ = run(PROMPT_JOB, [httpx.Response(200, headers=SSE, content=infer_stream(["x"], "none"))])
    assert len(requests) == 1 and result.error is not None and result.error.reason == STREAM_INCOMPLETE


class _Breaks(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield infer_stream(["x"], "none")
        raise httpx.ReadError("connection reset")


def test_a_stream_that_breaks_after_its_start_is_not_retried() -> None:
    result, requests, _, _ = run(PROMPT_JOB, [httpx.Response(200, headers=SSE, stream=_Breaks())])
    assert len(requests) == 1 and result.text == "x"
    assert result.error is not None and result.error.reason == STREAM_BROKEN


def test_a_pool_that_cannot_be_reached_is_retried_then_fails() -> None:
    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    result, requests, sleeps, _ = run(PROMPT_JOB, unreachable, RetryPolicy(attempts=3, max_wait=30))
    assert len(requests) == 3 and len(sleeps) == 2
    assert result.error is not None and (result.error.reason, result.error.status) == (UNREACHABLE, None)


def chat_stream(pieces: list[str]) -> bytes:
    def chunk(**extra: Any) -> bytes:
        body = {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 1, "model": "m", **extra}
        return f"data: {json.dumps(body)}\n\n".encode()

    out = chunk(choices=[{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}], usage=None)
    for piece in pieces:
        out += chunk(choices=[{"index": 0, "delta": {"content": piece}, "finish_reason": None}], usage=None)
    out += chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}], usage=None)
    out += chunk(choices=[], usage={"prompt_tokens": 5, "completion_tokens": len(pieces), "total_tokens": 7,
                                    "prompt_tokens_details": {"cached_tokens": 1}})
    return out + b"data: [DONE]\n\n"


def test_a_chat_job_streams_from_the_chat_surface_with_usage() -> None:
    result, requests, _, recorder = run(CHAT_JOB, [httpx.Response(200, headers=SSE, content=chat_stream(["Hi", " there"]))])
    assert result.ok and result.text == "Hi there" and result.finish_reason == "stop"
    assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (5, 1, 2)
    assert result.worker == "w7" and result.model == "m"
    assert requests[0].url.path == "/v1/chat/completions"
    assert json.loads(requests[0].content) == {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                               "stream": True, "stream_options": {"include_usage": True}}
    assert recorder.calls.count(("token", "w7")) == 2


def test_a_chat_error_chunk_fails_the_job() -> None:
    body = b'data: {"error": {"message": "worker died", "type": "server_error", "code": "worker_failed"}}\n\n' \
           b"data: [DONE]\n\n"
    result, _, _, _ = run(CHAT_JOB, [httpx.Response(200, headers=SSE, content=body)])
    assert result.error is not None and (result.error.reason, result.error.message) == ("worker_failed", "worker died")


def test_a_chat_refusal_in_openai_shape_keeps_its_code() -> None:
    answer = httpx.Response(503, headers={"retry-after": "1"},
                            json={"error": {"message": "full", "type": "server_error", "param": None,
                                            "code": "kv_full"}})
    result, requests, sleeps, _ = run(CHAT_JOB, [answer], RetryPolicy(attempts=2, max_wait=30))
    assert len(requests) == 2 and sleeps == [1.0]
    assert result.error is not None and result.error.reason == "kv_full"


def test_a_stream_without_a_worker_header_that_breaks_is_still_not_retried() -> None:
    result, requests, _, _ = run(PROMPT_JOB, [httpx.Response(200, headers={"content-type": "text/event-stream"},
                                                             stream=_Breaks())])
    assert len(requests) == 1 and result.error is not None and result.error.reason == STREAM_BROKEN


def test_an_event_past_the_parser_bound_fails_the_job() -> None:
    huge = b"event: token\r\ndata: " + b"x" * (2 << 20)
    result, _, _, _ = run(PROMPT_JOB, [httpx.Response(200, headers=SSE, content=huge)])
    assert result.error is not None and result.error.reason == BAD_STREAM
