"""One timed streaming request against each API the tool speaks.

Owns: request bodies, reading the two stream formats, and turning what happens into a `RequestRecord`
(token event times, token count, failure kind and reason).
Must not: decide when requests are sent (workload.py) or aggregate results (stats.py).

- `InferClient`: this project's `POST /coordinator/infer` and the worker's `POST /worker/generate`
  (same request type, same SSE events: `token`*, then `done` or `error`). One token event may carry
  several tokens (a UTF-8 character split across tokens), so the count comes from `done.usage`, and
  ITL from event gaps.
- `OpenAIClient`: any OpenAI-compatible `POST /v1/completions` with `stream: true` (`data:` chunks,
  then `data: [DONE]`). Tokens come from `usage` when the server sends it, else from content chunks.
- `OpenAIChatClient`: the same stream read the same way, from `POST /v1/chat/completions` (the prompt
  is one user message, after the item's system message when it has one; content is in
  `delta.content`); only the request body differs.
- `post_timed`: one whole (not streamed) request of any JSON body, timed from send to its last byte,
  for benchmarks whose requests are of many kinds (bench.hostile_mix).

Both OpenAI modes ask for `stream_options.include_usage`, so, like `InferClient` (`done.usage`), a
finished request's token count is the server's `usage.completion_tokens`; TTFT is the first chunk
with non-empty text or content (a role-only first chunk is not a token).
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from bench.load.record import Failure, RequestRecord
from bench.load.workload import WorkItem
from protocol.inference import EVENT_DONE, EVENT_ERROR, EVENT_TOKEN, InferRequest
from protocol.sse import SseEvent, SseParser

PATHS = {"infer": "/coordinator/infer", "worker": "/worker/generate", "openai": "/v1/completions",
         "openai-chat": "/v1/chat/completions"}
BAN_BIAS = -100.0  # OpenAI's "ban" value; llama_cpp.server adds it to the logit


@dataclass(frozen=True)
class Sampling:
    """What every request of a run asks for, besides its prompt and seed."""

    max_tokens: int = 64
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    ignore_eos: bool = False
    raw: bool = False  # ours: complete the prompt as is, no chat template
    banned_tokens: tuple[int, ...] = ()  # OpenAI: token ids given a -100 logit bias (its "ignore_eos")
    model: str | None = None


class StreamClient(ABC):
    def __init__(self, base_url: str, sampling: Sampling, *, timeout: float = 120.0,
                 headers: Mapping[str, str] | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.url = base_url.rstrip("/") + self.path
        self.sampling = sampling
        self.timeout = timeout  # the whole request, send to final event
        self.headers = dict(headers or {})  # sent with every request (a worker's token)
        self._clock = clock

    path: str

    @abstractmethod
    def body(self, item: WorkItem) -> dict[str, Any]: ...

    @abstractmethod
    async def _consume(self, events: AsyncIterator[tuple[SseEvent, float]], record: RequestRecord) -> None:
        """Reads the stream's events (each with its arrival time since send) into `record`."""

    async def send(self, http: httpx.AsyncClient, item: WorkItem) -> RequestRecord:
        """Sends one request and reads its stream to the end; never raises for a failed request."""
        record = RequestRecord(item.index)
        start = record.sent_at = self._clock()
        answered = False  # a 200 head arrived: a failure from here on cut a started stream
        try:
            async with asyncio.timeout(self.timeout):
                async with http.stream("POST", self.url, json=self.body(item), headers=self.headers) as response:
                    if response.status_code != 200:
                        reason = error_reason(await response.aread())
                        return record.fail(Failure.HTTP, reason, status=response.status_code)
                    answered = True
                    await self._consume(self._events(response, start), record)
        except TimeoutError:
            record.fail(Failure.TIMEOUT)
        except httpx.TimeoutException as exc:
            record.fail(Failure.TIMEOUT, type(exc).__name__)
        except httpx.HTTPError as exc:
            record.fail(Failure.TRANSPORT, f"{type(exc).__name__} {'mid_stream' if answered else 'before_response'}")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON that is not the format
            record.fail(Failure.PROTOCOL, f"bad_event:{type(exc).__name__}")
        return record

    async def _events(self, response: httpx.Response, start: float) -> AsyncIterator[tuple[SseEvent, float]]:
        parser = SseParser()
        async for chunk in response.aiter_bytes():
            for event in parser.feed(chunk):
                yield event, self._clock() - start
        last = parser.close()
        if last is not None:
            yield last, self._clock() - start


class InferClient(StreamClient):
    """This project's SSE format: `/coordinator/infer` (api `infer`) or `/worker/generate` (api `worker`)."""

    def __init__(self, base_url: str, sampling: Sampling, *, worker: bool = False, **kwargs: Any) -> None:
        self.path = PATHS["worker" if worker else "infer"]
        super().__init__(base_url, sampling, **kwargs)

    def body(self, item: WorkItem) -> dict[str, Any]:
        s = self.sampling
        request = InferRequest(prompt=item.prompt, model=s.model, max_tokens=s.max_tokens,
                               temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=item.seed,
                               ignore_eos=s.ignore_eos, raw=s.raw)
        return request.model_dump(exclude_none=True)

    async def _consume(self, events: AsyncIterator[tuple[SseEvent, float]], record: RequestRecord) -> None:
        last_index = -1
        async for event, at in events:
            if event.event == EVENT_TOKEN:
                record.event_times.append(at)
                last_index = int(json.loads(event.data)["index"])
            elif event.event == EVENT_DONE:
                record.e2e = at
                record.tokens = int(json.loads(event.data)["usage"]["completion_tokens"])
                record.token_mismatch = record.tokens != last_index + 1
                return
            elif event.event == EVENT_ERROR:
                record.tokens = last_index + 1
                record.fail(Failure.STREAM, str(json.loads(event.data).get("reason", "unknown")))
                return
        record.tokens = last_index + 1
        record.fail(Failure.PROTOCOL, "no_done_event")


class OpenAIClient(StreamClient):
    """OpenAI's streaming format; `body` is `/v1/completions`' (subclasses swap `_input`, `_extensions`)."""

    path = PATHS["openai"]

    def _input(self, item: WorkItem) -> dict[str, Any]:
        return {"prompt": item.prompt}

    def _extensions(self) -> dict[str, Any]:
        """Fields beyond OpenAI's: the sampler chain this project's worker runs, no min-p, no repeat
        penalty (llama_cpp.server defaults to min_p 0.05 and repeat_penalty 1.1)."""
        return {"min_p": 0.0, "repeat_penalty": 1.0}

    def body(self, item: WorkItem) -> dict[str, Any]:
        s = self.sampling
        body: dict[str, Any] = {
            **self._input(item), "max_tokens": s.max_tokens, "temperature": s.temperature,
            "top_p": s.top_p, "top_k": s.top_k, "seed": item.seed, "stream": True,
            "stream_options": {"include_usage": True}, **self._extensions(),
        }
        if s.model is not None:
            body["model"] = s.model
        if s.banned_tokens:
            body["logit_bias"] = {str(t): BAN_BIAS for t in s.banned_tokens}
        return body

    async def _consume(self, events: AsyncIterator[tuple[SseEvent, float]], record: RequestRecord) -> None:
        chunks, usage, finished_at = 0, None, None
        async for event, at in events:
            if event.data.strip() == "[DONE]":
                finished_at = at
                break
            data = json.loads(event.data)
            if data.get("error"):
                record.tokens = usage if usage is not None else chunks
                record.fail(Failure.STREAM, error_reason(event.data.encode()) or "error")
                return
            for choice in data.get("choices") or []:
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    record.event_times.append(at)
                    chunks += 1
                if choice.get("finish_reason") and finished_at is None:
                    finished_at = at
            if data.get("usage"):
                usage = int(data["usage"]["completion_tokens"])
        record.tokens = usage if usage is not None else chunks
        if finished_at is None:
            record.fail(Failure.PROTOCOL, "no_finish")
        else:
            record.e2e = finished_at


class OpenAIChatClient(OpenAIClient):
    """This project's (or any) OpenAI `POST /v1/chat/completions`: the prompt as one user message,
    our `top_k` and (when set) `ignore_eos` as extra fields; the stream is read as `OpenAIClient`'s."""

    path = PATHS["openai-chat"]

    def _input(self, item: WorkItem) -> dict[str, Any]:
        system = [{"role": "system", "content": item.system}] if item.system is not None else []
        return {"messages": [*system, {"role": "user", "content": item.prompt}]}

    def _extensions(self) -> dict[str, Any]:
        return {"ignore_eos": True} if self.sampling.ignore_eos else {}


async def post_timed(http: httpx.AsyncClient, url: str, body: Mapping[str, Any], *, index: int = 0,
                     headers: Mapping[str, str] | None = None,
                     clock: Callable[[], float] = time.perf_counter) -> RequestRecord:
    """One whole JSON request: `e2e` its seconds from send to the answer's last byte, or the failure
    (a non-200 is `Failure.HTTP` with the answer's reason); never raises for a failed request."""
    record = RequestRecord(index)
    start = record.sent_at = clock()
    try:
        response = await http.post(url, json=body, headers=headers)
    except httpx.TimeoutException as exc:
        return record.fail(Failure.TIMEOUT, type(exc).__name__)
    except httpx.HTTPError as exc:
        return record.fail(Failure.TRANSPORT, type(exc).__name__)
    if response.status_code != 200:
        return record.fail(Failure.HTTP, error_reason(response.content), status=response.status_code)
    record.e2e = clock() - start
    record.status = response.status_code
    return record


def make_client(api: str, base_url: str, sampling: Sampling, **kwargs: Any) -> StreamClient:
    if api == "openai":
        return OpenAIClient(base_url, sampling, **kwargs)
    if api == "openai-chat":
        return OpenAIChatClient(base_url, sampling, **kwargs)
    if api in ("infer", "worker"):
        return InferClient(base_url, sampling, worker=api == "worker", **kwargs)
    raise ValueError(f"unknown api {api!r}")


def error_reason(body: bytes) -> str:
    """The `reason` of an error body: ours (`reason`), OpenAI's (`error.code`, else `error.type`),
    FastAPI's `detail`."""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    if isinstance(data.get("reason"), str):
        return data["reason"]
    error = data.get("error")
    if isinstance(error, dict):
        for key in ("code", "type"):
            if isinstance(error.get(key), str) and error[key]:
                return str(error[key])
    if "detail" in data:
        return "invalid_request"
    return ""
