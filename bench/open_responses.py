"""The Open Responses compliance checks against a pool started like start.sh: pass/fail per test (issue 49).

    .venv/bin/python -m bench.open_responses TYPES_DIR [--base-url URL] [--model NAME] [--only ID,ID]

The suite itself (github.com/openresponses/openresponses, `bun run test:compliance`) is TypeScript whose
schemas are zod code generated from its OpenAPI document; that code is not vendored here, and its
2026-04-24 generation (the one with the WebSocket and compaction tests) could not be had on this
machine. So this runner makes the suite's 17 tests' requests itself (our own code, from the suite's
test list: the same ids, the same inputs, the same pass conditions) and validates every response and
event against the same specification's models: the `openresponses-types` package (pydantic models
generated from the suite's openapi.json, spec 2026-04-24), unpacked in TYPES_DIR (e.g.
`pip download --no-deps openresponses-types==2.4.0` and unzip it there). It is not a dependency of
the project.

Without --base-url it starts a pool of one coordinator and two workers of the default model on
loopback (bench.processes.pool) and stops it after. Prints each test's result and errors, then
'N passed, N failed'. `image-input` needs a model that reads images: the default SmolLM2 does not.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pydantic
import websockets

from bench.processes import pool

WORKER = ["--threads", "1"]
TERMINAL = ("response.completed", "response.failed", "response.incomplete")
TURN_TIMEOUT = 30.0  # the suite waits 30 s for a WebSocket turn's final event
HTTP_TIMEOUT = 120.0
WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Get the current weather for a location",
    "parameters": {"type": "object", "properties": {"location": {
        "type": "string", "description": "The city and state, e.g. San Francisco, CA"}}, "required": ["location"]},
}
# An 8x8 red PNG, made here (the suite sends a small picture of its own).
HEART_PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAIAAABLbSncAAAAEUlEQVR4nGP4r6CAFTEMLQkAYVlPwYHvrpQAAAAASUVORK5CYII="


class Schemas:
    """The specification's models, from the `openresponses_types` package in a folder of its own."""

    def __init__(self, folder: Path) -> None:
        sys.path.insert(0, str(folder))
        types = importlib.import_module("openresponses_types.types")
        self.response = types.ResponseResource
        self.compact = types.CompactResource
        self.create_event = types.WebSocketResponseCreateEvent
        self.events = [getattr(types, n) for n in dir(types) if n.endswith("StreamingEvent")]
        self.socket_error = types.WebSocketErrorEvent

    @staticmethod
    def issues(model: Any, data: Any, prefix: str = "") -> list[str]:
        try:
            model.model_validate(data)
        except pydantic.ValidationError as exc:
            return [f"{prefix}{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors()]
        return []

    def event_issues(self, data: Any, *, socket: bool) -> list[str]:
        kinds = [*self.events, self.socket_error] if socket else self.events
        for kind in kinds:
            if not self.issues(kind, data):
                return []
        kind_name = data.get("type") if isinstance(data, dict) else None
        return [f"Event validation failed for {kind_name}: matches no event schema"]


@dataclass
class Turn:
    """One response's events (SSE or WebSocket) and how it ended."""

    events: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    final: dict[str, Any] | None = None
    error_code: str | None = None
    error_event: dict[str, Any] | None = None

    def failed(self) -> bool:
        return bool(self.error_event or self.error_code or (self.final or {}).get("status") == "failed")


@dataclass
class Suite:
    base_url: str
    model: str
    schemas: Schemas

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/responses"

    # --- transports -------------------------------------------------------------------------------

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
            return await client.post(self.base_url + path, json=body, headers={"Authorization": "Bearer x"})

    async def stream(self, body: dict[str, Any]) -> Turn:
        turn = Turn()
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client, client.stream(
                "POST", self.base_url + "/responses", json={**body, "stream": True}) as answer:
            if answer.status_code != 200:
                turn.errors.append(f"HTTP {answer.status_code}: {(await answer.aread()).decode()}")
                return turn
            async for line in answer.aiter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    self._take(turn, json.loads(line[5:]), socket=False)
        return turn

    async def socket(self, bodies: list[dict[str, Any] | Callable[[list[Turn]], dict[str, Any]]],
                     *, check_requests: bool = True) -> list[Turn]:
        """One WebSocket, one response.create per body (a callable makes its body from the turns so far),
        each sent once the previous one ended."""
        turns: list[Turn] = []
        async with websockets.connect(self.ws_url, additional_headers={"Authorization": "Bearer x"}) as ws:
            for step in bodies:
                body = step(turns) if callable(step) else step
                turn = Turn()
                turns.append(turn)
                if check_requests:
                    turn.errors += self.schemas.issues(self.schemas.create_event, body, "WebSocket request ")
                await ws.send(json.dumps(body))
                await asyncio.wait_for(self._socket_turn(ws, turn), TURN_TIMEOUT)
        return turns

    async def _socket_turn(self, ws: Any, turn: Turn) -> None:
        while True:
            data = json.loads(await ws.recv())
            if self._take(turn, data, socket=True):
                return

    def _take(self, turn: Turn, data: dict[str, Any], *, socket: bool) -> bool:
        """Records one event; True when it ends the turn."""
        turn.events.append(data)
        turn.errors += self.schemas.event_issues(data, socket=socket)
        if data.get("type") in TERMINAL:
            turn.final = data.get("response")
            return True
        error = data.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        if data.get("type") == "error" or code:
            turn.error_code, turn.error_event = code, data
            return True
        return False

    # --- validators -------------------------------------------------------------------------------

    def completed(self, response: Any, *, output: bool = True) -> list[str]:
        issues = self.schemas.issues(self.schemas.response, response)
        if issues:
            return issues
        errors = [] if not output or response.get("output") else ["Response has no output items"]
        if response.get("status") != "completed":
            errors.append(f'Expected status "completed" but got "{response.get("status")}"')
        return errors

    def request(self, content: Any, **extra: Any) -> dict[str, Any]:
        items = content if isinstance(content, list) else [{"type": "message", "role": "user", "content": content}]
        return {"model": self.model, "input": items, **extra}

    def create(self, input_: Any, **extra: Any) -> dict[str, Any]:
        return {"type": "response.create", "model": self.model, "store": False, "input": input_, **extra}

    async def plain(self, body: dict[str, Any], *extra: Callable[[dict[str, Any]], list[str]]) -> list[str]:
        answer = await self.post("/responses", body)
        if answer.status_code != 200:
            return [f"HTTP {answer.status_code}: {answer.text}"]
        data = answer.json()
        errors = self.completed(data, output=True)
        return errors + [e for check in extra for e in check(data)] if not errors else errors

    def turn_errors(self, turn: Turn, label: str = "") -> list[str]:
        if turn.final is None:
            return [f"{label}{e}" for e in turn.errors] + [f"{label}no terminal response event"]
        return [f"{label}{e}" for e in turn.errors + self.completed(turn.final, output=False)]


def has_type(kind: str) -> Callable[[dict[str, Any]], list[str]]:
    def check(response: dict[str, Any]) -> list[str]:
        if any(item.get("type") == kind for item in response.get("output", [])):
            return []
        return [f'Expected output item of type "{kind}" but none found']
    return check


def expect_code(turn: Turn | None, code: str, when: str) -> list[str]:
    got = turn.error_code if turn else None
    got = got or (((turn.final or {}).get("error") or {}).get("code") if turn else None)
    return [] if got == code else [f"Expected {code} {when} but got {got or 'no error code'}"]


# --- the tests ------------------------------------------------------------------------------------

async def basic_response(s: Suite) -> list[str]:
    return await s.plain(s.request("Say hello in exactly 3 words."))


async def assistant_phase(s: Suite) -> list[str]:
    return await s.plain(s.request([
        {"type": "message", "role": "assistant", "phase": "commentary", "content": "I should answer with the saved number."},
        {"type": "message", "role": "assistant", "phase": "final_answer", "content": "The number is four."},
        {"type": "message", "role": "user", "content": "Repeat only the number."},
    ]))


async def output_phase_schema(s: Suite) -> list[str]:
    """The suite's local fixture: the schema takes assistant output labelled with a phase (no request)."""
    message = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant", "phase": "commentary",
               "content": [{"type": "output_text", "text": "x", "annotations": []}]}
    return s.schemas.issues(s.schemas.response, {
        "id": "resp_1", "object": "response", "created_at": 1, "completed_at": 2, "status": "completed",
        "incomplete_details": None, "model": s.model, "previous_response_id": None, "instructions": None,
        "output": [message], "error": None, "tools": [], "tool_choice": "auto", "truncation": "disabled",
        "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "top_p": 1, "presence_penalty": 0,
        "frequency_penalty": 0, "top_logprobs": 0, "temperature": 1, "reasoning": None, "usage": None,
        "max_output_tokens": None, "max_tool_calls": None, "store": True, "background": False,
        "service_tier": "default", "metadata": {}, "safety_identifier": None, "prompt_cache_key": None})


async def streaming_response(s: Suite) -> list[str]:
    turn = await s.stream(s.request("Count from 1 to 5."))
    return (["No streaming events received"] if not turn.events else []) + s.turn_errors(turn)


async def websocket_response(s: Suite) -> list[str]:
    body = {"type": "response.create", "model": s.model,
            "input": [{"type": "message", "role": "user", "content": "Count from 1 to 3."}]}
    (turn,) = await s.socket([body])
    return s.turn_errors(turn)


async def websocket_sequential(s: Suite) -> list[str]:
    turns = await s.socket([s.create("Reply with exactly: first"), s.create("Reply with exactly: second")])
    return [e for i, turn in enumerate(turns, 1) for e in s.turn_errors(turn, f"Turn {i}: ")]


def _continuing(s: Suite, input_: Any) -> Callable[[list[Turn]], dict[str, Any]]:
    def body(turns: list[Turn]) -> dict[str, Any]:
        first = turns[0].final or {}
        if not first.get("id"):
            raise RuntimeError("First WebSocket turn did not return a response id")
        return s.create(input_, previous_response_id=first["id"])
    return body


async def websocket_continuation(s: Suite) -> list[str]:
    first, second = await s.socket([s.create("Remember the code word: cobalt. Reply with OK."),
                                    _continuing(s, "What is the code word? Reply with only the code word.")])
    return s.turn_errors(first, "Turn 1: ") or s.turn_errors(second, "Turn 2: ")


async def websocket_reconnect(s: Suite) -> list[str]:
    (first,) = await s.socket([s.create("Remember the code word: copper. Reply with OK.")])
    errors = s.turn_errors(first, "Turn 1: ")
    if errors or first.final is None:
        return errors
    reconnect, recovery = await s.socket([
        s.create("Try to continue after reconnect. Reply with exactly: reconnected",
                 previous_response_id=first.final["id"]),
        s.create([{"type": "message", "role": "user", "content": "Start a new response and reply with exactly: recovered"}]),
    ])
    return (reconnect.errors + expect_code(reconnect, "previous_response_not_found", "after reconnecting a store:false chain")
            + s.turn_errors(recovery, "Recovery: "))


async def websocket_not_found(s: Suite) -> list[str]:
    (turn,) = await s.socket([s.create("This should fail because the previous response is missing.",
                                       previous_response_id=f"resp_openresponses_missing_{time.time_ns()}")])
    return expect_code(turn, "previous_response_not_found", "") + turn.errors


async def websocket_failed_evicts(s: Suite) -> list[str]:
    orphan = [{"type": "function_call_output", "call_id": "call_openresponses_missing",
               "output": "No matching tool call exists in the previous response."}]
    first, failed, retry = await s.socket([
        s.create("Remember the code word: ember. Reply with OK."), _continuing(s, orphan),
        _continuing(s, "Try to continue after the failed turn. Reply with exactly: stale")])
    errors = s.turn_errors(first, "Turn 1: ")
    if not failed.failed():
        status = (failed.final or {}).get("status", "no terminal response")
        errors += [*failed.errors, f"Expected second WebSocket continuation turn to fail but got status {status}"]
    return errors + retry.errors + expect_code(retry, "previous_response_not_found", "after failed continuation eviction")


async def websocket_compact_new_chain(s: Suite) -> list[str]:
    compact = {"model": s.model, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Remember the compaction code word: slate."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "OK."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Compress this conversation for later continuation."}]},
    ]}
    answer = await s.post("/responses/compact", compact)
    if answer.status_code != 200:
        return [f"HTTP {answer.status_code} from /responses/compact: {answer.text}"]
    output = answer.json().get("output")
    if not isinstance(output, list):
        return ["Compaction response did not include an output array"]
    tail = {"type": "message", "role": "user", "content": "Continue from here. Reply with exactly: compacted"}
    (turn,) = await s.socket([s.create([*output, tail], tools=[])], check_requests=False)
    return s.turn_errors(turn)


async def system_prompt(s: Suite) -> list[str]:
    return await s.plain(s.request([
        {"type": "message", "role": "system", "content": "You are a pirate. Always respond in pirate speak."},
        {"type": "message", "role": "user", "content": "Say hello."}]))


async def tool_calling(s: Suite) -> list[str]:
    return await s.plain(s.request("What's the weather like in San Francisco?", tools=[WEATHER_TOOL]),
                         has_type("function_call"))


async def image_input(s: Suite) -> list[str]:
    return await s.plain(s.request([{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
        {"type": "input_image", "image_url": HEART_PNG}]}]))


async def multi_turn(s: Suite) -> list[str]:
    return await s.plain(s.request([
        {"type": "message", "role": "user", "content": "My name is Alice."},
        {"type": "message", "role": "assistant", "content": "Hello Alice! Nice to meet you. How can I help you today?"},
        {"type": "message", "role": "user", "content": "What is my name?"}]))


async def compact_response(s: Suite) -> list[str]:
    answer = await s.post("/responses/compact", s.request([
        {"type": "message", "role": "user", "content": "We agreed to launch on Tuesday and notify support first."},
        {"type": "message", "role": "assistant", "content": "Understood. The launch is Tuesday, with support notified beforehand."},
    ], prompt_cache_key="openresponses-compact-test"))
    if answer.status_code != 200:
        return [f"HTTP {answer.status_code}: {answer.text}"]
    data = answer.json()
    errors = s.schemas.issues(s.schemas.compact, data)
    if data.get("object") != "response.compaction":
        errors.append(f'Expected object "response.compaction" but got "{data.get("object")}"')
    return errors + (["Response has no output items"] if not data.get("output") else has_type("compaction")(data))


async def compact_missing_model(s: Suite) -> list[str]:
    answer = await s.post("/responses/compact", {"input": [
        {"type": "message", "role": "user", "content": "Compact this conversation."}]})
    return [] if answer.status_code in (400, 422) else [f"HTTP {answer.status_code}: {answer.text}"]


BROKE_OFF = (OSError, TimeoutError, httpx.HTTPError, websockets.WebSocketException, RuntimeError, ValueError,
             KeyError, TypeError)

TESTS: dict[str, Callable[[Suite], Awaitable[list[str]]]] = {
    "basic-response": basic_response,
    "assistant-phase": assistant_phase,
    "response-output-phase-schema": output_phase_schema,
    "streaming-response": streaming_response,
    "websocket-response": websocket_response,
    "websocket-sequential-responses": websocket_sequential,
    "websocket-continuation": websocket_continuation,
    "websocket-reconnect-store-false-recovery": websocket_reconnect,
    "websocket-previous-response-not-found": websocket_not_found,
    "websocket-failed-continuation-evicts-cache": websocket_failed_evicts,
    "websocket-compact-new-chain": websocket_compact_new_chain,
    "system-prompt": system_prompt,
    "tool-calling": tool_calling,
    "image-input": image_input,
    "multi-turn": multi_turn,
    "compact-response": compact_response,
    "compact-missing-model": compact_missing_model,
}


async def run(suite: Suite, only: list[str]) -> dict[str, list[str]]:
    results: dict[str, list[str]] = {}
    for test_id, test in TESTS.items():
        if only and test_id not in only:
            continue
        try:
            results[test_id] = await test(suite)
        except BROKE_OFF as exc:  # a test that broke off (a closed socket, a timeout) fails, the rest go on
            results[test_id] = [f"{type(exc).__name__}: {exc}"]
    return results


def report(results: dict[str, list[str]]) -> int:
    for test_id, errors in results.items():
        print(f"{'PASS' if not errors else 'FAIL'} {test_id}")
        for error in errors[:6]:
            print(f"     {error[:300]}")
    failed = sum(1 for errors in results.values() if errors)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("types_dir", type=Path, help="folder holding the openresponses_types package")
    parser.add_argument("--base-url", help="a running pool's /v1 URL; without it a pool is started")
    parser.add_argument("--model", help="model name sent (default: the pool's first in /v1/models)")
    parser.add_argument("--only", default="", help="comma-separated test ids")
    parser.add_argument("--model-path", help="the started pool's workers serve this GGUF (default: the provisioned "
                                             "SmolLM2)")
    args = parser.parse_args(argv)
    schemas = Schemas(args.types_dir)
    only = [t for t in args.only.split(",") if t]

    def against(base: str) -> int:
        model = args.model or httpx.get(base + "/models", timeout=10).json()["data"][0]["id"]
        print(f"Open Responses checks against {base}, model {model}")
        return report(asyncio.run(run(Suite(base, model, schemas), only)))

    if args.base_url:
        return against(args.base_url.rstrip("/"))
    worker = [*WORKER, *(["--model-path", args.model_path] if args.model_path else [])]
    with tempfile.TemporaryDirectory(prefix="open-responses-") as logs, \
            pool(Path(logs), workers=[worker, worker]) as running:
        return against(running.url + "/v1")


if __name__ == "__main__":
    raise SystemExit(main())
