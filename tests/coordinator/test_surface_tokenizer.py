"""`/tokenize`, `/detokenize` and `/tokenizer_info` at the coordinator: the work a worker is sent, the next worker when one
does not answer, and a worker's refusal passed on as it was (the coordinator's error body)."""

from __future__ import annotations

import json

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator.fakes import FakeWorkers, heartbeat, register, running_app

pytestmark = pytest.mark.anyio


def tokenizer(seen: list[dict]) -> object:  # type: ignore[type-arg]
    """A worker's tokenizer: one token per word of a prompt, or per message."""
    def behaviour(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path == "/worker/tokenizer_info":
            return httpx.Response(200, json={"tokenizer_class": "llama.cpp/gpt2", "bos_token": None,
                                             "eos_token": "<|end|>", "add_bos_token": False, "chat_template": None,
                                             "model_max_length": 512, "vocab_size": 100})
        if request.url.path == "/worker/detokenize":
            if any(t > 99 for t in body["tokens"]):
                return httpx.Response(400, json={"error": "tokens.0: not a token", "reason": "invalid_request",
                                                 "request_id": "r"})
            return httpx.Response(200, json={"prompt": " ".join(map(str, body["tokens"]))})
        tokens = list(range(len(body["prompt"].split()) if "prompt" in body else len(body["messages"])))
        return httpx.Response(200, json={"count": len(tokens), "max_model_len": 512, "tokens": tokens,
                                         "token_strs": None})
    return behaviour


async def test_tokenize_sends_the_work_to_a_worker_of_the_model_and_passes_its_answer() -> None:
    clock, seen = ManualClock(), []  # type: ignore[var-annotated]
    fakes = FakeWorkers({"w1": tokenizer(seen)})  # type: ignore[dict-item]
    async with running_app(Settings(heartbeat_interval=1.0), fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        answer = await client.post("/tokenize", json={"prompt": "three words here"})
        assert answer.status_code == 200 and answer.json()["count"] == 3 and answer.headers["x-worker-id"] == "w1"
        chat = await client.post("/tokenize", json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "return_token_strs": True})
        assert chat.status_code == 200 and chat.json()["count"] == 1
        # A prompt gets the model's begin-of-text token by default; a chat's template writes its own.
        assert seen[0]["add_special"] is True and seen[1]["add_special"] is False and seen[1]["token_strs"] is True
        assert [(m["role"], m["content"]) for m in seen[1]["messages"]] == [("user", "ab")]  # parts joined, as in a chat
        both = await client.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "y"}]})
        assert both.status_code == 400 and "exactly one" in both.json()["error"]


async def test_a_worker_that_does_not_answer_is_passed_over_and_a_refusal_comes_back_as_it_was() -> None:
    clock, seen = ManualClock(), []  # type: ignore[var-annotated]
    fakes = FakeWorkers({"w2": tokenizer(seen)}, silent={"w1"})  # type: ignore[dict-item]
    async with running_app(Settings(heartbeat_interval=1.0), fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        await register(client, heartbeat("w2", timestamp=clock.time()))
        back = await client.post("/detokenize", json={"tokens": [1, 2]})
        assert back.status_code == 200 and back.json() == {"prompt": "1 2"}
        refused = await client.post("/detokenize", json={"tokens": [100]})
        assert refused.status_code == 400 and refused.json()["reason"] == "invalid_request"
        negative = await client.post("/detokenize", json={"tokens": [-1]})
        assert negative.status_code == 400 and len(seen) == 2  # refused here, never sent


async def test_tokenizer_info_asks_a_worker_of_the_named_model_and_refuses_an_unknown_one() -> None:
    clock, seen = ManualClock(), []  # type: ignore[var-annotated]
    fakes = FakeWorkers({"w1": tokenizer(seen)})  # type: ignore[dict-item]
    async with running_app(Settings(heartbeat_interval=1.0), fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        info = await client.get("/tokenizer_info")
        assert info.status_code == 200 and info.json()["eos_token"] == "<|end|>" and seen == [{}]
        named = await client.get("/tokenizer_info", params={"model": "smol"})
        assert named.status_code == 200 and seen[-1] == {"model": "smol"}
        unknown = await client.get("/tokenizer_info", params={"model": "nope"})
        assert unknown.status_code == 404 and len(seen) == 2


async def test_with_api_keys_the_tokenizer_routes_need_a_key_too() -> None:
    """They reach workers: where API_KEYS is set, each is 401 without a key (no worker is called) and
    answered with one."""
    clock, seen = ManualClock(), []  # type: ignore[var-annotated]
    fakes = FakeWorkers({"w1": tokenizer(seen)})  # type: ignore[dict-item]
    settings = Settings(heartbeat_interval=1.0, api_keys="the-key")
    async with running_app(settings, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        asks = [("POST", "/tokenize", {"prompt": "a b c"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
                ("GET", "/tokenizer_info", None)]
        refused = [await client.request(method, path, json=body) for method, path, body in asks]
        assert [r.status_code for r in refused] == [401, 401, 401] and seen == []
        keyed = [await client.request(method, path, json=body, headers={"authorization": "Bearer the-key"})
                 for method, path, body in asks]
    assert [r.status_code for r in keyed] == [200, 200, 200] and len(seen) == 3
