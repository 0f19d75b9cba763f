"""A model whose own chat template lists tools (`<tool_call>` blocks, tests/tagged_model.py) behind the
real coordinator, with the official `openai` client: its template writes the tools, the calls and
their results, a required call comes back as `tool_calls` (streamed and whole), and the round trip
runs. The model's weights are random, so only the format is checked, never what it says."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.conftest import Proc, start_coordinator, start_worker, stop_all
from tests.polling import wait_until
from tests.tagged_model import TEMPLATE, write_tagged_model
from worker.backends.chat_template import ChatTemplate
from worker.backends.llama_model import Model

pytestmark = pytest.mark.model
UNIT = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}}
NOW = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def pool(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """(the coordinator's URL, the worker's, the model): one worker on the tagged tiny model."""
    where = tmp_path_factory.mktemp("tagged")
    tagged = write_tagged_model(model_path, where / "tagged.gguf")
    coordinator, url = start_coordinator(where, "coordinator-tagged", "--heartbeat-interval", "1")
    worker, worker_url = start_worker(where, "tagged", url, tagged, "--threads", "1", "--max-sessions", "4",
                                      "--session-max-tokens", "1024", "--heartbeat-interval", "0.5")
    procs: list[Proc] = [worker, coordinator]
    try:
        wait_until(lambda: any(w["state"] == "alive" for w in
                               httpx.get(url + "/coordinator/health/workers", timeout=2).json()["workers"]),
                   60, "the tagged worker alive", interval=0.2)
        yield url, worker_url, tagged
    finally:
        stop_all(procs)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_required_call_comes_back_as_tool_calls_streamed_and_whole(pool: tuple[str, str, Path]) -> None:
    sdk = client(pool[0])
    kwargs: dict[str, Any] = {"model": "tagged", "messages": ASK, "tools": [UNIT, NOW], "tool_choice": "required",
                              "temperature": 0, "max_tokens": 200}
    whole = sdk.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
    assert all(args["unit"] in ("c", "f") for name, args in calls if name == "get_weather")
    streamed: dict[int, dict[str, str]] = {}
    for chunk in sdk.chat.completions.create(**kwargs, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())] == calls  # greedy: the same


def test_the_template_writes_the_tools_and_the_worker_holds_the_call_to_its_blocks(pool: tuple[str, str, Path]) -> None:
    """Straight to the worker: the answer is the template's `<tool_call>` blocks, and the prompt is the
    template's own rendering with `tools` (counted here by rendering it apart, as Hugging Face would)."""
    _, worker_url, tagged = pool

    def generate(payload: dict[str, Any]) -> tuple[int, str]:
        events: list[tuple[str, dict[str, Any]]] = []
        with httpx.stream("POST", worker_url + "/worker/generate", json=payload, timeout=60) as response:
            assert response.status_code == 200, response.read()
            kind = ""
            for line in response.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    events.append((kind, json.loads(line[6:])))
        prompt = next(data["prompt_tokens"] for kind, data in events if kind == "admitted")
        return prompt, "".join(data["token"] for kind, data in events if kind == "token")

    base: dict[str, Any] = {"messages": ASK, "temperature": 0, "max_tokens": 200}
    plain, _ = generate(base)
    functions = [{"name": "get_weather", "description": "The weather in a city.",
                  "parameters": UNIT["function"]["parameters"]}]  # type: ignore[index]
    listed, text = generate({**base, "tools": {"functions": functions, "choice": "get_weather", "parallel": False}})
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
    call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
    assert call["name"] == "get_weather" and call["arguments"]["unit"] in ("c", "f")
    model = Model(tagged)
    try:
        by_hand = ChatTemplate(TEMPLATE, bos="", eos="", strip_bos=False).render(
            ASK, [{"type": "function", "function": functions[0]}])
        assert "<tools>" in by_hand and listed == len(model.tokenize(by_hand, add_special=True)) > plain
    finally:
        model.close()


def test_a_round_trip_through_the_template(pool: tuple[str, str, Path]) -> None:
    sdk = client(pool[0])
    conversation: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, clear"}]
    answer = sdk.chat.completions.create(model="tagged", messages=conversation, tools=[UNIT], tool_choice="none",  # type: ignore[list-item]
                                         temperature=0, max_tokens=8)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
