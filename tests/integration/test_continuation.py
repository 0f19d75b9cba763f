"""A stream outlives its worker, end to end: a real coordinator, two real workers of the real model, the
official `openai` package as the client of the OpenAI surfaces. Eight greedy streams run on both workers
(through `/coordinator/infer`, chat completions streamed and not, and Responses); once each streamed one
has 40 tokens, one worker is SIGKILLed, or drained (SIGTERM). Every stream ends whole, as long as asked,
no token twice and none missing; the drained worker is gone within seconds, not after its streams.
(Greedy text equal to a fault-free run is not asked: two fault-free runs of these eight differ too, as
llama.cpp's kernels round by the batch's shape; `bench/continuation_bench.py` counts how often.)"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.conftest import TOKEN, WORKER_HEARTBEAT, Cluster, running_cluster, start_worker
from tests.polling import wait_until

pytestmark = [pytest.mark.process, pytest.mark.anyio]
MODEL = "SmolLM2-135M-Instruct.Q4_1"
TOKENS = 160
DRAINED_TOKENS = 400
KILL_AT = 40
PROMPTS = [f"Write a long story about a {animal} who learns to {skill}." for animal, skill in (
    ("fox", "swim"), ("cat", "sing"), ("owl", "cook"), ("bear", "paint"),
    ("frog", "dance"), ("mole", "fly"), ("goat", "read"), ("crab", "climb"))]


@dataclass
class Stream:
    """One request's progress as its client saw it: its text so far, its tokens (chunks), how it ended."""

    kind: str
    text: str = ""
    tokens: int = 0
    finish: str | None = None  # length, stop; or error:<reason>
    completion_tokens: int | None = None
    indices: list[int] = field(default_factory=list)  # `/coordinator/infer`: each token event's index


class RoomyCluster(Cluster):
    """Workers with room for the other's streams (8 sequences each, as a move needs), else as the suite's."""

    def start_worker(self, worker_id: str) -> None:
        self.workers[worker_id], self.worker_urls[worker_id] = start_worker(
            self.log_dir, worker_id, self.url, self.model_path, "--threads", "1", "--heartbeat-interval",
            str(WORKER_HEARTBEAT), "--worker-token", TOKEN, "--max-sessions", "8", "--session-max-tokens", "512")


@pytest.fixture(scope="module")
def pool_module(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("continuation"), model_path, "coordinator", "--heartbeat-interval",
                         "1", "--worker-token", TOKEN, "--retry-after", "1", kind=RoomyCluster) as cluster:
        yield cluster


@pytest.fixture
def pool(pool_module: Cluster) -> Cluster:
    pool_module.ensure()  # a killed or drained worker back, both idle
    return pool_module


async def _infer(url: str, prompt: str, tokens: int, into: Stream, session: str | None = None) -> None:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            **({"session_id": session} if session else {})}
    async with httpx.AsyncClient(timeout=120) as client, \
            client.stream("POST", url + "/coordinator/infer", json=body) as response:
        assert response.status_code == 200
        name = ""
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                if name == "token":
                    into.text += data["token"]
                    into.tokens += 1
                    into.indices.append(data["index"])
                elif name == "done":
                    into.finish, into.completion_tokens = data["finish_reason"], data["usage"]["completion_tokens"]
                elif name == "error":
                    into.finish = f"error:{data['reason']}"


async def _chat(sdk: openai.AsyncOpenAI, prompt: str, tokens: int, into: Stream, *, stream: bool) -> None:
    asked: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
             "temperature": 0, "extra_body": {"ignore_eos": True}}
    try:
        if not stream:
            whole = await sdk.chat.completions.create(**asked)
            into.text, into.finish = whole.choices[0].message.content or "", whole.choices[0].finish_reason
            into.completion_tokens = whole.usage.completion_tokens
            return
        chunks = await sdk.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True})
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                into.text += chunk.choices[0].delta.content
                into.tokens += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                into.finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                into.completion_tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:
        into.finish = f"error:{exc}"


async def _responses(sdk: openai.AsyncOpenAI, prompt: str, tokens: int, into: Stream) -> None:
    try:
        events = await sdk.responses.create(model=MODEL, input=prompt, max_output_tokens=tokens, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        async for event in events:
            if event.type == "response.output_text.delta":
                into.text += event.delta
                into.tokens += 1
            elif event.type in ("response.completed", "response.incomplete"):
                details = event.response.incomplete_details
                into.finish = "length" if details is not None and details.reason == "max_output_tokens" else "stop"
                usage = event.response.usage
                into.completion_tokens = usage.output_tokens if usage is not None else None
            elif event.type in ("error", "response.failed"):
                into.finish = f"error:{event.type}"
    except openai.APIError as exc:
        into.finish = f"error:{exc}"


KINDS = ("infer", "infer", "chat", "chat", "chat-whole", "chat-whole", "responses", "responses")


def _start(url: str, tokens: int) -> tuple[list[Stream], list[Awaitable[None]], openai.AsyncOpenAI]:
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    streams = [Stream(kind) for kind in KINDS]
    runs: dict[str, Callable[[str, Stream], Awaitable[None]]] = {
        "infer": lambda p, s: _infer(url, p, tokens, s),
        "chat": lambda p, s: _chat(sdk, p, tokens, s, stream=True),
        "chat-whole": lambda p, s: _chat(sdk, p, tokens, s, stream=False),
        "responses": lambda p, s: _responses(sdk, p, tokens, s)}
    return streams, [runs[s.kind](p, s) for s, p in zip(streams, PROMPTS, strict=True)], sdk


async def _run(url: str, tokens: int, fault: Callable[[list[Stream]], Awaitable[None]] | None = None
               ) -> list[Stream]:
    streams, runs, sdk = _start(url, tokens)
    tasks = [asyncio.ensure_future(run) for run in runs]
    try:
        if fault is not None:
            await fault(streams)
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
    finally:
        await sdk.close()
    return streams


async def _when_each_has(streams: list[Stream], tokens: int) -> None:
    deadline = time.monotonic() + 120
    while any(s.tokens < tokens for s in streams if s.kind != "chat-whole"):
        assert time.monotonic() < deadline, [s.tokens for s in streams]
        await asyncio.sleep(0.02)


def _whole(streams: list[Stream], tokens: int) -> None:
    """Each stream as long as asked, its usage what the client received; through `/coordinator/infer`,
    where each token event names its index, no token twice and none missing across the seam."""
    for stream in streams:
        assert (stream.finish, stream.completion_tokens) == ("length", tokens), (stream.kind, stream.finish)
        if stream.kind == "infer":
            assert stream.indices[-1] == tokens - 1 and stream.indices == sorted(set(stream.indices)), stream.indices


def _metric(cluster: Cluster, prefix: str) -> float:
    text = httpx.get(cluster.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


async def test_streams_whose_worker_is_killed_go_on_on_the_other_whole(pool: Cluster) -> None:

    async def kill(streams: list[Stream]) -> None:
        await _when_each_has(streams, KILL_AT)
        pool.workers["w1"].signal(signal.SIGKILL)

    streams = await _run(pool.url, TOKENS, kill)
    _whole(streams, TOKENS)
    assert _metric(pool, 'coordinator_stream_breaks_total{outcome="continued"}') >= 1
    assert _metric(pool, 'coordinator_stream_breaks_total{outcome="ended"}') == 0
    print("FIGURE", json.dumps({"case": "SIGKILL under 8 streams of 160 tokens", "continued": _metric(
        pool, 'coordinator_stream_breaks_total{outcome="continued"}'), "pause_s_sum": round(_metric(
            pool, "coordinator_continuation_pause_seconds_sum"), 3)}))
    wait_until(lambda: pool.coordinator_health()["kv_reserved_bytes"] == 0, 5, "every reservation back")
    wait_until(lambda: pool.worker_load("w2")["active_streams"] == 0, 5, "nothing left running on w2")


async def test_a_sessions_first_turn_whose_worker_is_killed_goes_on_and_its_session_keeps_it_all(
        pool: Cluster) -> None:
    """Kept sessions' first turns, on both workers; w1 SIGKILLed at token 40: each turn ends whole, and
    each session's next turn runs where it went on, its history the first prompt and the whole answer."""
    streams = [Stream("infer") for _ in range(4)]
    tasks = [asyncio.ensure_future(_infer(pool.url, prompt, TOKENS, stream, f"kept-{i}"))
             for i, (stream, prompt) in enumerate(zip(streams, PROMPTS, strict=False))]
    await _when_each_has(streams, KILL_AT)
    pool.workers["w1"].signal(signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*tasks), 180)
    _whole(streams, TOKENS)
    assert _metric(pool, 'coordinator_stream_breaks_total{outcome="continued"}') >= 1
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(len(streams)):
            turn = await client.post(pool.url + "/coordinator/infer", json={
                "prompt": "Go on.", "max_tokens": 4, "temperature": 0, "session_id": f"kept-{i}"})
            lines = turn.text.splitlines()
            assert turn.status_code == 200 and "event: done" in lines, turn.text[-300:]
            done = next(line for line in lines[lines.index("event: done"):] if line.startswith("data:"))
            usage = json.loads(done[5:])["usage"]
            assert usage["prompt_tokens"] > TOKENS and usage["cached_tokens"] > TOKENS, usage  # the whole answer held
            assert (await client.delete(pool.url + f"/coordinator/sessions/kept-{i}")).status_code == 204
    wait_until(lambda: pool.coordinator_health()["kv_reserved_bytes"] == 0, 5, "every reservation back")


async def test_a_drain_moves_its_streams_and_ends_in_seconds(pool: Cluster) -> None:
    """Streams long enough (400 tokens) that a drain waiting for them would take far longer than 5 s. The
    worker is gone while every stream still runs (whatever the machine's load, which slows both alike); its
    time is a figure, bounded loosely here (5.38 s was seen on CI's shared cores, 0.86 s quiet:
    bench/continuation_bench.py measures it against the issue's 5 s)."""
    drained: list[float] = []
    running_at_exit: list[bool] = []

    async def drain(streams: list[Stream]) -> None:
        await _when_each_has(streams, KILL_AT)
        started = time.monotonic()
        pool.workers["w1"].signal(signal.SIGTERM)
        proc = pool.workers["w1"].popen
        assert proc is not None
        await asyncio.to_thread(proc.wait, 30)
        drained.append(time.monotonic() - started)
        running_at_exit.extend(s.finish is None for s in streams)

    streams = await _run(pool.url, DRAINED_TOKENS, drain)
    _whole(streams, DRAINED_TOKENS)
    assert all(running_at_exit), running_at_exit  # it did not wait for its streams: they went on elsewhere
    assert drained[0] < 15.0, drained
    moved = _metric(pool, 'coordinator_stream_moves_total{outcome="moved"}')
    assert moved >= 1
    print("FIGURE", json.dumps({"case": "drain under 8 streams of 400 tokens", "drained_s": round(drained[0], 2),
                                "moved": moved}))
