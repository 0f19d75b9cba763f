"""bench.load.clients over httpx.MockTransport: ours and OpenAI's stream formats (completions and chat),
every failure kind, request bodies."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from bench.load.clients import (
    InferClient,
    OpenAIChatClient,
    OpenAIClient,
    Sampling,
    StreamClient,
    error_reason,
    make_client,
    post_timed,
)
from bench.load.record import Failure, RequestRecord
from bench.load.workload import WorkItem
from protocol.inference import InferRequest
from protocol.sse import SseEvent, SseParser

ITEM = WorkItem(index=3, prompt="Hello there", seed=42)


def sse(event: str, data: object) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def chunk(data: object) -> bytes:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()


def token(text: str, index: int) -> bytes:
    return sse("token", {"token": text, "index": index, "probability": 0.5, "finished": False})


def done(completion_tokens: int) -> bytes:
    return sse("done", {"finished": True, "finish_reason": "length",
                        "usage": {"prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": completion_tokens,
                                  "total_tokens": 5 + completion_tokens},
                        "timings": {}, "request_id": "r", "worker_id": "w", "model": "m"})


def stream_of(*parts: bytes) -> Callable[[httpx.Request], httpx.Response]:
    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    return lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


def send(client: StreamClient, handler: Callable[[httpx.Request], httpx.Response], item: WorkItem = ITEM
         ) -> RequestRecord:
    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await client.send(http, item)

    return asyncio.run(go())


def ticking() -> Callable[[], float]:
    """A clock that moves one second per reading: event times become event numbers."""
    return itertools.count().__next__  # type: ignore[return-value]


def infer(**kwargs: object) -> InferClient:
    return InferClient("http://127.0.0.1:1", Sampling(max_tokens=4, ignore_eos=True, raw=True),
                       clock=ticking(), **kwargs)  # type: ignore[arg-type]


# -- SSE lines ------------------------------------------------------------------------------------

def test_sse_parses_names_multiline_data_comments_and_an_unterminated_last_event() -> None:
    parser = SseParser()
    lines = [": ping", "event: token", "data: {\"a\":", "data: 1}", "", "data:[DONE]", "", "id: 7", "data: x"]
    events = parser.feed("\n".join(lines).encode())
    assert events == [SseEvent("token", '{"a":\n1}'), SseEvent("message", "[DONE]")]
    assert parser.close() == SseEvent("message", "x")
    assert parser.close() is None


# -- this project's API -----------------------------------------------------------------------------

def test_infer_counts_tokens_by_usage_and_itl_by_events() -> None:
    # three events, four tokens: the last event joins two tokens (a UTF-8 character split in two)
    record = send(infer(), stream_of(b": ping\n\n", token("Hi", 0), token(" th", 1), token("ere\xe2\x9c\x93", 3),
                                     done(4)))
    assert record.ok
    assert record.tokens == 4 and not record.token_mismatch
    assert record.event_times == [1, 2, 3] and record.e2e == 4
    assert record.ttft == 1 and record.itl == [1, 1] and record.tpot == pytest.approx(1.0)


def test_infer_survives_reads_split_anywhere_and_crlf() -> None:
    whole = (token("é", 0) + token("b", 1) + done(2)).replace(b"\n", b"\r\n")
    pieces = [whole[i:i + 7] for i in range(0, len(whole), 7)]  # splits lines, CRLF pairs and "é"
    record = send(infer(), stream_of(*pieces))
    assert record.ok and record.tokens == 2 and len(record.event_times) == 2


def test_infer_flags_a_done_usage_that_disagrees_with_the_token_indices() -> None:
    record = send(infer(), stream_of(token("a", 0), token("b", 1), done(5)))
    assert record.ok and record.tokens == 5 and record.token_mismatch


def test_infer_error_event_is_a_stream_failure_with_its_reason() -> None:
    record = send(infer(), stream_of(token("a", 0), token("b", 1),
                                     sse("error", {"error": "too slow", "reason": "deadline_exceeded",
                                                   "request_id": "r", "finished": True})))
    assert not record.ok
    assert (record.failure, record.reason, record.tokens) == (Failure.STREAM, "deadline_exceeded", 2)
    assert record.error_key == "stream deadline_exceeded"


def test_infer_non_200_is_counted_by_status_and_reason() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": "full", "reason": "kv_full", "request_id": "r"},
                              headers={"Retry-After": "1"})

    record = send(infer(), handler)
    assert (record.failure, record.status, record.reason) == (Failure.HTTP, 503, "kv_full")
    assert record.error_key == "http 503 kv_full"


def test_infer_stream_without_done_is_a_protocol_failure() -> None:
    record = send(infer(), stream_of(token("a", 0)))
    assert (record.failure, record.reason, record.ok) == (Failure.PROTOCOL, "no_done_event", False)


def test_infer_bad_event_json_is_a_protocol_failure() -> None:
    record = send(infer(), stream_of(b"event: token\ndata: {not json\n\n"))
    assert record.failure is Failure.PROTOCOL


@pytest.mark.parametrize("exc,failure,reason", [
    (httpx.ConnectError("refused"), Failure.TRANSPORT, "ConnectError before_response"),
    (httpx.ReadTimeout("slow"), Failure.TIMEOUT, "ReadTimeout"),
    (httpx.RemoteProtocolError("cut"), Failure.TRANSPORT, "RemoteProtocolError before_response"),
])
def test_transport_failures(exc: Exception, failure: Failure, reason: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    record = send(infer(), handler)
    assert (record.failure, record.reason) == (failure, reason)


def test_a_connection_cut_mid_stream_is_told_from_one_that_never_answered() -> None:
    async def cut() -> AsyncIterator[bytes]:
        yield token("a", 0)
        raise httpx.ReadError("reset")

    record = send(infer(), lambda request: httpx.Response(200, content=cut()))
    assert (record.failure, record.reason) == (Failure.TRANSPORT, "ReadError mid_stream")
    assert record.error_key == "transport ReadError mid_stream"


def test_the_per_request_deadline_covers_the_whole_stream() -> None:
    async def hang() -> AsyncIterator[bytes]:
        yield token("a", 0)
        await asyncio.sleep(30)
        yield done(1)

    client = InferClient("http://127.0.0.1:1", Sampling(), timeout=0.05)
    record = send(client, lambda request: httpx.Response(200, content=hang()))
    assert record.failure is Failure.TIMEOUT and not record.ok


@pytest.mark.parametrize("worker,path", [(False, "/coordinator/infer"), (True, "/worker/generate")])
def test_infer_request_is_a_valid_infer_request(worker: bool, path: str) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return stream_of(token("a", 0), done(1))(request)

    send(infer(worker=worker), handler)
    assert seen[0].url.path == path
    body = InferRequest.model_validate_json(seen[0].content)
    assert (body.prompt, body.seed, body.max_tokens, body.ignore_eos, body.raw) == ("Hello there", 42, 4, True, True)


# -- OpenAI-compatible /v1/completions -----------------------------------------------------------------

def openai(**sampling: object) -> OpenAIClient:
    return OpenAIClient("http://localhost:1/", Sampling(max_tokens=8, **sampling), clock=ticking())  # type: ignore[arg-type]


def text(t: str, finish: str | None = None) -> bytes:
    return chunk({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": t,
                                                                      "finish_reason": finish}]})


def test_openai_uses_usage_when_sent() -> None:
    record = send(openai(), stream_of(text("Hel"), text(""), text("lo"), text("", "length"),
                                      chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3,
                                                                      "total_tokens": 6}}),
                                      chunk("[DONE]")))
    assert record.ok
    assert record.tokens == 3
    assert record.event_times == [1, 3]  # chunks with text only
    assert record.e2e == 6


def test_openai_counts_content_chunks_without_usage() -> None:
    record = send(openai(), stream_of(text("a"), text("b"), text("c", "stop"), chunk("[DONE]")))
    assert record.ok and record.tokens == 3 and record.e2e == 4


def test_openai_finish_without_done_still_ends_and_no_finish_is_a_failure() -> None:
    ended = send(openai(), stream_of(text("a"), text("b", "length")))
    assert ended.ok and ended.e2e == 2
    cut = send(openai(), stream_of(text("a")))
    assert (cut.failure, cut.reason) == (Failure.PROTOCOL, "no_finish")


def test_openai_error_body_and_error_chunk() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "bad", "type": "invalid_request_error"}})

    record = send(openai(), refuse)
    assert record.error_key == "http 400 invalid_request_error"
    record = send(openai(), stream_of(text("a"), chunk({"error": {"message": "boom", "code": "server_error"}})))
    assert (record.failure, record.reason, record.tokens) == (Failure.STREAM, "server_error", 1)


def test_openai_request_body_streams_and_bans_tokens() -> None:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        assert request.url.path == "/v1/completions"
        return stream_of(text("a", "stop"), chunk("[DONE]"))(request)

    send(openai(banned_tokens=(0, 2), model="smol", temperature=0.0), handler)
    body = seen[0]
    assert body["stream"] is True and body["prompt"] == "Hello there" and body["seed"] == 42
    assert body["max_tokens"] == 8 and body["temperature"] == 0.0 and body["model"] == "smol"
    assert body["logit_bias"] == {"0": -100.0, "2": -100.0}


# -- OpenAI-compatible /v1/chat/completions ------------------------------------------------------------

def chat(**sampling: object) -> OpenAIChatClient:
    return OpenAIChatClient("http://127.0.0.1:1", Sampling(max_tokens=8, **sampling),  # type: ignore[arg-type]
                            clock=ticking())


def delta(content: str | None = None, *, role: str | None = None, finish: str | None = None) -> bytes:
    d = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return chunk({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                  "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]})


def usage(completion_tokens: int) -> bytes:
    return chunk({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                  "usage": {"prompt_tokens": 9, "completion_tokens": completion_tokens,
                            "total_tokens": 9 + completion_tokens}})


def oai_error(code: str | None, type_: str = "server_error") -> dict[str, object]:
    return {"error": {"message": "it broke", "type": type_, "param": None, "code": code}}


ROLE = delta("", role="assistant")  # the first chunk: a role, empty content, not a token
DONE = chunk("[DONE]")
PING = b": ping\n\n"
NORMAL = (ROLE, delta("Hel"), delta("lo"), delta("!", finish="stop"), DONE)


def split_crlf(*parts: bytes, size: int = 5) -> tuple[bytes, ...]:
    whole = b"".join(parts).replace(b"\n", b"\r\n")
    return tuple(whole[i:i + size] for i in range(0, len(whole), size))


# Event times are event numbers (the ticking clock); pings are SSE comments, so they take no tick.
# columns: parts, ok, tokens, event_times (TTFT is the first), e2e, error_key
@pytest.mark.parametrize("parts,ok,tokens,times,e2e,error_key", [
    pytest.param(NORMAL, True, 3, [2, 3, 4], 5, "", id="normal-no-usage-counts-content-chunks"),
    pytest.param(split_crlf(*NORMAL), True, 3, [2, 3, 4], 5, "", id="reads-split-anywhere-crlf"),
    pytest.param((ROLE, delta("Hé"), delta("llo"), delta(finish="length"), usage(4), DONE),
                 True, 4, [2, 3], 6, "", id="include-usage-final-chunk-wins"),
    pytest.param((PING, ROLE, PING, delta("a"), PING, delta("b", finish="stop"), usage(2), PING, DONE, PING),
                 True, 2, [2, 3], 5, "", id="pings-ignored"),
    pytest.param((ROLE, delta("a"), delta("b"), chunk(oai_error("worker_failed")), DONE),
                 False, 2, [2, 3], None, "stream worker_failed", id="error-chunk-mid-stream"),
    pytest.param((ROLE, delta("a"), chunk(oai_error(None)), DONE),
                 False, 1, [2], None, "stream server_error", id="error-chunk-without-code-uses-type"),
    pytest.param((ROLE, delta("a"), delta("b")), False, 2, [2, 3], None, "protocol no_finish",
                 id="cut-before-finish"),
    pytest.param((ROLE, delta("a"), b"data: {not json\n\n"), False, 0, [2], None, "protocol bad_event:JSONDecodeError",
                 id="bad-json"),
])
def test_chat_stream(parts: tuple[bytes, ...], ok: bool, tokens: int, times: list[int], e2e: int | None,
                     error_key: str) -> None:
    record = send(chat(), stream_of(*parts))
    assert (record.ok, record.tokens, record.event_times, record.e2e, record.error_key) == (
        ok, tokens, times, e2e, error_key)
    assert record.ttft == (times[0] if times else None)
    assert not record.token_mismatch  # chunks are not tokens: nothing to cross-check usage against


@pytest.mark.parametrize("status,body,headers,error_key", [
    pytest.param(503, oai_error("kv_full"), {"Retry-After": "1"}, "http 503 kv_full", id="503-before-stream"),
    pytest.param(400, oai_error(None, "invalid_request_error"), {}, "http 400 invalid_request_error",
                 id="400-code-null"),
    pytest.param(404, {"detail": "Not Found"}, {}, "http 404 invalid_request", id="no-such-route"),
])
def test_chat_http_error_before_the_stream(status: int, body: dict[str, object], headers: dict[str, str],
                                           error_key: str) -> None:
    record = send(chat(), lambda request: httpx.Response(status, json=body, headers=headers))
    assert (record.failure, record.status, record.error_key, record.event_times) == (
        Failure.HTTP, status, error_key, [])


BASE_CHAT_BODY = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8, "temperature": 0.8,
                  "top_p": 0.95, "top_k": 40, "seed": 42, "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("sampling,extra", [
    pytest.param({}, {}, id="defaults-no-model-no-extensions"),
    pytest.param({"model": "smol", "temperature": 0.0, "top_k": 0}, {"model": "smol", "temperature": 0.0, "top_k": 0},
                 id="model-only-when-given"),
    pytest.param({"ignore_eos": True}, {"ignore_eos": True}, id="ignore-eos-extension"),
    pytest.param({"banned_tokens": (0, 2)}, {"logit_bias": {"0": -100.0, "2": -100.0}}, id="logit-bias"),
    pytest.param({"raw": True}, {}, id="raw-is-not-sent"),
])
def test_chat_request_body(sampling: dict[str, object], extra: dict[str, object]) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return stream_of(*NORMAL)(request)

    assert send(chat(**sampling), handler).ok
    assert (seen[0].method, seen[0].url.path) == ("POST", "/v1/chat/completions")
    assert seen[0].headers["content-type"] == "application/json"
    assert json.loads(seen[0].content) == {**BASE_CHAT_BODY, **extra}


def test_a_chat_items_system_message_goes_first() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return stream_of(*NORMAL)(request)

    assert send(chat(), handler, item=WorkItem(index=1, prompt="Hi", seed=1, system="Be brief.")).ok
    assert json.loads(seen[0].content)["messages"] == [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("answer,ok,failure,reason", [
    (httpx.Response(200, json={"choices": []}), True, None, ""),
    (httpx.Response(400, json={"error": {"code": "context_length_exceeded"}}), False, Failure.HTTP,
     "context_length_exceeded"),
])
def test_a_whole_request_is_timed_to_its_end_and_a_refusal_keeps_its_reason(
        answer: httpx.Response, ok: bool, failure: Failure | None, reason: str) -> None:
    ticks = itertools.count(10.0, 0.25)

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda request: answer)) as http:
            return await post_timed(http, "http://pool/v1/embeddings", {"input": "x"}, clock=lambda: next(ticks))

    record = asyncio.run(go())
    assert (record.ok, record.failure, record.reason) == (ok, failure, reason)
    assert record.e2e == (0.25 if ok else None) and record.status == answer.status_code


@pytest.mark.parametrize("api,cls,path", [
    ("infer", InferClient, "/coordinator/infer"),
    ("worker", InferClient, "/worker/generate"),
    ("openai", OpenAIClient, "/v1/completions"),
    ("openai-chat", OpenAIChatClient, "/v1/chat/completions"),
])
def test_make_client(api: str, cls: type[StreamClient], path: str) -> None:
    client = make_client(api, "http://127.0.0.1:1337/", Sampling())
    assert type(client) is cls and client.url == "http://127.0.0.1:1337" + path


@pytest.mark.parametrize("body,reason", [
    (b'{"error": "x", "reason": "sessions_full", "request_id": "r"}', "sessions_full"),
    (b'{"error": {"type": "server_error"}}', "server_error"),
    (b'{"detail": [{"loc": ["body"]}]}', "invalid_request"),
    (b"Internal Server Error", ""),
    (b"[]", ""),
])
def test_error_reason(body: bytes, reason: str) -> None:
    assert error_reason(body) == reason
