"""Reasoning fields, as coding agents send them on every turn: accepted on the Responses API and on chat
completions, repeated in the answer, and never a 400 for a value OpenAI's API takes. The models served
have no thinking switch, so the worker's request carries nothing of them (docs: inference.http.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol import openai_responses as rs
from tests.coordinator.fakes import FakeWorkers, streaming
from tests.coordinator.test_surface_openai import ONE, STREAM
from tests.coordinator.test_surface_openai import pool as chat_pool
from tests.coordinator.test_surface_responses import pool

pytestmark = pytest.mark.anyio

EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh"]
# What Codex CLI 0.171 sends with every turn (logged from its requests), but the conversation itself.
CODEX_FIELDS: dict[str, Any] = {
    "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "store": False,
    "prompt_cache_key": "01a224f6", "client_metadata": {"thread_id": "t"}, "tool_choice": "auto",
    "parallel_tool_calls": True,
    "tools": [{"type": "function", "name": "exec_command", "description": "run", "strict": False,
               "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
              {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents",
               "tools": [{"type": "function", "name": "close_agent", "parameters": {"type": "object"}}]},
              {"type": "web_search", "external_web_access": False}]}


def sent(fakes: FakeWorkers) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(fakes.calls[-1][1].content)
    return body


@pytest.mark.parametrize("effort", EFFORTS)
async def test_every_effort_is_accepted_and_repeated_on_the_responses_api(effort: str) -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, _, _):
        response = await client.post("/v1/responses", json={
            "input": "Hi", "reasoning": {"effort": effort, "summary": "auto"}})
    assert response.status_code == 200, response.text
    assert response.json()["reasoning"] == {"effort": effort, "summary": "auto"}
    assert not any("reasoning" in str(key) for key in sent(fakes))  # nothing for the worker to set
    assert [item["type"] for item in response.json()["output"]] == ["message"]  # no reasoning items


async def test_codex_cli_request_is_served_with_its_function_tools_only() -> None:
    """Hosted tools and namespaces are accepted and listed back, but only function tools are offered
    to the model (it could not run the others)."""
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, sdk, _):
        response = await client.post("/v1/responses", json={"input": "Hi", **CODEX_FIELDS})
        streamed = await sdk.responses.create(model="smol", input="Hi", stream=True,
                                              **{k: v for k, v in CODEX_FIELDS.items()
                                                 if k in ("reasoning", "include", "store", "tool_choice")})
        events = [event.type async for event in streamed]
    assert response.status_code == 200, response.text
    offered = [tool["function"]["name"] for tool in sent(fakes)["tools"]] if "tools" in sent(fakes) else None
    worker_bodies = [json.loads(call[1].content) for call in fakes.calls]
    assert "exec_command" in json.dumps(worker_bodies[0]) and "close_agent" not in json.dumps(worker_bodies[0])
    assert "web_search" not in json.dumps(worker_bodies[0])
    assert offered is None or offered == ["exec_command"]
    assert [tool["type"] for tool in response.json()["tools"]] == ["function", "namespace", "web_search"]
    assert events[-1] == rs.COMPLETED


async def test_earlier_reasoning_items_are_left_out_of_the_conversation() -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with pool(fakes) as (client, _, _):
        response = await client.post("/v1/responses", json={"input": [
            {"role": "user", "content": "Hi"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
            {"role": "user", "content": "Again"}]})
    assert response.status_code == 200, response.text
    assert [m["role"] for m in sent(fakes)["messages"]] == ["user", "assistant", "user"]


@pytest.mark.parametrize("effort", EFFORTS)
async def test_reasoning_effort_is_accepted_on_chat_completions(effort: str) -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with chat_pool(fakes, ONE) as (client, _):
        response = await client.post("/v1/chat/completions", json={
            "model": "smol", "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort})
    assert response.status_code == 200, response.text
    assert "reasoning_effort" not in sent(fakes)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"model": "smol", "messages": [{"role": "user", "content": "Hi"}],
                              "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ("/v1/responses", {"input": "Hi", "include": ["message.output_text.logprobs"]}, "include"),
])
async def test_an_effort_openai_does_not_define_is_refused(path: str, body: dict[str, Any], param: str) -> None:
    fakes = FakeWorkers({"w1": streaming(STREAM)})
    async with chat_pool(fakes, ONE) as (client, _):
        response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert fakes.calls == []
