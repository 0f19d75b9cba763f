"""A limited key's `x-ratelimit-*` headers on every answer it gets, as OpenAI sends them, streamed and
not, so a client can pace itself before it is refused (issue 50: they came only on 429s)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from coordinator.clock import ManualClock
from coordinator.settings import Settings
from tests.coordinator.fakes import FakeWorkers, heartbeat, register, running_app
from tests.coordinator.test_gateway_fairness import gated

pytestmark = pytest.mark.anyio
SETTINGS = Settings(heartbeat_interval=1.0, api_keys="paced-key paced 1 rpm=4 tpm=1000,free-key free")


def limits_of(answer: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in answer.headers.items() if k.startswith("x-ratelimit-")}


async def test_every_answer_of_a_limited_key_carries_its_ratelimit_headers() -> None:
    clock = ManualClock()
    fakes = FakeWorkers({"w1": gated(asyncio.Event(), set())})
    async with running_app(SETTINGS, fakes, clock) as client:
        await register(client, heartbeat("w1", timestamp=clock.time()))
        paced = {"authorization": "Bearer paced-key"}
        streamed = await client.post("/coordinator/infer", json={"prompt": "hi", "max_tokens": 5}, headers=paced)
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        # Counted in as it started; its tokens are charged when it ends, after its head went out.
        assert limits_of(streamed) == {"x-ratelimit-limit-requests": "4", "x-ratelimit-remaining-requests": "3",
                                       "x-ratelimit-reset-requests": "15s", "x-ratelimit-limit-tokens": "1000",
                                       "x-ratelimit-remaining-tokens": "1000", "x-ratelimit-reset-tokens": "0s"}
        whole = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}, headers=paced)
        assert whole.status_code == 200 and "choices" in whole.json()
        seen = limits_of(whole)
        assert seen["x-ratelimit-remaining-requests"] == "2" and seen["x-ratelimit-limit-tokens"] == "1000"
        assert int(seen["x-ratelimit-remaining-tokens"]) < 1000  # the first answer's tokens, charged
        chat = await client.post("/v1/chat/completions", headers=paced, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True})
        assert chat.status_code == 200 and limits_of(chat)["x-ratelimit-remaining-requests"] == "1"
        listed = await client.get("/v1/models", headers=paced)  # not counted: what stands now
        assert listed.status_code == 200 and limits_of(listed)["x-ratelimit-remaining-requests"] == "1"
        assert (await client.post("/v1/completions", json={"prompt": "hi"}, headers=paced)).status_code == 200
        refused = await client.post("/v1/completions", json={"prompt": "hi"}, headers=paced)
        assert refused.status_code == 429 and limits_of(refused)["x-ratelimit-remaining-requests"] == "0"
        assert list(refused.headers.keys()).count("x-ratelimit-limit-requests") == 1  # not sent twice
        # A key without limits gets none.
        free = await client.post("/v1/completions", json={"prompt": "hi"}, headers={"authorization": "Bearer free-key"})
        assert free.status_code == 200 and limits_of(free) == {}
